"""Flash attention with the recipe's attention dropout: a Pallas GPU (Triton) kernel.

FlashAttention-2 on the GPU: each program takes one block of queries of one batch row and head
and runs over the keys in blocks, with a running maximum and sum (the softmax never leaves the
chip); the backward pass is one program per block of keys and the same block of queries: the
gradients of k and v over all the queries, then the gradient of q over all the keys
(deterministic: no atomic adds, so a resume replays the same bits). The backward pass reads
the forward's row log-sum-exp (4 bytes per row and head) rather than recomputing it, which
would take a third pass of QK^T over all keys. No dropout mask is kept: both passes draw it
again from `attention_hash`, the same function of (the row's and head's seed, the query, the
key) as the TPU kernel (`flash_dropout`) and the einsum reference draw.

It reads q, k, v as the layer's projection writes them, one GEMM's `[B, L, 3, N, D]`
(`bias_matmul.project_stacked`), and writes `[B, L, N, D]` (the backward pass: the gradient
`[B, L, 3, N, D]`, which the projection's dX and dW GEMMs take as it is), each head a
strided block: no transposes around it.

Shape legend: B batch, L sequence length, N heads, D head size; Q a block of queries, K of keys.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bertjax.models import attention_hash, gpu_kernels
from bertjax.models.flash_dropout import MASK_VALUE

LOG2_E = math.log2(math.e)  # scores in base 2: exp2 is the GPU's native exponential
# Block sizes and warps (Triton's fused-attention tutorial for head size 64; powers of two, as
# Triton needs): the forward's queries and keys per step; the backward's major block (the
# keys whose dk, dv and the queries whose dq a program writes) and minor block (its loop).
BLOCK_Q, BLOCK_K = 128, 64
BLOCK_MAJOR, BLOCK_MINOR = 128, 32
FORWARD_PARAMS = dict(num_warps=4, num_stages=3)
BACKWARD_PARAMS = dict(num_warps=4, num_stages=2)
HEAD_SIZES = (16, 32, 64, 128)  # powers of two; Triton's dot needs at least 16


def fits(length: int, head_size: int) -> bool:
    """Whether the kernel takes rows of `length` tokens and heads of `head_size`: lengths a
    multiple of the largest block (counters `query * L + key` distinct up to 2**16 tokens)."""
    return head_size in HEAD_SIZES and length % BLOCK_MAJOR == 0 and length <= 2**16


def cost(
    batch: int, heads: int, length: int, head_size: int, itemsize: int, backward: bool
) -> pl.CostEstimate:
    """The kernel's matmul FLOPs, exponentials and HBM bytes (what `tools.gpu_census` charges
    it: XLA counts no FLOPs in a Triton call). Forward: QK^T and PV, reading q, k, v and
    writing the output and the row log-sum-exp; backward: QK^T, dO V^T in both scans, and dv,
    dk, dq, reading q, k, v, dO, the log-sum-exp and rowsum(dO * O), writing dq, dk, dv."""
    scores = batch * heads * length * length
    tensor = batch * length * heads * head_size * itemsize
    rows = batch * heads * length * 4
    ids = batch * length * 4 + batch * heads * 4
    return pl.CostEstimate(
        flops=2 * scores * head_size * (7 if backward else 2),
        transcendentals=scores * (2 if backward else 1),
        bytes_accessed=ids + (tensor * 7 + rows * 2 if backward else tensor * 4 + rows),
    )


def _scores(
    q_QxD: jax.Array, k_KxD: jax.Array, q_ids_Q: jax.Array, k_ids_K: jax.Array, scale: float
) -> jax.Array:
    """The einsum path's scores `q.k * scale`, plus -10000 between different segment ids, in
    base 2 (times log2(e)), float32 `[Q, K]`."""
    scores = plgpu.dot(q_QxD, k_KxD, trans_b=True) * (scale * LOG2_E)
    return scores + jnp.where(q_ids_Q[:, None] == k_ids_K[None, :], 0.0, MASK_VALUE * LOG2_E)


def _kept(
    probs_QxK: jax.Array,
    seed: jax.Array | None,
    rate: float,
    first_query: jax.Array,
    first_key: jax.Array,
    length: int,
) -> jax.Array:
    """The probabilities of a tile with the dropped ones 0 (kept ones not yet scaled); no
    `seed`: rate 0 (none read), all kept."""
    if seed is None:
        return probs_QxK
    queries, keys = probs_QxK.shape
    counters = attention_hash.counters(queries, keys, length, first_query, first_key)
    return jnp.where(attention_hash.keep(counters, seed, rate), probs_QxK, 0.0)


def _projection(
    qkv_ref: jax.Ref, bias_ref: jax.Ref, rows: slice | pl.Slice, which: int
) -> jax.Array:
    """q, k or v (`which`: 0, 1, 2) of `rows` plus its bias (in float32), in q's dtype."""
    x = qkv_ref[rows, which, :]
    return (x.astype(jnp.float32) + bias_ref[which, :].astype(jnp.float32)[None, :]).astype(x.dtype)


