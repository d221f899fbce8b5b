"""The dense output's bias, dropout, residual add and post-LayerNorm in one pass: Pallas GPU
(Triton).

`LayerNorm(dropout(y + bias) + residual)`, BERT's tail of each sublayer. XLA runs it as three
passes over `[B, L, H]`: the bias, dropout and residual add (writing the sum), LayerNorm's
statistics (reading it), and the normalization (reading it again). Here one program takes a
block of whole rows and writes the normalized output and the sum (which the backward pass
reads) once; the row means and reciprocal standard deviations (4 bytes a row each) are kept
for the backward pass, which stays XLA's ops (its passes are the ones autodiff makes today).

The keep mask is the one `dropout.Dropout` draws (`dropout.packed_keep_mask`: 1 bit an
element, 8 a byte), read packed: the same draw as XLA's path, replayed on resume. The sum is
rounded to the compute dtype before LayerNorm reads it, as XLA's path rounds it; each output
is rounded once.

Shape legend: M rows (batch x length), H the hidden size; BLOCK_M rows a program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from bertjax.models import compile_target, gpu_kernels

BLOCK_M = 8  # rows a step: 8 x 1024 float32 values a tensor over 4 warps
BACKWARD_ROWS = 32  # rows a backward program (its column sums: one row of partial sums each)
PARAMS = dict(num_warps=4, num_stages=1)


def fits(rows: int, width: int) -> bool:
    """Whether the kernels take `rows` of `width`: whole blocks of rows, a power-of-two width
    (a Triton block) that whole bytes of the mask cover."""
    return rows % BACKWARD_ROWS == 0 and width >= 8 and width & (width - 1) == 0


def cost(rows: int, width: int, itemsize: int, backward: bool) -> pl.CostEstimate:
    """What a kernel moves (`tools.gpu_census` charges a Triton call by it). Forward: y, the
    residual and the packed mask read, the output, the sum and two float32 values a row
    written; backward: the output's gradient, the sum, the mask and the row values read, the
    gradients of y and of the sum written, and three float32 column sums per BACKWARD_ROWS."""
    moved = rows * width * 4 * itemsize + rows * width // 8 + rows * 8
    if backward:
        moved += rows // BACKWARD_ROWS * 3 * width * 4
    return pl.CostEstimate(
        flops=(16 if backward else 10) * rows * width,
        transcendentals=rows,
        bytes_accessed=moved,
    )


def _keep(packed_ref: jax.Ref, first_row: jax.Array | int, rows: int, width: int) -> jax.Array:
    """The `[rows, width]` keep mask from `first_row` of the block's packed bytes (bit i of
    byte j: column 8j + i), each byte loaded for its 8 columns."""
    columns = jnp.arange(width, dtype=jnp.int32)
    row_index = first_row + jnp.arange(rows, dtype=jnp.int32)
    row_index = jnp.broadcast_to(row_index[:, None], (rows, width))
    byte_index = jnp.broadcast_to((columns // 8)[None, :], (rows, width))
    packed = packed_ref[row_index, byte_index].astype(jnp.int32)
    return ((packed >> (columns % 8)[None, :]) & 1) == 1


def _forward_kernel(  # noqa: PLR0913 (Pallas hands the kernel its refs)
    y_ref: jax.Ref,
    bias_ref: jax.Ref,
    packed_ref: jax.Ref,
    residual_ref: jax.Ref,
    scale_ref: jax.Ref,
    offset_ref: jax.Ref,
    out_ref: jax.Ref,
    sum_ref: jax.Ref,
    stats_ref: jax.Ref,
    *,
    rate: float,
    epsilon: float,
) -> None:
    rows, width = y_ref.shape
    y = y_ref[...].astype(jnp.float32) + bias_ref[...].astype(jnp.float32)[None, :]
    dropped = jnp.where(_keep(packed_ref, 0, rows, width), y * (1.0 / (1.0 - rate)), 0.0)
    summed = (dropped + residual_ref[...].astype(jnp.float32)).astype(sum_ref.dtype)
    sum_ref[...] = summed
    x = summed.astype(jnp.float32)
    mean = jnp.mean(x, axis=1)
    centered = x - mean[:, None]
    inverse_std = lax.rsqrt(jnp.mean(centered * centered, axis=1) + epsilon)
    normalized = centered * inverse_std[:, None]
    out = normalized * scale_ref[...].astype(jnp.float32)[None, :]
    out_ref[...] = (out + offset_ref[...].astype(jnp.float32)[None, :]).astype(out_ref.dtype)
    stats_ref[0, :] = mean
    stats_ref[1, :] = inverse_std


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _forward(
    y: jax.Array,
    bias: jax.Array,
    packed: jax.Array,
    residual: jax.Array,
    scale: jax.Array,
    offset: jax.Array,
    rate: float,
    epsilon: float,
    interpret: bool,
) -> tuple[jax.Array, Residuals]:
    """The output, and what the backward pass reads: the sum `[M, H]` in y's dtype, float32
    `[2, M]` (each row's mean and reciprocal standard deviation), the mask and the scale."""
    rows, width = y.shape
    estimate = cost(rows, width, y.dtype.itemsize, backward=False)
    block = pl.BlockSpec((BLOCK_M, width), lambda i: (i, 0))
    whole = pl.BlockSpec((width,), lambda i: (0,))
    out, summed, stats = gpu_kernels.pallas_call(
        functools.partial(_forward_kernel, rate=rate, epsilon=epsilon),
        grid=(rows // BLOCK_M,),
        in_specs=[
            block,
            whole,
            pl.BlockSpec((BLOCK_M, width // 8), lambda i: (i, 0)),
            block,
            whole,
            whole,
        ],
        out_specs=[block, block, pl.BlockSpec((2, BLOCK_M), lambda i: (0, i))],
        out_shape=[
            jax.ShapeDtypeStruct((rows, width), y.dtype),
            jax.ShapeDtypeStruct((rows, width), y.dtype),
            jax.ShapeDtypeStruct((2, rows), jnp.float32),
        ],
        params=PARAMS,
        interpret=interpret,
        name="add_norm_forward",
        estimate=estimate,
    )(y, bias, packed, residual, scale, offset)
    return out, (summed, stats, packed, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def add_norm(
    y_MxH: jax.Array,
    bias_H: jax.Array,
    packed_MxH8: jax.Array,
    residual_MxH: jax.Array,
    scale_H: jax.Array,
    offset_H: jax.Array,
    rate: float,
    epsilon: float,
    interpret: bool = False,
) -> jax.Array:
    """`LayerNorm(dropout(y + bias) + residual)` (LayerNorm's `scale`, `offset`, `epsilon`),
    dropout `rate` by the packed keep mask `[M, H / 8]` (`dropout.packed_keep_mask`), in y's
    dtype (the residual's too); the bias and LayerNorm's parameters in one dtype (their
    gradients' too); `interpret`: Pallas' interpret mode."""
    args = (y_MxH, bias_H, packed_MxH8, residual_MxH, scale_H, offset_H)
    return _forward(*args, rate, epsilon, interpret)[0]


def _backward_kernel(
    d_out_ref: jax.Ref,
    sum_ref: jax.Ref,
    stats_ref: jax.Ref,
    packed_ref: jax.Ref,
    scale_ref: jax.Ref,
    d_y_ref: jax.Ref,
    d_sum_ref: jax.Ref,
    parts_ref: jax.Ref,
    *,
    rate: float,
) -> None:
    """LayerNorm's gradient for BLOCK_M rows at a time, dropout's by the same mask, and the
    column sums of the block's gradients of the scale, the offset and the bias (float32)."""
    width = d_out_ref.shape[1]
    scale = scale_ref[...].astype(jnp.float32)[None, :]

    def step(i: jax.Array, sums: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        first = pl.multiple_of(i * BLOCK_M, BLOCK_M)
        rows = pl.ds(first, BLOCK_M)
        d_out = d_out_ref[rows, :].astype(jnp.float32)
        inverse_std = stats_ref[1, rows][:, None]
        normalized = sum_ref[rows, :].astype(jnp.float32) - stats_ref[0, rows][:, None]
        normalized = normalized * inverse_std
        d_normalized = d_out * scale
        d_sum = inverse_std * (
            d_normalized
            - jnp.mean(d_normalized, axis=1)[:, None]
            - normalized * jnp.mean(d_normalized * normalized, axis=1)[:, None]
        )
        d_sum = d_sum.astype(d_sum_ref.dtype)
        d_sum_ref[rows, :] = d_sum
        keep = _keep(packed_ref, first, BLOCK_M, width)
        d_y = jnp.where(keep, d_sum.astype(jnp.float32) * (1.0 / (1.0 - rate)), 0.0)
        d_y = d_y.astype(d_y_ref.dtype)
        d_y_ref[rows, :] = d_y
        d_scale, d_offset, d_bias = sums
        return (
            d_scale + jnp.sum(d_out * normalized, axis=0),
            d_offset + jnp.sum(d_out, axis=0),
            d_bias + jnp.sum(d_y.astype(jnp.float32), axis=0),
        )

    zeros = jnp.zeros((width,), jnp.float32)
    sums = lax.fori_loop(0, BACKWARD_ROWS // BLOCK_M, step, (zeros, zeros, zeros))
    for which, column_sum in enumerate(sums):
        parts_ref[which, :] = column_sum


def _call_backward(
    d_out: jax.Array,
    summed: jax.Array,
    stats: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    rate: float,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of y and of the sum `[M, H]` in the sum's dtype, and float32
    `[M / BACKWARD_ROWS, 3, H]`: each block's column sums of the scale's, the offset's and
    the bias's gradients."""
    rows, width = summed.shape
    estimate = cost(rows, width, summed.dtype.itemsize, backward=True)
    block = pl.BlockSpec((BACKWARD_ROWS, width), lambda i: (i, 0))
    return gpu_kernels.pallas_call(
        functools.partial(_backward_kernel, rate=rate),
        grid=(rows // BACKWARD_ROWS,),
        in_specs=[
            block,
            block,
            pl.BlockSpec((2, BACKWARD_ROWS), lambda i: (0, i)),
            pl.BlockSpec((BACKWARD_ROWS, width // 8), lambda i: (i, 0)),
            pl.BlockSpec((width,), lambda i: (0,)),
        ],
        out_specs=[block, block, pl.BlockSpec((None, 3, width), lambda i: (i, 0, 0))],
        out_shape=[
            jax.ShapeDtypeStruct((rows, width), summed.dtype),
            jax.ShapeDtypeStruct((rows, width), summed.dtype),
            jax.ShapeDtypeStruct((rows // BACKWARD_ROWS, 3, width), jnp.float32),
        ],
        params=PARAMS,
        interpret=interpret,
        name="add_norm_backward",
        estimate=estimate,
    )(d_out, summed, stats, packed, scale)


def _backward(
    rate: float, epsilon: float, interpret: bool, residuals: Residuals, d_out: jax.Array
) -> tuple[jax.Array, jax.Array, None, jax.Array, jax.Array, jax.Array]:
    summed, stats, packed, scale = residuals
    d_y, d_sum, parts = _call_backward(
        d_out.astype(summed.dtype), summed, stats, packed, scale, rate, interpret
    )
    d_scale, d_offset, d_bias = jnp.sum(parts, axis=0).astype(scale.dtype)
    return d_y, d_bias, None, d_sum, d_scale, d_offset


add_norm.defvjp(_forward, _backward)


def runs(impl: str, dtype: str, length: int, width: int, rate: float) -> bool:
    """Whether BERT's dense outputs run this kernel for `impl` (`BertConfig.dense_impl`):
    with dropout only (training), on a GPU target in 16-bit compute for "auto"."""
    if impl == "xla" or rate == 0.0 or not fits(length, width):
        return False
    on_gpu = compile_target.target_platform() in ("gpu", "cuda")
    return impl == "triton" or (on_gpu and dtype != "float32")


def add_norm_layer(
    y_BxLxH: jax.Array,
    bias_H: jax.Array,
    packed_BxLxH8: jax.Array,
    residual_BxLxH: jax.Array,
    scale_H: jax.Array,
    offset_H: jax.Array,
    rate: float,
    epsilon: float,
) -> jax.Array:
    """`add_norm` on the layer's `[B, L, H]` (`gpu_kernels`: compiled on CUDA, else
    interpreted; per shard of the batch, whole rows each, under a mesh)."""
    width = y_BxLxH.shape[-1]

    def run(y: jax.Array, packed: jax.Array, residual: jax.Array, *params: jax.Array) -> jax.Array:
        def kernel(interpret: bool) -> Callable:
            return lambda y, packed, residual, bias, scale, offset: add_norm(
                y, bias, packed, residual, scale, offset, rate, epsilon, interpret
            )

        flat = (y.reshape(-1, width), packed.reshape(-1, width // 8), residual.reshape(-1, width))
        return gpu_kernels.compiled_or_interpreted(kernel, *flat, *params).reshape(y.shape)

    return gpu_kernels.per_batch_shard(
        run, (y_BxLxH, packed_BxLxH8, residual_BxLxH), (bias_H, scale_H, offset_H)
    )
