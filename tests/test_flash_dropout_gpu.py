"""The Pallas GPU (Triton) kernel with attention dropout (`bertjax.models.flash_dropout_gpu`),
in Pallas' interpret mode on the CPU: outputs and gradients against the einsum path given the
same mask (`attention_hash.hash_dropout`), padded and packed rows, float32 and bfloat16; its
mask bit for bit the TPU kernel's (`attention_hash.keep_mask`); "auto" picking it for dropout
training on a GPU; a train step resumed from a checkpoint replaying it exactly; and (`aot`)
its deviceless compile for an H100, which runs Triton's own checks (shared memory, layouts)."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.checkpoints import checkpoint
from bertjax.models import (
    attention,
    compile_target,
    flash_dropout_gpu,
    pallas_attention,
)
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.training import optim, sharding, steps
from bertjax.training.state import create_train_state
from test_flash_dropout import (
    CASES_AT_128,
    RATE,
    _assert_layer_matches_reference,
    _check_against_einsum,
    _ids,
    _inputs,
    _reference,
    assert_kernel_draws_keep_mask,
)

# What "auto" and "pallas" are traced for: a GPU (Hopper); the CPU still runs the program.
H100 = types.SimpleNamespace(platform="gpu", compute_capability="9.0")


@pytest.mark.parametrize("packed, dtype", CASES_AT_128)
def test_gpu_kernel_matches_einsum_with_the_same_mask_at_128_tokens(packed, dtype):
    """float32: to rounding (1e-5); bfloat16: both paths round the probabilities and the
    gradients' operands to bfloat16 in different orders (online softmax, base-2 exponentials),
    about one unit in the last place of values below 2 (2e-2), as the TPU kernel's test."""
    _check_against_einsum(128, packed, dtype, flash=flash_dropout_gpu.flash_dropout, axis=2)


@pytest.mark.parametrize(
    "packed, dtype",
    [
        (True, jnp.bfloat16),  # BERT's long phase: a few seconds in interpret mode
        pytest.param(True, jnp.float32, marks=pytest.mark.slow),
        pytest.param(False, jnp.float32, marks=pytest.mark.slow),
        pytest.param(False, jnp.bfloat16, marks=pytest.mark.slow),
    ],
)
def test_gpu_kernel_matches_einsum_with_the_same_mask_at_512_tokens(packed, dtype):
    _check_against_einsum(512, packed, dtype, flash=flash_dropout_gpu.flash_dropout, axis=2)


