"""The FFN's GEMMs with the activation in their epilogues (`bertjax.models.feed_forward_gpu`),
in Pallas' interpret mode on the CPU: its erf against float64's; the block's output and
gradients against XLA's ops (`act(x @ W1 + b1) @ W2`) for each activation, float32 and
bfloat16; BERT's layer on `dense_impl="triton"` (these kernels and `add_norm_gpu`'s) against
the layer on XLA's ops (the same parameters, names and initial values: checkpoints move between
them), per shard under a mesh too; "auto" picking it on a GPU only; and (`aot`) its deviceless
compile for an H100, which runs Triton's own checks."""

import contextlib
import functools
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import erf as float64_erf

from bertjax.models import attention, compile_target, feed_forward_gpu
from bertjax.models.bert import encoder
from bertjax.models.bert.config import BertConfig
from bertjax.training import sharding

H100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")
KERNELS = (
    "feed_forward_forward",
    "feed_forward_backward",
    "add_norm_forward",
    "add_norm_backward",
)
XLA_ACTIVATIONS = {
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
}


def test_erf_is_within_half_a_micro_of_the_true_erf():
    """The kernel's erf (Triton has none) within 4.5e-7 of erf in float64 over [-6, 6]
    (XLA's float32 erf: 3.1e-7), and exactly +-1 beyond its clamp."""
    x = np.linspace(-6, 6, 200_001, dtype=np.float32)
    with jax.enable_x64():
        true = np.asarray(float64_erf(jnp.asarray(x, jnp.float64)))
    got = np.asarray(feed_forward_gpu.erf(jnp.asarray(x)), np.float64)
    assert np.max(np.abs(got - true)) < 4.5e-7
    assert np.all(np.abs(got[np.abs(x) > 4]) == 1.0)


def _block(rows: int = 256, width: int = 128, features: int = 256, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (rows, width))
    kernel = jax.random.normal(keys[1], (width, features)) * 0.1
    bias = jax.random.normal(keys[2], (features,))
    out_kernel = jax.random.normal(keys[3], (features, width)) * 0.1
    cotangent = jax.random.normal(keys[4], (rows, width))
    return [a.astype(dtype) for a in (x, kernel, bias, out_kernel)], cotangent.astype(dtype)


@pytest.mark.parametrize(
    "activation, dtype",
    [
        ("gelu", jnp.float32),
        ("gelu", jnp.bfloat16),
        ("gelu_tanh", jnp.float32),
        ("gelu_tanh", jnp.bfloat16),
        ("relu", jnp.float32),
    ],
)
def test_kernels_match_xlas_ops(activation, dtype):
    """Output and the gradients of x, both kernels and the bias. float32: to rounding (1e-5 of
    the largest value); bfloat16: XLA rounds the GEMM's output, the biased pre-activation and
    the activation's gradient apart where the kernels round each tile once, about two units
    in the last place (2e-2). (ReLU in bfloat16 is left out: a pre-activation rounded to the
    other side of 0 moves a whole gradient.)"""
    args, cotangent = _block(dtype=dtype)
    xla = XLA_ACTIVATIONS[activation]
    want, want_vjp = jax.vjp(lambda x, k, b, o: xla(x @ k + b) @ o, *args)
    got, got_vjp = jax.vjp(
        lambda *a: feed_forward_gpu.feed_forward(*a, activation, interpret=True), *args
    )
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, g, w in zip(
        ("output", "dx", "dW1", "db1", "dW2"),
        (got, *got_vjp(cotangent)),
        (want, *want_vjp(cotangent)),
    ):
        assert g.shape == w.shape and g.dtype == w.dtype == dtype, name
        _assert_close(g, w, tolerance, name)


def test_backward_sums_the_bias_gradient_over_every_block_of_rows():
    """The bias's gradient is the column sums of d_pre over all rows (several blocks of
    BLOCK_M), not of one block: against the gradient of the bias alone, computed by XLA."""
    args, cotangent = _block(rows=4 * feed_forward_gpu.BLOCK_M)
    x, kernel, bias, out_kernel = args
    pre = x @ kernel + bias
    _, derivative = feed_forward_gpu.ACTIVATIONS["gelu"](pre)
    want = jnp.sum((cotangent @ out_kernel.T) * derivative, axis=0)
    _, vjp = jax.vjp(
        lambda b: feed_forward_gpu.feed_forward(x, kernel, b, out_kernel, "gelu", True), bias
    )
    np.testing.assert_allclose(vjp(cotangent)[0], want, rtol=1e-5, atol=1e-4)


def _config(**fields) -> BertConfig:
    return BertConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        **fields,
    )


def _encoder_loss_and_grads(config: BertConfig, params, mesh=None):
    batch, length = 4, 128
    ids = np.ones((batch, length), np.int32)
    ids[0, 100:] = 0
    mask = attention.Mask(jnp.asarray(ids))
    x = jax.random.normal(jax.random.key(2), (batch, length, config.hidden_size))
    weights = jax.random.normal(jax.random.key(3), x.shape)

    def loss(params):
        out = encoder.BertEncoder(config).apply(
            params, x, mask, False, rngs={"dropout": jax.random.key(5)}
        )
        return jnp.sum(out.astype(jnp.float32) * weights)

    with contextlib.nullcontext() if mesh is None else sharding.activate(mesh):
        return jax.jit(jax.value_and_grad(loss))(params)


