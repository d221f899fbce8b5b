"""`attention_impl`: jax.nn.dot_product_attention (padding as key lengths) gives the einsum
path's outputs and gradients (fp32) and refuses to train with attention dropout it cannot
apply; the cuDNN path lowers for CUDA to cuDNN's fused kernel with the padding mask and
attention dropout; `auto` picks per backend."""

import contextlib
import dataclasses
import functools
import os
import re
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bertjax.models import attention, bias_matmul, compile_target, pallas_attention
from bertjax.models.bert import model as M
from bertjax.runtime import backend_env
from bertjax.training import sharding

CONFIG = M.BertConfig(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=24,
)


def _inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, CONFIG.vocab_size, (3, 12)).astype(np.int32)
    mask = np.ones((3, 12), np.int32)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    positions = np.array([[1, 2, 5], [1, 3, 6], [1, 2, 3]], np.int32)
    return ids, (np.arange(12) >= 6).astype(np.int32)[None].repeat(3, 0) * mask, mask, positions


def test_dot_product_attention_matches_einsum():
    inputs = _inputs()
    params = nn.meta.unbox(
        jax.jit(M.BertForPreTraining(CONFIG).init)(jax.random.PRNGKey(0), *inputs)["params"]
    )
    fused = dataclasses.replace(CONFIG, attention_impl="xla")

    def loss(params, config):
        mlm, nsp = M.BertForPreTraining(config).apply({"params": params}, *inputs)
        return (mlm**2).mean() + (nsp**2).mean(), (mlm, nsp)

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, outputs), grads = grad_fn(params, CONFIG)
    (_, fused_outputs), fused_grads = grad_fn(params, fused)
    for got, want in zip(
        jax.tree.leaves((fused_outputs, fused_grads)), jax.tree.leaves((outputs, grads))
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fused_attention_refuses_attention_dropout():
    inputs = _inputs()
    rngs = {"dropout": jax.random.PRNGKey(1)}

    def train_forward(config):  # traced only (eval_shape): nothing is compiled or run
        module = M.BertForPreTraining(config)
        params = jax.eval_shape(module.init, jax.random.PRNGKey(0), *inputs)
        return jax.eval_shape(
            lambda p: module.apply(p, *inputs, deterministic=False, rngs=rngs), params
        )

    with pytest.raises(ValueError, match="attention_probs_dropout_prob=0"):
        train_forward(dataclasses.replace(CONFIG, attention_impl="xla"))
    mlm, _ = train_forward(
        dataclasses.replace(CONFIG, attention_impl="xla", attention_probs_dropout_prob=0.0)
    )
    assert mlm.shape == (3, 3, CONFIG.vocab_size)
    with pytest.raises(ValueError, match="attention_impl"):
        M.BertConfig(attention_impl="flash")


def test_auto_picks_cudnn_only_where_it_runs():
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16", attention_probs_dropout_prob=0.0)
    assert bf16.resolved_attention_impl("gpu") == "cudnn"
    with_dropout = dataclasses.replace(bf16, attention_probs_dropout_prob=0.1)
    assert with_dropout.resolved_attention_impl("gpu") == "einsum"  # head size 8: no kernel
    assert bf16.resolved_attention_impl("cpu") == "einsum"
    assert with_dropout.resolved_attention_impl("tpu") == "pallas"  # bertjax's dropout kernel
    assert CONFIG.resolved_attention_impl("gpu") == "einsum"  # float32: no cuDNN flash kernel
    big_heads = dataclasses.replace(bf16, hidden_size=1024, num_attention_heads=4)  # D = 256
    assert big_heads.resolved_attention_impl("gpu") == "einsum"
    assert dataclasses.replace(CONFIG, attention_impl="xla").resolved_attention_impl("gpu") == "xla"
    assert M.BertConfig().resolved_attention_impl("cpu") == "einsum"


def test_cudnn_path_lowers_to_fused_kernel_with_padding_and_dropout(monkeypatch):
    """What crashed on a real GPU (a [B,1,1,L] bias the kernel refuses) is refused by JAX's
    own checks while tracing, so lowering for CUDA on the CPU catches it: here the training
    step must lower to cuDNN's forward and backward fused attention with dropout, taking the
    key lengths of the padding mask."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)  # no cuDNN on the CPU
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    config = dataclasses.replace(CONFIG, dtype="bfloat16", attention_impl="cudnn")
    ids, segments, mask, positions = _inputs()
    module = M.BertForPreTraining(config)
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), ids, segments, mask, positions)

    def loss(params):
        mlm, nsp = module.apply(
            params,
            ids,
            segments,
            mask,
            positions,
            deterministic=False,
            rngs={"dropout": jax.random.PRNGKey(1)},
        )
        return mlm.astype(np.float32).sum() + nsp.sum()

    hlo = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w+)\((.*?)\)", hlo)
    names = sorted({name for name, _ in calls})
    assert names == ["__cudnn$fmhaSoftmaxDropout", "__cudnn$fmhaSoftmaxDropoutBackward"]
    assert len(calls) == 2 * CONFIG.num_hidden_layers
    assert hlo.count("dropout_rate\\22: 0.1") == 2 * CONFIG.num_hidden_layers
    assert "fmha_scale\\22: 0.353553" in hlo  # 1/sqrt(head size 8)
    # q, k, v, then the query and key lengths: [B] int32 each (no [B,1,1,L] bias operand).
    forward_operands = [operands for name, operands in calls if not name.endswith("Backward")]
    assert all(operands.count(",") == 4 for operands in forward_operands)
    assert "tensor<3xi32>" in hlo


def test_cudnn_path_is_refused_by_jax_without_a_gpu():
    ids, segments, mask, positions = _inputs()
    config = dataclasses.replace(CONFIG, dtype="bfloat16", attention_impl="cudnn")
    with pytest.raises(Exception, match=r"cuDNN|GPU|gpu|cuda|CUDA"):
        jax.eval_shape(
            M.BertForPreTraining(config).init, jax.random.PRNGKey(0), ids, segments, mask, positions
        )


# ----------------------------------------------------------------------------- packed rows


def _packed_inputs(length=12):
    """Two packed rows of `length` tokens (three instances + padding, one instance) and the
    model inputs of `data.packing`: per-instance positions, instance ids, each [CLS]."""
    rng = np.random.default_rng(1)
    ids = rng.integers(5, 90, (2, length)).astype(np.int32)
    sizes = [[length // 3, length // 4, length // 3], [length - 2]]
    instance_ids = np.zeros((2, length), np.int32)
    positions = np.zeros((2, length), np.int32)
    cls = np.zeros((2, 3), np.int32)
    for row, row_sizes in enumerate(sizes):
        start = 0
        for number, size in enumerate(row_sizes, 1):
            instance_ids[row, start : start + size] = number
            positions[row, start : start + size] = np.arange(size)
            cls[row, number - 1] = start
            start += size
    segments = (positions > 2).astype(np.int32)
    masked = np.array([[1, length // 3 + 1, length - 3], [2, 3, 5]], np.int32)
    packed = {
        "position_ids": positions,
        "instance_ids": instance_ids,
        "next_sentence_positions": cls,
    }
    return (ids, segments, (instance_ids > 0).astype(np.int32), masked), packed


def _outputs_and_grads(config, inputs, packed, params):
    def loss(params):
        mlm, nsp = M.BertForPreTraining(config).apply({"params": params}, *inputs, **packed)
        return (mlm**2).mean() + (nsp**2).mean(), (mlm, nsp)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_same_model(config, impl, inputs, packed):
    params = nn.meta.unbox(
        jax.jit(M.BertForPreTraining(config).init)(jax.random.PRNGKey(0), *inputs)["params"]
    )
    want = _outputs_and_grads(config, inputs, packed, params)
    got = _outputs_and_grads(
        dataclasses.replace(config, attention_impl=impl), inputs, packed, params
    )
    for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)


def test_xla_path_takes_packed_rows():
    _assert_same_model(dataclasses.replace(CONFIG, num_hidden_layers=1), "xla", *_packed_inputs())


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_pallas_flash_attention_matches_einsum_in_interpret_mode():
    """The Pallas TPU kernel (TPU interpret mode on the CPU) gives the einsum path's outputs
    and gradients at every real token, for padded rows and for packed rows (segment ids)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 128, 2, 8)).astype(np.float32) for _ in range(3))
    (_, _, padding, _), packed = _packed_inputs(128)
    padding[1, 100:] = 0
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    # Padded rows on one device; packed rows per shard (batch over data, heads over tensor).
    for mask, spec in (
        (attention.Mask(padding), None),
        (attention.Mask(packed["instance_ids"], 3), P("data", "tensor")),
    ):
        real = np.asarray(mask.ids_BxL > 0)

        def loss(impl, q, k, v):
            out = attention.attend(impl, "float32", q, k, v, mask, lambda p: p, 0.0, 0, spec)  # noqa: B023 (called within this iteration)
            return jnp.sum(jnp.where(real[:, :, None, None], out, 0) ** 2), out  # noqa: B023 (called within this iteration)

        with sharding.activate(mesh) if spec else contextlib.nullcontext():
            results = {
                impl: jax.jit(
                    jax.value_and_grad(functools.partial(loss, impl), (0, 1, 2), has_aux=True)
                )(q, k, v)
                for impl in ("einsum", "pallas")
            }
            if spec:  # per (batch, head) shard: without shard_map XLA gathers onto one device
                split = jax.sharding.NamedSharding(mesh, P("data", None, "tensor", None))
                attend = functools.partial(
                    attention.attend,
                    "pallas",
                    "float32",
                    mask=mask,
                    dropout=None,
                    dropout_rate=0.0,
                    seed=0,
                    spec=spec,
                )
                compiled = (
                    jax.jit(attend, out_shardings=split)
                    .lower(*(jax.device_put(x, split) for x in (q, k, v)))
                    .compile()
                    .as_text()
                )
                assert "all-gather" not in compiled and "all-reduce" not in compiled
        (_, want), want_grads = results["einsum"]
        (_, got), got_grads = results["pallas"]
        np.testing.assert_allclose(
            np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-6
        )
        for got_grad, want_grad in zip(got_grads, want_grads):
            np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pallas_model_on_packed_rows_matches_einsum():
    """The whole model with the Pallas kernel, on one device and per shard on a (2, 1, 2)
    mesh (batch over data, heads over tensor): about 2 minutes, interpret mode simulates the
    devices one grid step at a time."""
    config = dataclasses.replace(
        CONFIG, num_hidden_layers=1, max_position_embeddings=128, vocab_size=96
    )  # the vocabulary is split over tensor too
    inputs, packed = _packed_inputs(128)
    _assert_same_model(config, "pallas", inputs, packed)
    with sharding.activate(
        sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    ):
        _assert_same_model(config, "pallas", inputs, packed)


