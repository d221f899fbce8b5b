"""Bias, dropout, residual add and LayerNorm in one pass (`bertjax.models.add_norm_gpu`), in
Pallas' interpret mode on the CPU: output and gradients against XLA's ops (flax's LayerNorm,
`dropout.apply_packed_mask`) with the same packed mask, float32 and bfloat16; which layers
run it; and (`aot`) its deviceless compile for an H100. The BERT layer on it against the
layer on XLA's ops: tests/test_feed_forward_gpu.py (`dense_impl="triton"` runs both)."""

import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models import add_norm_gpu, compile_target, dropout

H100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
RATE, EPSILON = 0.1, 1e-12


def _inputs(rows: int = 64, width: int = 256, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 7)
    y = jax.random.normal(keys[0], (rows, width)).astype(dtype)
    residual = (3.0 + jax.random.normal(keys[1], (rows, width))).astype(dtype)  # mean 3
    params = [jax.random.normal(k, (width,)) * 0.5 for k in keys[2:5]]
    packed = dropout.packed_keep_mask(keys[5], (rows, width), RATE)
    cotangent = jax.random.normal(keys[6], (rows, width)).astype(dtype)
    return y, params, packed, residual, cotangent


def _reference(y, bias, packed, residual, scale, offset):
    """BertDenseOutput's XLA ops: bias add and dropout in y's dtype, flax's LayerNorm."""
    dropped = dropout.apply_packed_mask(y + bias.astype(y.dtype), packed, RATE)
    norm = nn.LayerNorm(epsilon=EPSILON, dtype=y.dtype, param_dtype=jnp.float32)
    return norm.apply({"params": {"scale": scale, "bias": offset}}, dropped + residual)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernel_matches_xlas_ops_with_the_same_mask(dtype):
    """Output and the gradients of y, the bias, the residual and LayerNorm's scale and offset.
    float32: to 1e-5 of the largest value; bfloat16: XLA rounds the biased y and the dropped
    y apart, the kernel once, about two units in the last place (2e-2)."""
    y, (bias, scale, offset), packed, residual, cotangent = _inputs(dtype=dtype)

    def kernel(y, bias, residual, scale, offset):
        return add_norm_gpu.add_norm(y, bias, packed, residual, scale, offset, RATE, EPSILON, True)

    def reference(y, bias, residual, scale, offset):
        return _reference(y, bias, packed, residual, scale, offset)

    args = (y, bias, residual, scale, offset)
    got, got_vjp = jax.vjp(kernel, *args)
    want, want_vjp = jax.vjp(reference, *args)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(
        ("output", "dy", "dbias", "dresidual", "dscale", "doffset"),
        (got, *got_vjp(cotangent)),
        (want, *want_vjp(cotangent)),
    ):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)  # noqa: PLW2901
        np.testing.assert_allclose(g, w, rtol=0, atol=tolerance * np.abs(w).max(), err_msg=name)


def test_kernel_reads_the_packed_mask_bit_by_bit():
    """With y = 1, no bias and a zero residual, a row's dropped values are 1 / (1 - rate)
    where bit (column % 8) of byte (column / 8) is set, else 0: LayerNorm with scale 1 and
    offset 0 then maps kept and dropped columns to two values, kept the higher."""
    rows, width = 32, 128
    packed = dropout.packed_keep_mask(jax.random.key(3), (rows, width), 0.5)
    ones, zeros = jnp.ones((rows, width)), jnp.zeros((rows, width))
    vector_ones, vector_zeros = jnp.ones(width), jnp.zeros(width)
    out = add_norm_gpu.add_norm(
        ones, vector_zeros, packed, zeros, vector_ones, vector_zeros, 0.5, EPSILON, True
    )
    keep = (np.asarray(packed)[:, :, None] >> np.arange(8)) & 1
    keep = keep.reshape(rows, width).astype(bool)
    assert 0 < keep.mean() < 1
    row_max = np.asarray(out).max(axis=1, keepdims=True)
    np.testing.assert_array_equal(np.isclose(np.asarray(out), row_max), keep)


def test_runs_in_training_on_a_gpu_in_16_bit_compute_only():
    runs = add_norm_gpu.runs
    assert not runs("auto", "bfloat16", 128, 1024, RATE)  # the host: a CPU
    assert runs("triton", "float32", 128, 1024, RATE)  # forced: interpreted here
    with compile_target.target_device(H100):
        assert runs("auto", "bfloat16", 128, 1024, RATE) and runs("auto", "bfloat16", 32, 64, 0.5)
        assert not runs("auto", "bfloat16", 128, 1024, 0.0)  # no dropout (evaluation): XLA's
        assert not runs("auto", "float32", 128, 1024, RATE)  # 16-bit compute only
        assert not runs("auto", "bfloat16", 128, 768, RATE)  # a Triton block: a power of two
        assert not runs("auto", "bfloat16", 48, 1024, RATE)  # whole blocks of 32 rows
        assert not runs("xla", "bfloat16", 128, 1024, RATE)


@pytest.mark.aot
def test_kernel_compiles_for_an_h100():
    """The deviceless H100 compile of BERT-large's dense output tail, forward and backward:
    two Triton calls, nothing interpreted, each carrying its FLOPs."""
    from bertjax.runtime import targets

    device = targets.devices(targets.TARGETS["h100"])[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    batch, length, width = 16, 128, 1024

    def loss(y, residual, bias, scale, offset, packed):
        out = add_norm_gpu.add_norm_layer(y, bias, packed, residual, scale, offset, RATE, EPSILON)
        return jnp.sum(out.astype(jnp.float32))

    def shape(dims, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(dims, dtype, sharding=placed)

    shapes = [shape((batch, length, width))] * 2 + [shape((width,), jnp.float32)] * 3
    shapes.append(shape((batch, length, width // 8), jnp.uint8))
    with compile_target.target_device(device):
        compiled = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4))).lower(*shapes).compile().as_text()
    assert compiled.count('custom_call_target="__gpu$xla.gpu.triton"') == 2
    assert "while" not in compiled
    found = re.findall(r"serialized_metadata = .{0,20}flops\\22: \\22(\d+)", compiled)
    declared = [add_norm_gpu.cost(batch * length, width, 2, b).flops for b in (False, True)]
    assert sorted(int(f) for f in found) == declared