def test_gpu_kernel_without_dropout_is_flash_attention():
    """Rate 0 ("pallas" on a GPU where no dropout applies): no hash, every probability kept."""
    _check_against_einsum(
        128, True, jnp.float32, flash=flash_dropout_gpu.flash_dropout, rate=0.0, axis=2
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_kernel_adds_the_biases_and_returns_their_gradient(dtype):
    """`flash_dropout_biased` (what the layer runs on a GPU: the projections without their
    biases, which the kernel adds) against the einsum path on the biased q, k, v: outputs,
    the projections' gradients and the biases' (float32 sums over every row's)."""
    q, k, v, seeds, cotangent = _inputs(128, dtype)
    ids = _ids(128, packed=True)
    real = (ids > 0)[:, :, None, None]
    cotangent = jnp.where(real, cotangent, 0).astype(jnp.float32)
    bias = jax.random.normal(jax.random.key(9), (3, *q.shape[2:]), jnp.float32)

    def run(attend):
        def loss(qkv, bias):
            out = attend(qkv, bias)
            return jnp.sum(out.astype(jnp.float32) * cotangent), out

        qkv = jnp.stack([q, k, v], axis=2)
        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(qkv, bias)

    def kernel(qkv, bias):
        flat = qkv.reshape((*qkv.shape[:3], -1))
        out = flash_dropout_gpu.flash_dropout_biased(
            flat, bias.reshape(3, -1), ids, seeds, RATE, True
        )
        return out.reshape(q.shape)

    def reference(qkv, bias):
        biased = (qkv + bias.astype(dtype)).astype(dtype)
        return _reference(*(biased[:, :, i] for i in range(3)), ids, seeds, RATE)

    (_, got), got_grads = run(kernel)
    (_, want), want_grads = run(reference)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(
        np.where(real, got.astype(np.float32), 0),
        np.where(real, want.astype(np.float32), 0),
        **tolerance,
    )
    np.testing.assert_allclose(
        got_grads[0].astype(np.float32), want_grads[0].astype(np.float32), **tolerance
    )
    # the bias's gradient: the kernel's own row gradients summed (before it rounds them), and
    # the reference's, each of 256 rows within the tolerance above (bfloat16: summed, 0.25)
    for grads, atol in ((got_grads, 5e-2), (want_grads, 0.25)):
        summed = np.sum(grads[0].astype(np.float32), axis=(0, 1))
        np.testing.assert_allclose(got_grads[1], summed, rtol=tolerance["rtol"], atol=atol)


@pytest.mark.parametrize("length", [128, pytest.param(512, marks=pytest.mark.slow)])
def test_gpu_kernel_draws_the_tpu_kernels_mask_bit_for_bit(length):
    assert_kernel_draws_keep_mask(flash_dropout_gpu.flash_dropout, length, 128, axis=2)


def test_auto_picks_the_gpu_kernel_for_dropout_training_on_a_gpu():
    resolve = attention.resolve_impl
    assert resolve("auto", "bfloat16", 64, "gpu", 0.1, 128, False) == "pallas"
    assert resolve("auto", "bfloat16", 64, "gpu", 0.1, 512, True) == "pallas"  # packed rows
    assert resolve("auto", "float16", 64, "gpu", 0.1, 1024) == "pallas"  # no whole-row limit
    assert resolve("auto", "bfloat16", 64, "gpu", 0.0, 512) == "cudnn"  # no dropout: cuDNN
    assert resolve("auto", "float32", 64, "gpu", 0.1, 512) == "einsum"  # 16-bit compute only
    assert resolve("auto", "bfloat16", 64, "gpu", 0.1, 200) == "einsum"  # not 128-token blocks
    assert resolve("auto", "bfloat16", 48, "gpu", 0.1, 512) == "einsum"  # head size
    with compile_target.target_device(H100):
        assert attention.window_impl("pallas", 16) == "einsum"  # no windows in the kernel
        with pytest.raises(ValueError, match="on a GPU needs a sequence length"):
            pallas_attention.pallas_attention(
                *(jnp.zeros((1, 200, 2, 64)),) * 3, jnp.ones((1, 200)), dropout_rate=RATE
            )


def test_attend_runs_the_gpu_kernel_with_the_layers_seeds():
    """ "pallas" traced for a GPU runs the Triton kernel (interpret mode where the program is
    lowered for the CPU) with seeds from the layer's dropout stream: the einsum path given
    the same draw agrees."""
    _assert_layer_matches_reference(target=H100)


@pytest.mark.slow
def test_attend_runs_the_gpu_kernel_per_shard_with_its_seeds():
    _assert_layer_matches_reference(
        sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4]), H100
    )


def _pretraining_batch(seed: int, batch: int = 4, length: int = 128) -> dict:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, length), np.int32)
    mask[0, 100:] = 0
    return {
        "input_ids": rng.integers(5, 64, (batch, length)).astype(np.int32) * mask,
        "input_mask": mask,
        "segment_ids": (np.arange(length) >= 60).astype(np.int32)[None].repeat(batch, 0) * mask,
        "masked_lm_positions": np.sort(rng.integers(1, 100, (batch, 8)), 1).astype(np.int32),
        "masked_lm_ids": rng.integers(5, 64, (batch, 8)).astype(np.int32),
        "masked_lm_weights": np.ones((batch, 8), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,)).astype(np.int32),
    }