def _init(config: BertConfig):
    x = jnp.zeros((1, 128, config.hidden_size))
    mask = attention.Mask(jnp.ones((1, 128), jnp.int32))
    return encoder.BertEncoder(config).init({"params": jax.random.key(0)}, x, mask, True)


def _assert_close(got, want, rtol: float, name: str = "loss") -> None:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(
        got, want, rtol=0, atol=rtol * max(np.abs(want).max(), 1e-3), err_msg=name
    )


@pytest.mark.parametrize(
    "dtype, layout",
    [
        ("float32", {}),
        ("bfloat16", {}),
        pytest.param(
            "float32", {"scan_layers": True, "remat_policy": "full"}, marks=pytest.mark.slow
        ),
        pytest.param("float32", {"remat_policy": "dots"}, marks=pytest.mark.slow),
    ],
)
def test_the_layer_on_the_kernels_is_the_layer_on_xlas_ops(dtype, layout):
    """BERT's encoder (2 layers, dropout on) with dense_impl "triton" (both kernels, interpret
    mode) and "xla": the same parameters by name and initial value, and the same loss and
    gradients (float32 to 1e-5 of each gradient's largest value; bfloat16 to 3e-2), so the
    same dropout masks; scanned and rematerialised layers too (slow). The keys' bias is left
    out: softmax cancels it, so its gradient is rounding noise on either path."""
    on_xla, on_kernels = (
        _config(dtype=dtype, dense_impl="xla", **layout),
        _config(dtype=dtype, dense_impl="triton", **layout),
    )
    params = _init(on_xla)
    for config, kernels in ((on_xla, set()), (on_kernels, set(KERNELS))):
        traced = str(jax.make_jaxpr(lambda p, c=config: _encoder_loss_and_grads(c, p))(params))
        assert set(re.findall(r"name=(\w+_(?:forward|backward))", traced)) == kernels
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), params, _init(on_kernels)))
    (want_loss, want), (got_loss, got) = (
        _encoder_loss_and_grads(c, params) for c in (on_xla, on_kernels)
    )
    rtol = 1e-5 if dtype == "float32" else 3e-2
    _assert_close(got_loss, want_loss, rtol)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        name = jax.tree_util.keystr(path)
        if "['key']['bias']" not in name:
            _assert_close(g, w, rtol, name)


def test_the_layer_runs_the_kernels_per_shard_of_the_batch():
    """Under a 4-device mesh (data 2 x fsdp 2) the kernels run per shard (shard_map) and the
    kernels' gradients are summed over the shards: the unsharded run's loss and gradients."""
    config = _config(dense_impl="triton")
    params = _init(config)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1}, jax.devices()[:4])
    (want_loss, want), (got_loss, got) = (
        _encoder_loss_and_grads(config, params),
        _encoder_loss_and_grads(config, params, mesh),
    )
    _assert_close(got_loss, want_loss, 1e-5)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        _assert_close(g, w, 1e-5)


def test_auto_picks_the_kernels_on_a_gpu_in_16_bit_compute_only():
    runs = functools.partial(feed_forward_gpu.runs, width=1024, features=4096, activation="gelu")
    assert not runs("auto", "bfloat16", 128)  # the host: a CPU
    with compile_target.target_device(H100):
        assert runs("auto", "bfloat16", 128) and runs("auto", "bfloat16", 512)
        assert not runs("auto", "float32", 128)  # 16-bit compute only
        assert not runs("auto", "bfloat16", 200)  # whole tiles of rows only
        assert not runs("xla", "bfloat16", 128)
        assert not feed_forward_gpu.runs("auto", "bfloat16", 128, 1024, 4096, "swish")
        mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
        with sharding.activate(mesh):
            assert not runs("auto", "bfloat16", 128)  # the FFN's width split: XLA's ops
            with pytest.raises(ValueError, match="no mesh axis splitting the FFN's width"):
                runs("triton", "bfloat16", 128)
    with pytest.raises(ValueError, match=r"multiple of 128.*got length 200.*dense_impl='xla'"):
        runs("triton", "bfloat16", 200)
    with pytest.raises(ValueError, match="dense_impl"):
        _config(dense_impl="cublas")


@pytest.mark.aot
def test_kernels_compile_for_an_h100():
    """The deviceless H100 compile (the CUDA plugin's XLA, no GPU) of BERT-large's FFN on the
    kernels, forward and backward: two Triton calls, nothing interpreted, each carrying its
    FLOPs for the census; Triton's passes check what interpret mode does not (shared memory
    per block, layouts, supported ops)."""
    from bertjax.runtime import targets

    device = targets.devices(targets.TARGETS["h100"])[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    rows, width, features = 2048, 1024, 4096

    def loss(x, kernel, bias, out_kernel):
        out = feed_forward_gpu.feed_forward_layer(x, kernel, bias, out_kernel, "gelu")
        return jnp.sum(out.astype(jnp.float32))

    shapes = [
        jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placed)
        for shape in ((rows // 128, 128, width), (width, features), (features,), (features, width))
    ]
    with compile_target.target_device(device):
        compiled = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(*shapes).compile().as_text()
    assert compiled.count('custom_call_target="__gpu$xla.gpu.triton"') == 2
    assert "while" not in compiled  # no interpreted kernel
    declared = [
        feed_forward_gpu.cost(rows, width, features, 2, backward).flops
        for backward in (False, True)
    ]
    found = re.findall(r"serialized_metadata = .{0,20}flops\\22: \\22(\d+)", compiled)
    assert sorted(int(f) for f in found) == sorted(declared)
