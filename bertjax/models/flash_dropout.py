"""Flash attention with the recipe's attention dropout: a Pallas TPU (Mosaic) kernel.

Each grid step takes one batch row and a block of heads, whole rows of keys (lengths up to
MAX_LENGTH), so the softmax needs no running maximum and the backward pass
recomputes the probabilities exactly instead of reading any saved statistic. No dropout mask
is kept: as FlashAttention-2 does on GPU, the backward pass draws the same random bits again.
It reads q, k, v and writes its output as the projections on either side have them,
`[B, L, N * D]`, each head a static slice of columns: no transposes or relayouts around it,
and those projections stay lane-dense (BERT-large on tpu-v5p-8 at L=128, by libtpu's
estimate: the copies to and from heads-first `[B, N, L, D]` took 13.7 of 70.0 ms).

The bits are `attention_hash`'s counter-based hash of (the row's and head's seed, the query,
the key), the mask `attention_hash.keep_mask` draws in plain jnp and the GPU kernel
(`flash_dropout_gpu`) draws too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.models import attention_hash

MASK_VALUE = -10000.0  # the original additive mask (attention.ATTENTION_MASK_VALUE)
LANES, SUBLANES = 128, 8
# Whole rows of [L, L] float32 temporaries in VMEM: 1024 exceeds v4's and v5e's default
# scoped VMEM (16 MiB) in the deviceless compile; 512 compiles for every target slice.
MAX_LENGTH = 512
MAX_BLOCK_ROWS = 2048  # heads per grid step: as many as keep heads * length <= this


def _softmax_parts(
    q_LxD: jax.Array, k_LxD: jax.Array, bias_LxL: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """The einsum path's float32 softmax of one head's scores, unnormalized `[L, L]`, and the
    row sums `[L, 1]` that normalize it (divided once per row, or after the matmul)."""
    scores = (
        lax.dot_general(q_LxD, k_LxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        * scale
        + bias_LxL
    )
    unnormalized = jnp.exp(scores - jnp.max(scores, axis=1, keepdims=True))
    return unnormalized, jnp.sum(unnormalized, axis=1, keepdims=True)


def _bias(q_ids_ref: jax.Ref, kv_ids_ref: jax.Ref, length: int) -> jax.Array:
    """0 where query and key share a segment id, else the additive mask: `[L, L]`."""
    q_ids = jnp.tile(q_ids_ref[0], (1, length // LANES))
    return jnp.where(q_ids == kv_ids_ref[0, :1], 0.0, MASK_VALUE).astype(jnp.float32)


def _heads(width: int, head_size: int) -> list[slice]:
    """The columns of each head in a block `width` columns wide (static slices)."""
    return [slice(h * head_size, (h + 1) * head_size) for h in range(width // head_size)]


def _first_head(heads_per_step: int) -> jax.Array:
    """The flat `b * N + n` index of this grid step's first (row, head): its first seed."""
    return (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * heads_per_step


def _forward_kernel(
    seeds_ref: jax.Ref,
    qkv_ref: jax.Ref,
    q_ids_ref: jax.Ref,
    kv_ids_ref: jax.Ref,
    o_ref: jax.Ref,
    *,
    rate: float,
    scale: float,
    head_size: int,
) -> None:
    length, width = qkv_ref.shape[2], qkv_ref.shape[3]
    bias = _bias(q_ids_ref, kv_ids_ref, length)
    counters = attention_hash.counters(length, length)
    first = _first_head(width // head_size)
    for h, cols in enumerate(_heads(width, head_size)):
        unnormalized, sums = _softmax_parts(
            qkv_ref[0, 0, :, cols], qkv_ref[1, 0, :, cols], bias, scale
        )
        keep = attention_hash.keep(counters, seeds_ref[first + h], rate)
        v = qkv_ref[2, 0, :, cols]
        out = lax.dot(
            jnp.where(keep, unnormalized, 0.0).astype(v.dtype),
            v,
            preferred_element_type=jnp.float32,
        )  # normalized and scaled by 1 / (1 - rate) per row, `[L, D]` rather than `[L, L]`
        o_ref[0, :, cols] = (out * (1.0 / ((1.0 - rate) * sums))).astype(o_ref.dtype)


def _backward_kernel(
    seeds_ref: jax.Ref,
    qkv_ref: jax.Ref,
    do_ref: jax.Ref,
    q_ids_ref: jax.Ref,
    kv_ids_ref: jax.Ref,
    dqkv_ref: jax.Ref,
    *,
    rate: float,
    scale: float,
    head_size: int,
) -> None:
    length, width = qkv_ref.shape[2], qkv_ref.shape[3]
    bias = _bias(q_ids_ref, kv_ids_ref, length)
    counters = attention_hash.counters(length, length)
    first = _first_head(width // head_size)
    for h, cols in enumerate(_heads(width, head_size)):
        q, k, v = (qkv_ref[i, 0, :, cols] for i in range(3))
        do = do_ref[0, :, cols]
        unnormalized, sums = _softmax_parts(q, k, bias, scale)
        probs = unnormalized * (1.0 / sums)
        d_dropped = lax.dot_general(
            do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        keep = attention_hash.keep(counters, seeds_ref[first + h], rate)
        # The kept probabilities and their gradient, not yet scaled by 1 / (1 - rate) (nor the
        # scores' gradient by `scale`): the matmuls' `[L, D]` results are, once.
        kept = jnp.where(keep, probs, 0.0)
        d_kept = jnp.where(keep, d_dropped, 0.0)
        d_scores = probs * (d_kept - jnp.sum(probs * d_kept, axis=1, keepdims=True))
        factors = (scale / (1.0 - rate),) * 2 + (1.0 / (1.0 - rate),)
        operands = ((d_scores, k), (d_scores.T, q), (kept.T, do))
        for i, ((left, right), factor) in enumerate(zip(operands, factors)):
            dqkv_ref[i, 0, :, cols] = (
                lax.dot(left.astype(right.dtype), right, preferred_element_type=jnp.float32)
                * factor
            ).astype(dqkv_ref.dtype)


def block_heads(heads: int, length: int, head_size: int) -> int:
    """Heads per grid step: the most that divide `heads` with heads * length <= 2048 and
    whose columns fill whole 128-lane tiles (or are all the heads)."""
    return max(
        (
            h
            for h in range(1, heads + 1)
            if heads % h == 0
            and h * length <= MAX_BLOCK_ROWS
            and ((h * head_size) % LANES == 0 or h == heads)
        ),
        default=heads,
    )


def cost(
    batch: int, heads: int, length: int, head_size: int, itemsize: int, backward: bool
) -> pl.CostEstimate:
    """The kernel's cost: matmul FLOPs (forward QK^T and PV; backward their recomputed QK^T
    and the four gradient matmuls), one exp per score, the HBM bytes of its operands. The
    integer hash and the softmax's elementwise work (VPU) are not FLOPs."""
    scores = batch * heads * length * length
    tensor = batch * heads * length * head_size * itemsize
    ids = batch * length * (LANES + SUBLANES) * 4 + batch * heads * 4
    return pl.CostEstimate(
        flops=2 * scores * head_size * (5 if backward else 2),
        transcendentals=scores,
        bytes_accessed=tensor * (7 if backward else 4) + ids,
    )


def _call(
    kernel: Callable[..., None],
    qkv_3xBxLxH: jax.Array,
    d_out_BxLxH: jax.Array | None,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool,
) -> jax.Array:
    """The forward kernel's output `[B, L, H]`, or with `d_out_BxLxH` the backward kernel's
    gradient of q, k and v, `[3, B, L, H]`."""
    _, batch, length, width = qkv_3xBxLxH.shape
    heads = seeds_BxN.shape[1]
    head_size = width // heads
    per_step = block_heads(heads, length, head_size)
    one = pl.BlockSpec((1, length, per_step * head_size), lambda b, h, seeds: (b, 0, h))
    three = pl.BlockSpec((3, 1, length, per_step * head_size), lambda b, h, seeds: (0, b, 0, h))
    backward = d_out_BxLxH is not None
    q_ids = lax.broadcast_in_dim(ids_BxL, (batch, length, LANES), (0, 1))
    kv_ids = lax.broadcast_in_dim(ids_BxL, (batch, SUBLANES, length), (0, 2))
    tensors = (qkv_3xBxLxH,) + ((d_out_BxLxH,) if backward else ())
    return pl.pallas_call(
        functools.partial(kernel, rate=rate, scale=1.0 / math.sqrt(head_size), head_size=head_size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads // per_step),
            in_specs=[three]
            + ([one] if backward else [])
            + [
                pl.BlockSpec((1, length, LANES), lambda b, h, seeds: (b, 0, 0)),
                pl.BlockSpec((1, SUBLANES, length), lambda b, h, seeds: (b, 0, 0)),
            ],
            out_specs=three if backward else one,
        ),
        out_shape=jax.ShapeDtypeStruct(
            qkv_3xBxLxH.shape if backward else qkv_3xBxLxH.shape[1:], qkv_3xBxLxH.dtype
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost(batch, heads, length, head_size, qkv_3xBxLxH.dtype.itemsize, backward),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(seeds_BxN.reshape(-1), *tensors, q_ids, kv_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def flash_dropout(
    qkv_3xBxLxH: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool = False,
) -> jax.Array:
    """Attention `[B, L, N * D]` of q, k, v stacked (N: `seeds_BxN`'s heads): a query sees
    the keys of its own segment id (`ids_BxL` int32: 0 at padding, 1 elsewhere or the packed
    instance's number), dropout `rate` on the probabilities by
    `attention_hash.keep_mask(seeds_BxN, L, rate)`. L a multiple of 128; `interpret`: TPU
    interpret mode (on CPU, for tests)."""
    return _call(_forward_kernel, qkv_3xBxLxH, None, ids_BxL, seeds_BxN, rate, interpret)


def _forward(
    qkv: jax.Array, ids: jax.Array, seeds: jax.Array, rate: float, interpret: bool
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    return flash_dropout(qkv, ids, seeds, rate, interpret), (qkv, ids, seeds)


def _backward(
    rate: float,
    interpret: bool,
    residuals: tuple[jax.Array, jax.Array, jax.Array],
    d_out: jax.Array,
) -> tuple[jax.Array, None, None]:
    qkv, ids, seeds = residuals
    return (
        _call(_backward_kernel, qkv, d_out.astype(qkv.dtype), ids, seeds, rate, interpret),
        None,
        None,
    )


flash_dropout.defvjp(_forward, _backward)