@pytest.mark.slow
def test_a_train_step_on_the_gpu_kernel_resumes_from_a_checkpoint_bit_for_bit(tmp_path):
    """BERT (one layer, one head of 64, bfloat16, attention dropout 0.1) with "auto" traced for
    an H100: the Triton kernel. Two steps from a state restored from the step-2 checkpoint
    give the uninterrupted run's losses and parameters bit for bit: the mask comes from the
    checkpointed RNG (cuDNN's generator, advanced by XLA at each execution, would not). The
    FFN runs its Triton GEMMs too (`feed_forward_gpu`)."""
    config = BertConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=1,
        intermediate_size=128,
        max_position_embeddings=128,
        dtype="bfloat16",
    )
    model = BertForPreTraining(config)
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=1, total_steps=10)
    )
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    example = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
    state, abstract, shardings = create_train_state(model, tx, jax.random.PRNGKey(0), example, mesh)
    step = steps.jit_train_step(steps.make_train_step(model, tx, 1), shardings, mesh)
    batches = [_pretraining_batch(i) for i in range(4)]
    meta = {"model": {"hidden_size": 64}}

    def run(state, batches):
        losses = []
        with sharding.activate(mesh), compile_target.target_device(H100):
            for batch in batches:
                state, metrics = step(state, sharding.global_batch_from_host(batch, mesh))
                losses.append(np.asarray(metrics["mlm_loss_sum"]))
        return state, losses

    with sharding.activate(mesh), compile_target.target_device(H100):
        traced = step.trace(state, sharding.global_batch_from_host(batches[0], mesh))
    assert re.search(r"pallas_call.*name=flash_dropout_forward", str(traced.jaxpr), re.S)
    assert re.search(r"pallas_call.*name=feed_forward_forward", str(traced.jaxpr), re.S)
    assert config.resolved_attention_impl("gpu") == "pallas"

    at_two, _ = run(state, batches[:2])
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=2, keep_latest=1)
    assert ckpt.save(2, at_two, {"phase": "short", "batch_index": 2}, meta)
    ckpt.close()
    straight, straight_losses = run(at_two, batches[2:])
    ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=2, keep_latest=1)
    restored, _, _ = ckpt.restore(2, abstract, meta)
    ckpt.close()
    resumed, resumed_losses = run(restored, batches[2:])
    np.testing.assert_array_equal(resumed_losses, straight_losses)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
        resumed.params,
        straight.params,
    )


@pytest.mark.aot
def test_gpu_kernel_compiles_for_an_h100():
    """The deviceless H100 compile (the CUDA plugin's XLA, no GPU) of attention through
    `pallas_attention` traced for it, forward and backward at 128 and 512 tokens (BERT-large's
    16 heads of 64): two Triton kernels per compile and nothing interpreted. XLA runs Triton's
    passes there, so the limits interpret mode does not check (shared memory per block,
    layouts, supported ops) are checked (a block over the H100's 227 KiB of shared memory
    fails this compile: RESOURCE_EXHAUSTED)."""
    from bertjax.runtime import targets

    device = targets.devices(targets.TARGETS["h100"])[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    batch, heads, head_size = 4, 16, 64
    for length in (128, 512):

        def loss(q, k, v, ids, seeds):
            out = pallas_attention.pallas_attention(
                q, k, v, ids, dropout_rate=RATE, seeds_BxN=seeds
            )
            return jnp.sum(out.astype(jnp.float32))

        shapes = [
            jax.ShapeDtypeStruct((batch, length, heads, head_size), jnp.bfloat16, sharding=placed)
        ] * 3 + [
            jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=placed),
            jax.ShapeDtypeStruct((batch, heads), jnp.int32, sharding=placed),
        ]
        with compile_target.target_device(device):
            compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*shapes).compile().as_text()
        assert compiled.count('custom_call_target="__gpu$xla.gpu.triton"') == 2
        assert "while" not in compiled  # no interpreted kernel
        # each call carries its FLOPs for the census (XLA counts none in a Triton call)
        declared = [
            flash_dropout_gpu.cost(batch, heads, length, head_size, 2, backward).flops
            for backward in (False, True)
        ]
        found = re.findall(r"serialized_metadata = .{0,20}flops\\22: \\22(\d+)", compiled)
        assert sorted(int(f) for f in found) == declared
