"""The flash attention kernel with attention dropout (`bertjax.models.flash_dropout`), in TPU
interpret mode on the CPU, against the einsum path given the kernel's own mask
(`hash_dropout`): outputs and gradients at every real token, padded and packed rows, head
size 64; its dispatch from `attention.attend` inside a model (seeds from the dropout stream,
per shard under a mesh); and (`aot`) libtpu's compile of it for every target slice."""

import contextlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bertjax.models import (
    attention,
    attention_hash,
    compile_target,
    flash_dropout,
    pallas_attention,
)
from bertjax.models.bert import model as bert_model
from bertjax.training import sharding

RATE = 0.1
HEAD_SIZE = 64


def _ids(length: int, packed: bool) -> np.ndarray:
    """Two rows: padding after 100 of 128 tokens (scaled to `length`), or three packed
    instances then padding, and a full row."""
    unit = length // 128
    if packed:
        first = np.repeat([1, 2, 3, 0], [40 * unit, 50 * unit, 30 * unit, 8 * unit])
    else:
        first = np.repeat([1, 0], [100 * unit, 28 * unit])
    return np.stack([first, np.ones(length, int)]).astype(np.int32)


def _inputs(length: int, dtype, heads: int = 2):
    """q, k, v, seeds and a cotangent, `[B, L, N, D]` (the model's layout, the kernel's)."""
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(keys[i], (2, length, heads, HEAD_SIZE), dtype) for i in range(3))
    seeds = jax.random.randint(keys[3], (2, heads), -(2**31), 2**31 - 1, jnp.int32)
    return q, k, v, seeds, jax.random.normal(keys[4], (2, length, heads, HEAD_SIZE), dtype)


def _reference(q, k, v, ids, seeds, rate):
    """The einsum path with the kernel's mask."""
    mask = attention.Mask(jnp.asarray(ids), int(ids.max()) if ids.max() > 1 else 0)
    return attention.einsum_attention(
        q, k, v, attention.mask_bias(mask), attention_hash.hash_dropout(seeds, rate)
    )


def _check_against_einsum(
    length: int,
    packed: bool,
    dtype,
    heads: int = 2,
    flash=flash_dropout.flash_dropout,
    rate: float = RATE,
    axis: int = 0,
):
    """`flash` (a kernel taking q, k, v `[B, L, N * D]` stacked on `axis`: the TPU kernel's
    `[3, B, L, N * D]`, the GPU kernel's `[B, L, 3, N * D]`, in interpret mode) against the
    einsum path with its mask: outputs at every real token and gradients."""
    q, k, v, seeds, cotangent = _inputs(length, dtype, heads)
    ids = _ids(length, packed)
    real = (ids > 0)[:, :, None, None]
    cotangent = jnp.where(real, cotangent, 0)  # nothing reads a padding query's output

    def run(attend):
        def loss(q, k, v):
            out = attend(q, k, v, ids, seeds, rate)
            return jnp.sum(out.astype(jnp.float32) * cotangent.astype(jnp.float32)), out

        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

    def kernel(q, k, v, ids, seeds, rate):  # the kernel takes the projections stacked
        qkv = jnp.stack([x.reshape((*x.shape[:2], -1)) for x in (q, k, v)], axis)
        return flash(qkv, ids, seeds, rate, True).reshape(q.shape)

    (_, got), got_grads = run(kernel)
    (_, want), want_grads = run(_reference)
    tolerance = (
        dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    )  # bf16 outputs: about one unit in the last place
    np.testing.assert_allclose(
        np.where(real, got.astype(np.float32), 0),
        np.where(real, want.astype(np.float32), 0),
        **tolerance,
    )
    for got_grad, want_grad in zip(got_grads, want_grads):
        np.testing.assert_allclose(
            got_grad.astype(np.float32), want_grad.astype(np.float32), **tolerance
        )