def _forward_kernel(
    seed_ref: jax.Ref,
    qkv_ref: jax.Ref,
    bias_ref: jax.Ref,
    ids_ref: jax.Ref,
    o_ref: jax.Ref,
    lse_ref: jax.Ref,
    *,
    rate: float,
    scale: float,
) -> None:
    length, head_size = qkv_ref.shape[0], qkv_ref.shape[2]
    first_query = pl.program_id(2) * BLOCK_Q
    queries = pl.ds(first_query, BLOCK_Q)
    q, q_ids = _projection(qkv_ref, bias_ref, queries, 0), ids_ref[queries]
    seed = seed_ref[...] if rate else None

    def step(
        block: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        out_QxD, max_Q, sum_Q = carry
        first_key = block * BLOCK_K
        keys = pl.ds(first_key, BLOCK_K)
        scores = _scores(q, _projection(qkv_ref, bias_ref, keys, 1), q_ids, ids_ref[keys], scale)
        new_max_Q = jnp.maximum(max_Q, jnp.max(scores, axis=1))
        correction_Q = jnp.exp2(max_Q - new_max_Q)
        probs = jnp.exp2(scores - new_max_Q[:, None])
        sum_Q = sum_Q * correction_Q + jnp.sum(probs, axis=1)
        kept = _kept(probs, seed, rate, first_query, first_key, length)
        v = _projection(qkv_ref, bias_ref, keys, 2)
        out_QxD = out_QxD * correction_Q[:, None] + plgpu.dot(kept.astype(v.dtype), v)
        return out_QxD, new_max_Q, sum_Q

    out_QxD, max_Q, sum_Q = lax.fori_loop(
        0,
        length // BLOCK_K,
        step,
        (
            jnp.zeros((BLOCK_Q, head_size), jnp.float32),
            jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32),
            jnp.zeros((BLOCK_Q,), jnp.float32),
        ),
    )
    o_ref[...] = (out_QxD / (sum_Q[:, None] * (1.0 - rate))).astype(o_ref.dtype)
    lse_ref[...] = max_Q + jnp.log2(sum_Q)


def _backward_kernel(  # noqa: PLR0913 (Pallas hands the kernel its refs)
    seed_ref: jax.Ref,
    qkv_ref: jax.Ref,
    bias_ref: jax.Ref,
    ids_ref: jax.Ref,
    do_ref: jax.Ref,
    lse_ref: jax.Ref,
    delta_ref: jax.Ref,
    dqkv_ref: jax.Ref,
    dbias_ref: jax.Ref,
    *,
    rate: float,
    scale: float,
) -> None:
    """dk, dv of keys block j over all queries, then dq of queries block j over all keys; and
    each one's sum over the block's rows (float32: its share of the bias's gradient)."""
    length = qkv_ref.shape[0]
    seed = seed_ref[...] if rate else None
    first = pl.program_id(2) * BLOCK_MAJOR
    major = pl.ds(first, BLOCK_MAJOR)

    # The tiles' gradients leave out the factors 1 / (1 - rate) and `scale`, common to every
    # element: the accumulated `[K, D]` and `[Q, D]` gradients take them once at the end.
    d_factor, v_factor = scale / (1.0 - rate), 1.0 / (1.0 - rate)

    def d_scores(
        probs: jax.Array,
        d_dropped: jax.Array,
        delta: jax.Array,
        first_query: jax.Array,
        first_key: jax.Array,
    ) -> jax.Array:
        """The gradient of the base-e scores from that of the dropped probabilities, divided
        by `d_factor`."""
        d_kept = _kept(d_dropped, seed, rate, first_query, first_key, length)
        return probs * (d_kept - delta[:, None] * (1.0 - rate))

    k, v = _projection(qkv_ref, bias_ref, major, 1), _projection(qkv_ref, bias_ref, major, 2)
    k_ids = ids_ref[major]

    def key_step(
        block: jax.Array, carry: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array]:
        dk, dv = carry
        first_query = block * BLOCK_MINOR
        queries = pl.ds(first_query, BLOCK_MINOR)
        q, do = _projection(qkv_ref, bias_ref, queries, 0), do_ref[queries, :]
        probs = jnp.exp2(_scores(q, k, ids_ref[queries], k_ids, scale) - lse_ref[queries][:, None])
        kept = _kept(probs, seed, rate, first_query, first, length)
        dv = dv + plgpu.dot(kept.astype(do.dtype), do, trans_a=True)
        d_dropped = plgpu.dot(do, v, trans_b=True)
        ds = d_scores(probs, d_dropped, delta_ref[queries], first_query, first)
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, length // BLOCK_MINOR, key_step, (zeros, zeros))
    for which, gradient in ((1, dk * d_factor), (2, dv * v_factor)):
        dqkv_ref[major, which, :] = gradient.astype(dqkv_ref.dtype)
        dbias_ref[which, :] = jnp.sum(gradient, axis=0)

    q, do, q_ids = _projection(qkv_ref, bias_ref, major, 0), do_ref[major, :], ids_ref[major]
    lse, delta = lse_ref[major], delta_ref[major]

    def query_step(block: jax.Array, dq: jax.Array) -> jax.Array:
        first_key = block * BLOCK_MINOR
        keys = pl.ds(first_key, BLOCK_MINOR)
        k, v = _projection(qkv_ref, bias_ref, keys, 1), _projection(qkv_ref, bias_ref, keys, 2)
        probs = jnp.exp2(_scores(q, k, q_ids, ids_ref[keys], scale) - lse[:, None])
        ds = d_scores(probs, plgpu.dot(do, v, trans_b=True), delta, first, first_key)
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, length // BLOCK_MINOR, query_step, zeros)
    dqkv_ref[major, 0, :] = (dq * d_factor).astype(dqkv_ref.dtype)
    dbias_ref[0, :] = jnp.sum(dq * d_factor, axis=0)


