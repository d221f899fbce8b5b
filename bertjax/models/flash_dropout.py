"""Flash attention with the recipe's attention dropout: a Pallas TPU (Mosaic) kernel.

Each grid step takes one batch row and a block of heads, whole rows of keys (lengths up to
MAX_LENGTH), so the softmax needs no running maximum. As FlashAttention-2 does, the forward
pass keeps each row's log-sum-exp (4 bytes a row and head) and the backward pass recomputes
the probabilities from it, with the softmax gradient's row term from the output, rowsum(dO *
O) over the head's `D` columns rather than the `[L, L]` scores: per score the backward does
no maximum, sum or normalization of its own. No dropout mask is kept: the backward pass
draws the same random bits again, the counters' share of the hash done once per grid step
for all its heads (`attention_hash.premix`).
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
from typing import NamedTuple

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


def _scores(q_LxD: jax.Array, k_LxD: jax.Array, bias_LxL: jax.Array, scale: float) -> jax.Array:
    """The einsum path's float32 scores of one head, masked, transposed: `[keys, queries]`
    (a query's statistics are then a row, broadcast down the sublanes)."""
    return (
        lax.dot_general(k_LxD, q_LxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        * scale
        + bias_LxL
    )


def _counters(length: int) -> jax.Array:
    """The premixed counters `query * L + key` of a head's scores `[keys, queries]`."""
    keys = lax.broadcasted_iota(jnp.int32, (length, length), 0)
    queries = lax.broadcasted_iota(jnp.int32, (length, length), 1)
    return attention_hash.premix(queries * length + keys)


def _bias(q_ids_ref: jax.Ref, kv_ids_ref: jax.Ref, length: int) -> jax.Array:
    """0 where query and key share a segment id, else the additive mask: `[L, L]`, the same
    either way round."""
    q_ids = jnp.tile(q_ids_ref[0], (1, length // LANES))
    return jnp.where(q_ids == kv_ids_ref[0, :1], 0.0, MASK_VALUE).astype(jnp.float32)


def _heads(width: int, head_size: int) -> list[slice]:
    """The columns of each head in a block `width` columns wide (static slices)."""
    return [slice(h * head_size, (h + 1) * head_size) for h in range(width // head_size)]


def _keep(counters_LxL: jax.Array, seed: jax.Array, rate: float) -> jax.Array:
    """`attention_hash.keep` of the grid step's premixed counters under one head's seed."""
    return attention_hash.keep_premixed(counters_LxL, attention_hash.premix(seed), rate)


def _first_head(heads_per_step: int) -> jax.Array:
    """The flat `b * N + n` index of this grid step's first (row, head): its first seed."""
    return (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * heads_per_step


def _forward_kernel(
    seeds_ref: jax.Ref,
    qkv_ref: jax.Ref,
    q_ids_ref: jax.Ref,
    kv_ids_ref: jax.Ref,
    o_ref: jax.Ref,
    lse_ref: jax.Ref,
    *,
    rate: float,
    scale: float,
    head_size: int,
) -> None:
    length, width = qkv_ref.shape[2], qkv_ref.shape[3]
    bias = _bias(q_ids_ref, kv_ids_ref, length)
    counters = _counters(length)
    first = _first_head(width // head_size)
    for h, cols in enumerate(_heads(width, head_size)):
        scores = _scores(qkv_ref[0, 0, :, cols], qkv_ref[1, 0, :, cols], bias, scale)
        peak = jnp.max(scores, axis=0, keepdims=True)
        unnormalized = jnp.exp(scores - peak)
        sums = jnp.sum(unnormalized, axis=0, keepdims=True)
        keep = _keep(counters, seeds_ref[first + h], rate)
        v = qkv_ref[2, 0, :, cols]
        out = lax.dot_general(
            v,
            jnp.where(keep, unnormalized, 0.0).astype(v.dtype),
            (((0,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )  # `[D, queries]`, normalized and scaled by 1 / (1 - rate) per query there
        o_ref[0, :, cols] = (out * (1.0 / ((1.0 - rate) * sums))).T.astype(o_ref.dtype)
        lse_ref[0, 0, h : h + 1, :] = peak + jnp.log(sums)


def _backward_kernel(  # noqa: PLR0913 (Pallas hands the kernel its refs)
    seeds_ref: jax.Ref,
    qkv_ref: jax.Ref,
    o_ref: jax.Ref,
    do_ref: jax.Ref,
    lse_ref: jax.Ref,
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
    counters = _counters(length)
    first = _first_head(width // head_size)
    for h, cols in enumerate(_heads(width, head_size)):
        q, k, v = (qkv_ref[i, 0, :, cols] for i in range(3))
        do = do_ref[0, :, cols]
        # The softmax gradient's row term rowsum(probs * d_kept) (d_kept not yet scaled by
        # 1 / (1 - rate)) is (1 - rate) * rowsum(dO * O): `[D, queries]` summed over D.
        row_term = jnp.sum(
            (o_ref[0, :, cols].astype(jnp.float32) * do.astype(jnp.float32)).T,
            axis=0,
            keepdims=True,
        ) * (1.0 - rate)
        probs = jnp.exp(_scores(q, k, bias, scale) - lse_ref[0, 0, h : h + 1, :])
        d_dropped = lax.dot_general(
            v, do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        keep = _keep(counters, seeds_ref[first + h], rate)
        # The kept probabilities and their gradient, not yet scaled by 1 / (1 - rate) (nor the
        # scores' gradient by `scale`): the matmuls' `[L, D]` results are, once.
        kept = jnp.where(keep, probs, 0.0)
        d_kept = jnp.where(keep, d_dropped, 0.0)
        d_scores = probs * (d_kept - row_term)
        factors = (scale / (1.0 - rate),) * 2 + (1.0 / (1.0 - rate),)
        # `[keys, queries]` on the left: dq contracts its keys, dk and dv its queries.
        operands = ((d_scores, k, 0), (d_scores, q, 1), (kept, do, 1))
        for i, ((left, right, contracted), factor) in enumerate(zip(operands, factors)):
            product = lax.dot_general(
                left.astype(right.dtype),
                right,
                (((contracted,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )
            dqkv_ref[i, 0, :, cols] = (product * factor).astype(dqkv_ref.dtype)


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
    and the four gradient matmuls), one exp per score, the HBM bytes of its operands (the
    log-sum-exp of each row: forward writes it, backward reads it beside the output).
    The integer hash and the softmax's elementwise work (VPU) are not FLOPs."""
    scores = batch * heads * length * length
    tensor = batch * heads * length * head_size * itemsize
    ids = batch * length * (LANES + SUBLANES) * 4 + batch * heads * 4
    row_stats = batch * heads * length * 4
    return pl.CostEstimate(
        flops=2 * scores * head_size * (5 if backward else 2),
        transcendentals=scores,
        bytes_accessed=tensor * (8 if backward else 4) + ids + row_stats,
    )


class _Grid(NamedTuple):
    """The kernels' grid: a batch row and `per_step` heads a step, `head_size` columns each."""

    batch: int
    length: int
    heads: int
    head_size: int
    per_step: int

    @classmethod
    def of(cls, qkv_3xBxLxH: jax.Array, heads: int) -> _Grid:
        _, batch, length, width = qkv_3xBxLxH.shape
        head_size = width // heads
        return cls(batch, length, heads, head_size, block_heads(heads, length, head_size))

    def columns(self) -> pl.BlockSpec:
        """A `[B, L, H]` tensor's block: the step's row, its heads' columns."""
        return pl.BlockSpec(
            (1, self.length, self.per_step * self.head_size), lambda b, h, seeds: (b, 0, h)
        )

    def stacked(self) -> pl.BlockSpec:
        """q, k and v stacked `[3, B, L, H]`: the step's row and heads' columns of each."""
        return pl.BlockSpec(
            (3, 1, self.length, self.per_step * self.head_size), lambda b, h, seeds: (0, b, 0, h)
        )

    def row_stats(self) -> pl.BlockSpec:
        """A float32 per (row, head, query) `[B, N / per_step, per_step, L]`: the step's."""
        return pl.BlockSpec((1, 1, self.per_step, self.length), lambda b, h, seeds: (b, h, 0, 0))

    def row_stats_shape(self) -> jax.ShapeDtypeStruct:
        shape = (self.batch, self.heads // self.per_step, self.per_step, self.length)
        return jax.ShapeDtypeStruct(shape, jnp.float32)


def _call(
    kernel: Callable[..., None],
    grid: _Grid,
    tensors: tuple[jax.Array, ...],
    in_specs: list[pl.BlockSpec],
    out_specs: list[pl.BlockSpec],
    out_shape: list[jax.ShapeDtypeStruct],
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool,
) -> list[jax.Array]:
    """`kernel` over `grid` on `tensors` (`in_specs`), then the segment ids and the seeds."""
    q_ids = lax.broadcast_in_dim(ids_BxL, (grid.batch, grid.length, LANES), (0, 1))
    kv_ids = lax.broadcast_in_dim(ids_BxL, (grid.batch, SUBLANES, grid.length), (0, 2))
    return pl.pallas_call(
        functools.partial(
            kernel, rate=rate, scale=1.0 / math.sqrt(grid.head_size), head_size=grid.head_size
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(grid.batch, grid.heads // grid.per_step),
            in_specs=[
                *in_specs,
                pl.BlockSpec((1, grid.length, LANES), lambda b, h, seeds: (b, 0, 0)),
                pl.BlockSpec((1, SUBLANES, grid.length), lambda b, h, seeds: (b, 0, 0)),
            ],
            out_specs=out_specs,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost(
            grid.batch,
            grid.heads,
            grid.length,
            grid.head_size,
            tensors[0].dtype.itemsize,
            kernel is _backward_kernel,
        ),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(seeds_BxN.reshape(-1), *tensors, q_ids, kv_ids)


def _attend(
    qkv_3xBxLxH: jax.Array, ids_BxL: jax.Array, seeds_BxN: jax.Array, rate: float, interpret: bool
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel: the output `[B, L, H]` and its rows' log-sum-exp (`_Grid.row_stats`)."""
    grid = _Grid.of(qkv_3xBxLxH, seeds_BxN.shape[1])
    out, lse = _call(
        _forward_kernel,
        grid,
        (qkv_3xBxLxH,),
        [grid.stacked()],
        [grid.columns(), grid.row_stats()],
        [jax.ShapeDtypeStruct(qkv_3xBxLxH.shape[1:], qkv_3xBxLxH.dtype), grid.row_stats_shape()],
        ids_BxL,
        seeds_BxN,
        rate,
        interpret,
    )
    return out, lse


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
    return _attend(qkv_3xBxLxH, ids_BxL, seeds_BxN, rate, interpret)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _forward(
    qkv: jax.Array, ids: jax.Array, seeds: jax.Array, rate: float, interpret: bool
) -> tuple[jax.Array, Residuals]:
    out, lse = _attend(qkv, ids, seeds, rate, interpret)
    return out, (qkv, ids, seeds, out, lse)


def _backward(
    rate: float, interpret: bool, residuals: Residuals, d_out: jax.Array
) -> tuple[jax.Array, None, None]:
    qkv, ids, seeds, out, lse = residuals
    grid = _Grid.of(qkv, seeds.shape[1])
    d_out = d_out.astype(qkv.dtype)
    (dqkv,) = _call(
        _backward_kernel,
        grid,
        (qkv, out, d_out, lse),
        [grid.stacked(), grid.columns(), grid.columns(), grid.row_stats()],
        [grid.stacked()],
        [jax.ShapeDtypeStruct(qkv.shape, qkv.dtype)],
        ids,
        seeds,
        rate,
        interpret,
    )
    return dqkv, None, None


flash_dropout.defvjp(_forward, _backward)