def test_cudnn_path_lowers_packed_rows_to_segments(monkeypatch):
    """Packed rows lower to cuDNN's fused kernel with each row's instance lengths `[B, K]` and
    starts `[B, K+1]` (JAX's packed layout, Hopper or later) and no padding mask."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    config = dataclasses.replace(CONFIG, dtype="bfloat16", attention_impl="cudnn")
    inputs, packed = _packed_inputs()
    module = M.BertForPreTraining(config)
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), *inputs)

    def loss(params):
        mlm, nsp = module.apply(
            params, *inputs, deterministic=False, **packed, rngs={"dropout": jax.random.PRNGKey(1)}
        )
        return mlm.astype(np.float32).sum() + nsp.sum()

    hlo = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w+)\((.*?)\)", hlo)
    assert sorted({name for name, _ in calls}) == [
        "__cudnn$fmhaSoftmaxDropout",
        "__cudnn$fmhaSoftmaxDropoutBackward",
    ]
    # q, k, v, query and key lengths [2, 3], query and key starts [2, 4]
    assert all(operands.count(",") == 6 for name, operands in calls if name.endswith("Dropout"))
    assert "tensor<2x3xi32>" in hlo and "tensor<2x4xi32>" in hlo
    assert "mask_type\\22: \\22NO_MASK" in hlo and "PADDING" not in hlo
    lengths, starts = jax.jit(attention.packed_segments, static_argnums=1)(
        packed["instance_ids"], 3
    )
    np.testing.assert_array_equal(lengths, [[4, 3, 4], [10, -1, -1]])
    np.testing.assert_array_equal(starts, [[0, 4, 7, -1], [0, -1, -1, -1]])


def test_auto_picks_pallas_on_tpu():
    resolve = functools.partial(attention.resolve_impl, "auto", "bfloat16", 64, "tpu")
    assert resolve(0.0, 512) == "pallas" and resolve(0.0, 128, True) == "pallas"
    assert resolve(0.1, 512) == "pallas"  # training: bertjax's kernel with attention dropout
    assert resolve(0.1, 1024) == "einsum" and resolve(0.0, 1024) == "pallas"
    assert resolve(0.0, 100) == "einsum"  # not a multiple of the kernel's 128-token blocks
    # cuDNN runs packed rows only from Hopper on; this machine has no GPU to ask. Its
    # in-kernel dropout aborted on an H100 (benchmarks/gpu/README.md): opt-in only; with
    # dropout a GPU runs bertjax's Triton kernel (tests/test_flash_dropout_gpu.py).
    assert attention.resolve_impl("auto", "bfloat16", 64, "gpu", 0.0, 128, False) == "cudnn"
    assert attention.resolve_impl("auto", "bfloat16", 64, "gpu", 0.0, 128, True) == "einsum"
    assert attention.resolve_impl("auto", "bfloat16", 64, "gpu", 0.1, 128, False) == "pallas"
    with pytest.raises(ValueError, match="multiple of 128"):
        pallas_attention.pallas_attention(*(jnp.zeros((1, 100, 2, 8)),) * 3, jnp.ones((1, 100)))


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_sliding_windows_in_the_fused_paths_match_einsum(impl):
    """ModernBERT's two-sided window (keys at most 16 rows away) in JAX's XLA path and in the
    Pallas splash kernel (TPU interpret mode on the CPU), on padded and on packed rows: the
    outputs and gradients at every real token equal the einsum reference's band mask."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 128, 2, 8)).astype(np.float32) for _ in range(3))
    (_, _, padding, _), packed = _packed_inputs(128)
    padding[1, 100:] = 0
    for mask in (attention.Mask(padding, 0, 16), attention.Mask(packed["instance_ids"], 3, 16)):
        real = np.asarray(mask.ids_BxL > 0)

        def loss(impl, q, k, v):
            out = attention.attend(impl, "float32", q, k, v, mask, lambda p: p, 0.0, 0)  # noqa: B023 (called within this iteration)
            return jnp.sum(jnp.where(real[:, :, None, None], out, 0) ** 2), out  # noqa: B023 (called within this iteration)

        results = {
            name: jax.jit(
                jax.value_and_grad(functools.partial(loss, name), (0, 1, 2), has_aux=True)
            )(q, k, v)
            for name in ("einsum", impl)
        }
        (_, want), want_grads = results["einsum"]
        (_, got), got_grads = results[impl]
        np.testing.assert_allclose(
            np.asarray(got)[real], np.asarray(want)[real], rtol=1e-5, atol=1e-5
        )
        for got_grad, want_grad in zip(got_grads, want_grads):
            np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)
    assert attention.window_impl("cudnn", 16) == "einsum" and attention.window_impl("cudnn", 0)