def _call_forward(
    qkv_BxLx3xNxD: jax.Array,
    bias_3xNxD: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """The output `[B, L, N, D]` and the row log-sum-exp (base 2) `[B, N, L]`."""
    batch, length, _, heads, head_size = qkv_BxLx3xNxD.shape
    itemsize = qkv_BxLx3xNxD.dtype.itemsize
    estimate = cost(batch, heads, length, head_size, itemsize, backward=False)
    return gpu_kernels.pallas_call(
        functools.partial(_forward_kernel, rate=rate, scale=1.0 / math.sqrt(head_size)),
        grid=(batch, heads, length // BLOCK_Q),
        in_specs=[
            pl.BlockSpec((None, None), lambda b, n, i: (b, n)),
            _stacked(length, head_size),
            pl.BlockSpec((3, None, head_size), lambda b, n, i: (0, n, 0)),
            pl.BlockSpec((None, length), lambda b, n, i: (b, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, BLOCK_Q, None, head_size), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, BLOCK_Q), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, length, heads, head_size), qkv_BxLx3xNxD.dtype),
            jax.ShapeDtypeStruct((batch, heads, length), jnp.float32),
        ],
        params=FORWARD_PARAMS,
        interpret=interpret,
        name="flash_dropout_forward",
        estimate=estimate,
    )(seeds_BxN, qkv_BxLx3xNxD, bias_3xNxD, ids_BxL)


def _stacked(length: int, head_size: int) -> pl.BlockSpec:
    """One head's q, k, v (or their gradients) of one row of the batch in `[B, L, 3, N, D]`:
    strided blocks `[L, 3, D]`."""
    return pl.BlockSpec((None, length, 3, None, head_size), lambda b, n, i: (b, 0, 0, n, 0))