# (packed, dtype) at 128 tokens: two in the default suite, the other two `slow`
CASES_AT_128 = [
    (False, jnp.float32),
    (True, jnp.bfloat16),
    pytest.param(False, jnp.bfloat16, marks=pytest.mark.slow),
    pytest.param(True, jnp.float32, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("packed, dtype", CASES_AT_128)
def test_kernel_matches_einsum_with_the_same_mask_at_128_tokens(packed, dtype):
    _check_against_einsum(128, packed, dtype)


def test_each_grid_step_takes_its_heads_columns_and_seeds():
    """18 heads of 64 at 128 tokens: 6 heads (384 columns) per grid step, three steps along
    the heads, each head its own columns of `[B, L, N * D]` and its own seed."""
    assert flash_dropout.block_heads(18, 128, HEAD_SIZE) == 6
    _check_against_einsum(128, True, jnp.float32, heads=18)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_kernel_matches_einsum_with_the_same_mask_at_512_tokens(packed):
    _check_against_einsum(512, packed, jnp.float32)
    _check_against_einsum(512, packed, jnp.bfloat16)


def test_the_mask_keeps_nine_in_ten_independently_per_row_and_head():
    seeds = jax.random.randint(jax.random.key(1), (4, 4), -(2**31), 2**31 - 1, jnp.int32)
    keep = np.asarray(attention_hash.keep_mask(seeds, 256, RATE))
    # 2**20 draws: the keep rate within 4 standard deviations of 1 - round(0.1 * 2**16) / 2**16
    expected = 1 - round(RATE * 2**16) / 2**16
    assert abs(keep.mean() - expected) < 4 * np.sqrt(expected * (1 - expected) / keep.size)
    # every (row, head) draws its own mask: any two agree as independent draws would (0.82)
    flat = keep.reshape(16, -1)
    agreement = (flat[:, None] == flat[None]).mean(-1)[~np.eye(16, dtype=bool)]
    assert np.all(np.abs(agreement - (expected**2 + (1 - expected) ** 2)) < 0.01)
    # and within a row, neighbouring queries and keys are not alike either
    for axis in (2, 3):
        pairs = np.take(keep, range(255), axis) == np.take(keep, range(1, 256), axis)
        assert abs(pairs.mean() - (expected**2 + (1 - expected) ** 2)) < 0.01


def test_the_fused_kernels_refuse_a_rate_their_16_bit_draws_cannot_take():
    """The keep test compares the hash with threshold << 16: a rate that rounds to 2**16
    (1, or within 2**-17 of it) or a negative one is refused with the rate named."""
    assert attention_hash.threshold(RATE) == 6554
    assert attention_hash.threshold(1 - 2**-16) == 2**16 - 1
    for rate in (1.0, 1 - 2**-18, -0.1):
        with pytest.raises(
            ValueError, match=rf"attention dropout rate {rate}: .*\[0, 1 - 2\*\*-17\)"
        ):
            attention_hash.threshold(rate)


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """C. Wellons' lowbias32 on uint32, in numpy."""
    x = x ^ (x >> 16)
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> 16)


def test_the_mask_is_lowbias32s_top_16_bits_of_counter_xor_seed():
    """The documented mask (docs/deviations.md section 7), from numpy's lowbias32: `keep`
    reads its top 16 bits before the last xor-shift, which leaves them unchanged."""
    seeds = np.random.default_rng(4).integers(-(2**31), 2**31, (3, 2)).astype(np.int32)
    length = 256
    counters = np.arange(length * length, dtype=np.uint32).reshape(length, length)
    hashed = _lowbias32(counters[None, None] ^ seeds.view(np.uint32)[:, :, None, None])
    want = (hashed >> 16) >= round(RATE * 2**16)
    got = np.asarray(attention_hash.keep_mask(jnp.asarray(seeds), length, RATE))
    np.testing.assert_array_equal(got, want)
    mixed = np.asarray(attention_hash.mix(jnp.asarray(counters.view(np.int32))))
    np.testing.assert_array_equal(mixed.view(np.uint32), _lowbias32(counters))


def bit_weights(length: int, head_size: int) -> np.ndarray:
    """`[L, D]`: row r is 2**(r // D) at column r % D, so a sum over rows of kept flags
    reads back, column by column, as one bit per row."""
    rows = np.arange(length)
    weights = np.zeros((length, head_size), np.float32)
    weights[rows, rows % head_size] = 2.0 ** (rows // head_size)
    return weights


def bits_to_mask(sums_BxLxNxD: np.ndarray, length: int) -> np.ndarray:
    """bool `[B, N, L(rows), L(summed)]` from sums of `bit_weights` rows (integers)."""
    head_size = sums_BxLxNxD.shape[-1]
    sums = np.rint(sums_BxLxNxD).astype(np.int64).transpose(0, 2, 1, 3)  # [B, N, L, D]
    summed = np.arange(length)
    return (sums[..., summed % head_size] >> (summed // head_size)) & 1 == 1


def assert_kernel_draws_keep_mask(flash, length: int, head_size: int, axis: int) -> None:
    """q = k = 0 and no padding make every probability 1/L; v (then the output's cotangent)
    holds one bit per key (query): the output of `flash` (q, k, v stacked on `axis`, in
    interpret mode) reads back which keys each query kept, the gradient of v which queries
    kept each key, both equal to `keep_mask`, bit for bit."""
    batch, heads = 2, 2
    seeds = jax.random.randint(jax.random.key(3), (batch, heads), -(2**31), 2**31 - 1, jnp.int32)
    bits = np.broadcast_to(
        bit_weights(length, head_size)[None, :, None], (batch, length, heads, head_size)
    ).reshape(batch, length, heads * head_size)
    zeros = np.zeros_like(bits)
    ids = jnp.ones((batch, length), jnp.int32)
    scale = length * (1 - RATE)  # each kept value is 1 / L / (1 - rate)

    def out_and_dv(qkv):
        out, vjp = jax.vjp(lambda qkv: flash(qkv, ids, seeds, RATE, True), qkv)
        return out, jnp.take(vjp(jnp.asarray(bits))[0], 2, axis)

    out, dv = jax.jit(out_and_dv)(jnp.stack([zeros, zeros, bits], axis))
    want = np.asarray(attention_hash.keep_mask(seeds, length, RATE))
    shape = (batch, length, heads, head_size)
    np.testing.assert_array_equal(
        bits_to_mask(np.asarray(out).reshape(shape) * scale, length), want
    )
    kept_by_key = bits_to_mask(np.asarray(dv).reshape(shape) * scale, length)
    np.testing.assert_array_equal(kept_by_key, want.transpose(0, 1, 3, 2))
    assert 0.85 < want.mean() < 0.95  # dropout is applied: about 1 - rate kept


@pytest.mark.parametrize("length", [128, pytest.param(512, marks=pytest.mark.slow)])
def test_the_kernel_draws_keep_masks_mask_bit_for_bit(length):
    assert_kernel_draws_keep_mask(flash_dropout.flash_dropout, length, HEAD_SIZE, axis=0)


class _Attend(nn.Module):
    """`attention.attend` as a model layer calls it, or the einsum path with the mask of the
    seeds the layer draws (the same module path, so the same draw)."""

    impl: str
    spec: tuple | None = None

    @nn.compact
    def __call__(self, q, k, v, mask):
        if self.impl == "reference":
            seeds = attention_hash.AttentionSeeds()(q.shape[0], q.shape[2])
            return attention.einsum_attention(
                q, k, v, attention.mask_bias(mask), attention_hash.hash_dropout(seeds, RATE)
            )
        return attention.attend(self.impl, "bfloat16", q, k, v, mask, None, RATE, 0, self.spec)


def _attend_in_a_layer(impl: str, mesh=None, target=None):
    q, k, v, _, cotangent = _inputs(128, jnp.bfloat16, heads=4)
    ids = _ids(128, packed=True)
    mask = attention.Mask(jnp.asarray(ids), 3)
    real = (ids > 0)[:, :, None, None]
    spec = P("data", "tensor") if mesh is not None else None

    def loss(q, k, v):
        out = _Attend(impl, spec).apply({}, q, k, v, mask, rngs={"dropout": jax.random.key(7)})
        return jnp.sum(jnp.where(real, out, 0).astype(jnp.float32) * cotangent), out

    with (
        sharding.activate(mesh)
        if mesh is not None
        else compile_target.target_device(jax.devices()[0]),
        compile_target.target_device(target) if target else contextlib.nullcontext(),
    ):
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v), real


def _assert_layer_matches_reference(mesh=None, target=None):
    """ "pallas" in a layer (traced for `target`, default the mesh's or the CPU) against the
    einsum path with the mask of the seeds the layer draws."""
    ((_, got), got_grads), real = _attend_in_a_layer("pallas", mesh, target)
    ((_, want), want_grads), _ = _attend_in_a_layer("reference")
    np.testing.assert_allclose(
        np.where(real, got, 0).astype(np.float32),
        np.where(real, want, 0).astype(np.float32),
        rtol=2e-2,
        atol=2e-2,
    )
    for got_grad, want_grad in zip(got_grads, want_grads):
        np.testing.assert_allclose(
            got_grad.astype(np.float32), want_grad.astype(np.float32), rtol=2e-2, atol=2e-2
        )


def test_attend_draws_seeds_from_the_layers_dropout_stream():
    """ "pallas" with attention dropout runs the kernel with seeds from the layer's dropout
    RNG: the einsum path given the same draw agrees."""
    _assert_layer_matches_reference()


@pytest.mark.slow
def test_attend_runs_the_kernel_per_shard_with_its_seeds():
    """Under a (data 2, tensor 2) mesh the kernel runs per shard, each with its rows' and
    heads' seeds: the same values as on one device."""
    _assert_layer_matches_reference(
        sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    )


def _layer_loss_and_grads(direct: bool, monkeypatch):
    """A bfloat16 BERT layer (two heads of 64, attention dropout 0.1, "pallas") on packed rows
    in training: its loss and gradients, with the kernel reading the projection's stack as
    it is (`direct`) or through `attend`'s q, k and v (as the layer did before)."""
    config = bert_model.BertConfig(
        vocab_size=64,
        hidden_size=2 * HEAD_SIZE,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        attention_impl="pallas",
        dtype="bfloat16",
        attention_probs_dropout_prob=RATE,
    )
    ids = _ids(128, packed=True)
    tokens = np.where(ids > 0, np.arange(128) % 60 + 4, 0).astype(np.int32)
    model = bert_model.BertModel(config)
    inputs = (tokens, np.zeros_like(tokens), ids)
    params = jax.jit(model.init)(jax.random.key(0), *inputs)["params"]
    with monkeypatch.context() as patch:
        if not direct:
            patch.setattr(attention, "runs_flash_dropout", lambda *args: False)

        def loss(params):
            sequence, _ = model.apply(
                {"params": params}, *inputs, False, rngs={"dropout": jax.random.key(5)}
            )
            return jnp.sum(jnp.where(ids[:, :, None] > 0, sequence, 0).astype(jnp.float32) ** 2)

        return jax.jit(jax.value_and_grad(loss))(params)


def test_the_layer_hands_the_kernel_its_projection_as_it_is(monkeypatch):
    """On TPU the layer gives the kernel the projection's `[3, B, L, H]` (no q, k, v slices
    to restack in the backward pass): the same loss and gradients, bit for bit, as through
    `attend`, so the same seeds and the same layout."""
    mask = attention.Mask(jnp.asarray(_ids(128, True)), 3)
    assert attention.runs_flash_dropout("pallas", "bfloat16", HEAD_SIZE, 128, mask, RATE)
    assert not attention.runs_flash_dropout("pallas", "bfloat16", HEAD_SIZE, 128, mask, 0.0)
    direct_loss, direct_grads = _layer_loss_and_grads(True, monkeypatch)
    loss, grads = _layer_loss_and_grads(False, monkeypatch)
    assert float(direct_loss) == float(loss)
    jax.tree.map(np.testing.assert_array_equal, direct_grads, grads)


def test_pallas_refuses_dropout_beyond_its_length_and_in_windows():
    with pytest.raises(ValueError, match="at most 512 with attention dropout"):
        pallas_attention.pallas_attention(
            *(jnp.zeros((1, 1024, 2, 8)),) * 3, jnp.ones((1, 1024)), dropout_rate=RATE
        )
    # ModernBERT's sliding windows: the splash kernel has no dropout, the reference runs them
    assert attention.window_impl("pallas", 16, RATE) == "einsum"
    assert attention.window_impl("pallas", 16) == "pallas"


@pytest.mark.aot
@pytest.mark.parametrize("target", ["tpu-v4-8", "tpu-v5e-8", "tpu-v5p-8", "tpu-v6e-8"])
def test_kernel_compiles_for_every_target_slice(target):
    """libtpu compiles the forward and backward kernels at 128 and 512 tokens (BERT-large's
    16 heads of 64), and the compiled step's FLOPs are the kernel's declared estimate."""
    from bertjax.runtime import targets

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    device = targets.devices(targets.TARGETS[target])[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    batch, heads = 4, 16
    for length in (128, 512):

        def loss(qkv, ids, seeds):
            out = flash_dropout.flash_dropout(qkv, ids, seeds, RATE)  # [B, L, N * D]
            return jnp.sum(out.astype(jnp.float32))

        shapes = [
            jax.ShapeDtypeStruct(
                (3, batch, length, heads * HEAD_SIZE), jnp.bfloat16, sharding=placed
            ),
            jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=placed),
            jax.ShapeDtypeStruct((batch, heads), jnp.int32, sharding=placed),
        ]
        compiled = jax.jit(jax.value_and_grad(loss)).lower(*shapes).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        declared = [
            flash_dropout.cost(batch, heads, length, HEAD_SIZE, 2, backward)
            for backward in (False, True)
        ]
        assert cost["flops"] >= sum(c.flops for c in declared)
        assert cost["transcendentals"] >= sum(c.transcendentals for c in declared)