def test_cudnn_is_kept_out_of_cuda_graphs_on_an_nvidia_host_unless_the_user_chose():
    """On a GPU host XLA_FLAGS gains the flag that lets cuDNN's attention dropout run (inside
    CUDA graphs it aborts); a user's own command-buffer setting and CPU hosts are left alone."""
    env = {"XLA_FLAGS": "--xla_dump_to=/x"}
    backend_env.cudnn_outside_command_buffers(env, gpu=True)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/x " + backend_env.CUDNN_OUTSIDE_COMMAND_BUFFERS
    backend_env.cudnn_outside_command_buffers(env, gpu=True)  # once only
    assert env["XLA_FLAGS"].count("xla_gpu_enable_command_buffer") == 1
    users = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    backend_env.cudnn_outside_command_buffers(users, gpu=True)
    assert users == {"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}
    cpu = {}
    backend_env.cudnn_outside_command_buffers(cpu, gpu=False)
    assert cpu == {}


def test_importing_bertjax_on_an_nvidia_host_sets_a_flag_this_jaxlib_accepts():
    """`import bertjax` applies it (NVIDIA device files faked), before JAX starts; XLA aborts
    on a flag value it does not know, and the installed jaxlib starts with this one."""
    code = (
        "import glob; real = glob.glob; glob.glob = lambda p: ['/dev/nvidia0'] "
        "if 'nvidia' in p else real(p)\n"
        "import os, bertjax; glob.glob = real; flags = os.environ['XLA_FLAGS']\n"
        "import jax; print(flags, float(jax.numpy.ones(2).sum()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=dict(env, JAX_PLATFORMS="cpu"),
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [backend_env.CUDNN_OUTSIDE_COMMAND_BUFFERS, "2.0"]


def test_the_bias_gradient_from_the_kernels_matmul_equals_autodiffs(monkeypatch):
    """On TPU the attention projections and the attention output dense take their biases'
    gradients from the kernel's matmul (`bias_matmul`): the model's values and gradients
    equal those of autodiff's ops (run here with the TPU choice forced, einsum attention)."""
    rng = np.random.default_rng(3)
    x, kernel, bias = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((2, 5, 6), (3, 6, 4), (3, 4))
    )
    results = [
        jax.value_and_grad(
            lambda *a: jnp.sum(jnp.sin(bias_matmul.project(*a, fused))),  # noqa: B023 (called within this iteration)
            (0, 1, 2),
        )(x, kernel, bias)
        for fused in (False, True)
    ]
    for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    config = dataclasses.replace(CONFIG, attention_impl="einsum")
    params = nn.meta.unbox(
        jax.jit(M.BertForPreTraining(config).init)(jax.random.PRNGKey(0), *_inputs())["params"]
    )
    want = _outputs_and_grads(config, _inputs(), {}, params)
    monkeypatch.setattr(compile_target, "target_platform", lambda: "tpu")
    for got_leaf, want_leaf in zip(
        jax.tree.leaves(_outputs_and_grads(config, _inputs(), {}, params)), jax.tree.leaves(want)
    ):
        np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-5, atol=1e-6)