def _call_backward(
    qkv_BxLx3xNxD: jax.Array,
    bias_3xNxD: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    d_out_BxLxNxD: jax.Array,
    out_BxLxNxD: jax.Array,
    lse_BxNxL: jax.Array,
    rate: float,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """The gradient of q, k and v, stacked `[B, L, 3, N, D]`, and its sums over each block
    of rows, float32 `[B, L / BLOCK_MAJOR, 3, N, D]` (the bias's gradient summed over them)."""
    batch, length, _, heads, head_size = qkv_BxLx3xNxD.shape
    itemsize = qkv_BxLx3xNxD.dtype.itemsize
    estimate = cost(batch, heads, length, head_size, itemsize, backward=True)
    # rowsum(dO * O) = rowsum(P * dP) (with dropout too: the dropped P times its gradient)
    delta_BxNxL = jnp.einsum(
        "blnd,blnd->bnl", out_BxLxNxD, d_out_BxLxNxD, preferred_element_type=jnp.float32
    )
    per_head = lambda b, n, i: (b, n, 0)  # noqa: E731
    blocks = length // BLOCK_MAJOR
    return gpu_kernels.pallas_call(
        functools.partial(_backward_kernel, rate=rate, scale=1.0 / math.sqrt(head_size)),
        grid=(batch, heads, blocks),
        in_specs=[
            pl.BlockSpec((None, None), lambda b, n, i: (b, n)),
            _stacked(length, head_size),
            pl.BlockSpec((3, None, head_size), lambda b, n, i: (0, n, 0)),
            pl.BlockSpec((None, length), lambda b, n, i: (b, 0)),
            pl.BlockSpec((None, length, None, head_size), lambda b, n, i: (b, 0, n, 0)),
            pl.BlockSpec((None, None, length), per_head),
            pl.BlockSpec((None, None, length), per_head),
        ],
        out_specs=[
            _stacked(length, head_size),
            pl.BlockSpec((None, None, 3, None, head_size), lambda b, n, i: (b, i, 0, n, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(qkv_BxLx3xNxD.shape, qkv_BxLx3xNxD.dtype),
            jax.ShapeDtypeStruct((batch, blocks, 3, heads, head_size), jnp.float32),
        ],
        params=BACKWARD_PARAMS,
        interpret=interpret,
        name="flash_dropout_backward",
        estimate=estimate,
    )(seeds_BxN, qkv_BxLx3xNxD, bias_3xNxD, ids_BxL, d_out_BxLxNxD, lse_BxNxL, delta_BxNxL)


def _heads(x: jax.Array, heads: int) -> jax.Array:
    """`[..., N * D]` as `[..., N, D]`."""
    return x.reshape((*x.shape[:-1], heads, -1))


def flash_dropout(
    qkv_BxLx3xH: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool = False,
) -> jax.Array:
    """Attention `[B, L, N * D]` of q, k, v stacked on axis 2 (N: `seeds_BxN`'s heads): a
    query sees the keys of its own segment id (`ids_BxL` int32: 0 at padding, 1 elsewhere or
    the packed instance's number), dropout `rate` on the probabilities by
    `attention_hash.keep_mask(seeds_BxN, L, rate)`: `flash_dropout.flash_dropout` on a GPU.
    L and D as `fits`; `interpret`: Pallas' interpret mode (on CPU, for tests)."""
    bias_3xH = jnp.zeros((3, qkv_BxLx3xH.shape[-1]), jnp.float32)
    return flash_dropout_biased(qkv_BxLx3xH, bias_3xH, ids_BxL, seeds_BxN, rate, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def flash_dropout_biased(
    qkv_BxLx3xH: jax.Array,
    bias_3xH: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    rate: float,
    interpret: bool = False,
) -> jax.Array:
    """`flash_dropout` of the projections without their biases (one GEMM's output) and the
    biases `[3, N * D]`, which the kernel adds as it loads each block (in float32) and whose
    gradient it sums as it writes q's, k's and v's: XLA adds no bias in the forward pass and
    reduces none in the backward."""
    return _forward(qkv_BxLx3xH, bias_3xH, ids_BxL, seeds_BxN, rate, interpret)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _forward(
    qkv: jax.Array,
    bias: jax.Array,
    ids: jax.Array,
    seeds: jax.Array,
    rate: float,
    interpret: bool,
) -> tuple[jax.Array, Residuals]:
    heads = seeds.shape[1]
    out, lse = _call_forward(_heads(qkv, heads), _heads(bias, heads), ids, seeds, rate, interpret)
    out = out.reshape(ids.shape + qkv.shape[-1:])
    return out, (qkv, bias, ids, seeds, out, lse)


def _backward(
    rate: float, interpret: bool, residuals: Residuals, d_out: jax.Array
) -> tuple[jax.Array, jax.Array, None, None]:
    qkv, bias, ids, seeds, out, lse = residuals
    heads = seeds.shape[1]
    d_qkv, d_bias_parts = _call_backward(
        _heads(qkv, heads),
        _heads(bias, heads),
        ids,
        seeds,
        _heads(d_out.astype(qkv.dtype), heads),
        _heads(out, heads),
        lse,
        rate,
        interpret,
    )
    d_bias = jnp.sum(d_bias_parts, axis=(0, 1)).reshape(bias.shape).astype(bias.dtype)
    return d_qkv.reshape(qkv.shape), d_bias, None, None


flash_dropout_biased.defvjp(_forward, _backward)
