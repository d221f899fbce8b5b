"""BERT's feed-forward block with the activation in its GEMMs' epilogues: Pallas GPU (Triton).

`act(x @ W1 + b1) @ W2` (the output bias, dropout and LayerNorm stay XLA's). XLA puts no exact
(erf) GELU in a GEMM's epilogue, so it writes the first GEMM's output, reads it back to add the
bias and apply GELU (a pass of 268 MB per layer for BERT-large at 16,384 tokens), and in the
backward pass writes the gradient of the activation to read it back with the pre-activation
(403 MB). Here:

- forward: one GEMM `x @ W1` adds the bias and applies the activation as it writes, and writes
  the pre-activation beside the activation (the backward pass reads it); XLA then computes
  `h @ W2`;
- backward: one GEMM `dy @ W2^T` multiplies by the activation's derivative at the
  pre-activation as it writes `d_pre`, and sums its columns per block of rows (the bias's
  gradient, float32); XLA computes `dW2 = h^T dy`, `dW1 = x^T d_pre` and `dx = d_pre W1^T`.

Each tile accumulates in float32 and is rounded once, as it is written. Exact GELU's erf is a
rational approximation (`erf`; Triton has no erf), within 4.5e-7 of the true erf (XLA's own
float32 erf: 3.1e-7).

Shape legend: M rows (batch x length), H the block's width, F the FFN's width; a block of M
rows is BLOCK_M, of F columns BLOCK_N, of the reduced axis BLOCK_K.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bertjax.models import compile_target, gpu_kernels
from bertjax.models.axes import ACT_MLP, mesh_axes

# Tiles of a Hopper GEMM in Triton: 128 x 128 outputs, 64 of the reduced axis per step, three
# steps in flight (3 x 32 KiB of shared memory), 8 warps (64 float32 accumulators a thread).
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
PARAMS = dict(num_warps=8, num_stages=3)

# The rational approximation of erf on [-4, 4] (odd numerator, even denominator, in x**2;
# beyond 4 erf is +-1 in float32): Eigen's float erf.
_ERF_CLAMP = 4.0
_ERF_NUMERATOR = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_DENOMINATOR = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
_TANH_CUBIC = 0.044715  # gelu_tanh's x + 0.044715 x**3
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _polynomial(coefficients: tuple[float, ...], x: jax.Array) -> jax.Array:
    """Horner's rule, highest power first."""
    value = jnp.full_like(x, coefficients[0])
    for c in coefficients[1:]:
        value = value * x + c
    return value


def erf(x: jax.Array) -> jax.Array:
    """erf of float32 `x` by the rational approximation above (ops Triton has)."""
    x = jnp.clip(x, -_ERF_CLAMP, _ERF_CLAMP)
    squared = x * x
    return x * _polynomial(_ERF_NUMERATOR, squared) / _polynomial(_ERF_DENOMINATOR, squared)


def _gelu(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exact GELU x * Phi(x) and its derivative Phi(x) + x * phi(x)."""
    cdf = 0.5 * (1.0 + erf(x * (1.0 / math.sqrt(2.0))))
    return x * cdf, cdf + x * jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def _gelu_tanh(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GELU by tanh, 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x**3), and its
    derivative."""
    t = jnp.tanh(_SQRT_2_OVER_PI * (x + _TANH_CUBIC * x * x * x))
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _TANH_CUBIC * x * x)
    return 0.5 * x * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du


def _relu(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """max(x, 0) and its derivative (0 at 0, as jax.nn.relu's)."""
    return jnp.maximum(x, 0.0), jnp.where(x > 0, 1.0, 0.0)


# `BertConfig.hidden_act` -> the activation and its derivative, in float32.
ACTIVATIONS: dict[str, Callable[[jax.Array], tuple[jax.Array, jax.Array]]] = {
    "gelu": _gelu,
    "gelu_tanh": _gelu_tanh,
    "relu": _relu,
}


def fits(rows: int, width: int, features: int, activation: str) -> bool:
    """Whether the kernels take `rows` of `width` through `features` with `activation`: whole
    tiles only."""
    return (
        activation in ACTIVATIONS
        and rows % BLOCK_M == 0
        and features % BLOCK_N == 0
        and width % BLOCK_K == 0
    )


def cost(rows: int, width: int, features: int, itemsize: int, backward: bool) -> pl.CostEstimate:
    """The GEMM's FLOPs and HBM bytes (what `tools.gpu_census` charges a Triton call). Forward:
    x, W1 and the bias read, the pre-activation and the activation written; backward: dy, W2
    and the pre-activation read, d_pre and its float32 sums per block of rows written."""
    operands = (rows + features) * width * itemsize
    activations = rows * features * itemsize
    if backward:
        moved = operands + 2 * activations + rows // BLOCK_M * features * 4
    else:
        moved = operands + features * itemsize + 2 * activations
    return pl.CostEstimate(
        flops=2 * rows * width * features,
        transcendentals=rows * features,
        bytes_accessed=moved,
    )


def _product(a_ref: jax.Ref, b_ref: jax.Ref, transpose_b: bool) -> jax.Array:
    """The float32 `[BLOCK_M, BLOCK_N]` tile `a @ b` (`a @ b^T`), BLOCK_K columns of `a` a step."""
    width = a_ref.shape[1]
    columns = b_ref.shape[0] if transpose_b else b_ref.shape[1]
    precision = lax.Precision.HIGHEST if a_ref.dtype == jnp.float32 else None

    def step(i: jax.Array, tile: jax.Array) -> jax.Array:
        reduced = pl.ds(pl.multiple_of(i * BLOCK_K, BLOCK_K), BLOCK_K)
        b = b_ref[:, reduced] if transpose_b else b_ref[reduced, :]
        return tile + plgpu.dot(a_ref[:, reduced], b, trans_b=transpose_b, precision=precision)

    zeros = jnp.zeros((a_ref.shape[0], columns), jnp.float32)
    return lax.fori_loop(0, width // BLOCK_K, step, zeros)


def _forward_kernel(
    x_ref: jax.Ref,
    kernel_ref: jax.Ref,
    bias_ref: jax.Ref,
    pre_ref: jax.Ref,
    out_ref: jax.Ref,
    *,
    activation: str,
) -> None:
    pre = _product(x_ref, kernel_ref, False) + bias_ref[...].astype(jnp.float32)[None, :]
    pre_ref[...] = pre.astype(pre_ref.dtype)
    out_ref[...] = ACTIVATIONS[activation](pre)[0].astype(out_ref.dtype)


def _backward_kernel(
    d_out_ref: jax.Ref,
    out_kernel_ref: jax.Ref,
    pre_ref: jax.Ref,
    d_pre_ref: jax.Ref,
    d_bias_ref: jax.Ref,
    *,
    activation: str,
) -> None:
    d_activated = _product(d_out_ref, out_kernel_ref, True)
    derivative = ACTIVATIONS[activation](pre_ref[...].astype(jnp.float32))[1]
    d_pre = d_activated * derivative
    d_pre_ref[...] = d_pre.astype(d_pre_ref.dtype)
    d_bias_ref[...] = jnp.sum(d_pre, axis=0)


# One `[BLOCK_M, BLOCK_N]` tile of an `[M, F]` output per program.
_TILE = pl.BlockSpec((BLOCK_M, BLOCK_N), lambda i, j: (i, j))


def _call_tiled(
    body: Callable,
    name: str,
    operands: tuple[jax.Array, ...],
    operand_specs: list[pl.BlockSpec],
    outputs: list[tuple[pl.BlockSpec, jax.ShapeDtypeStruct]],
    backward: bool,
    interpret: bool,
) -> list[jax.Array]:
    """`body` with one program per `_TILE` of `outputs[0]`'s `[M, F]`: the first operand
    `[M, H]` read a block of rows (all of H) a program, the rest by `operand_specs`."""
    rows, width = operands[0].shape
    features = outputs[0][1].shape[1]
    specs, shapes = zip(*outputs, strict=True)
    return gpu_kernels.pallas_call(
        body,
        grid=(rows // BLOCK_M, features // BLOCK_N),
        in_specs=[pl.BlockSpec((BLOCK_M, width), lambda i, j: (i, 0)), *operand_specs],
        out_specs=list(specs),
        out_shape=list(shapes),
        params=PARAMS,
        interpret=interpret,
        name=name,
        estimate=cost(rows, width, features, operands[0].dtype.itemsize, backward),
    )(*operands)


def _call_forward(
    x_MxH: jax.Array, kernel_HxF: jax.Array, bias_F: jax.Array, activation: str, interpret: bool
) -> list[jax.Array]:
    """The pre-activation and the activation, `[M, F]` each in x's dtype."""
    activations = jax.ShapeDtypeStruct((x_MxH.shape[0], kernel_HxF.shape[1]), x_MxH.dtype)
    return _call_tiled(
        functools.partial(_forward_kernel, activation=activation),
        "feed_forward_forward",
        (x_MxH, kernel_HxF, bias_F),
        [
            pl.BlockSpec((kernel_HxF.shape[0], BLOCK_N), lambda i, j: (0, j)),
            pl.BlockSpec((BLOCK_N,), lambda i, j: (j,)),
        ],
        [(_TILE, activations), (_TILE, activations)],
        backward=False,
        interpret=interpret,
    )


def _call_backward(
    d_out_MxH: jax.Array,
    out_kernel_FxH: jax.Array,
    pre_MxF: jax.Array,
    activation: str,
    interpret: bool,
) -> list[jax.Array]:
    """The pre-activation's gradient `[M, F]` and its float32 sums per block of rows
    `[M / BLOCK_M, F]`."""
    rows, features = pre_MxF.shape
    return _call_tiled(
        functools.partial(_backward_kernel, activation=activation),
        "feed_forward_backward",
        (d_out_MxH, out_kernel_FxH, pre_MxF),
        [pl.BlockSpec((BLOCK_N, out_kernel_FxH.shape[1]), lambda i, j: (j, 0)), _TILE],
        [
            (_TILE, jax.ShapeDtypeStruct((rows, features), d_out_MxH.dtype)),
            (
                pl.BlockSpec((None, BLOCK_N), lambda i, j: (i, j)),
                jax.ShapeDtypeStruct((rows // BLOCK_M, features), jnp.float32),
            ),
        ],
        backward=True,
        interpret=interpret,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def feed_forward(
    x_MxH: jax.Array,
    kernel_HxF: jax.Array,
    bias_F: jax.Array,
    out_kernel_FxH: jax.Array,
    activation: str,
    interpret: bool = False,
) -> jax.Array:
    """`activation(x @ kernel + bias) @ out_kernel`, `[M, H]`, every operand in x's dtype; M,
    H and F as `fits`; `interpret`: Pallas' interpret mode (on CPU, for tests)."""
    return _forward(x_MxH, kernel_HxF, bias_F, out_kernel_FxH, activation, interpret)[0]


Residuals = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def _forward(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array,
    out_kernel: jax.Array,
    activation: str,
    interpret: bool,
) -> tuple[jax.Array, Residuals]:
    pre, activated = _call_forward(x, kernel, bias, activation, interpret)
    return activated @ out_kernel, (x, kernel, out_kernel, pre, activated)


def _backward(
    activation: str, interpret: bool, residuals: Residuals, d_out: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    x, kernel, out_kernel, pre, activated = residuals
    d_out = d_out.astype(x.dtype)
    d_pre, d_bias_parts = _call_backward(d_out, out_kernel, pre, activation, interpret)
    return (
        d_pre @ kernel.T,
        x.T @ d_pre,
        jnp.sum(d_bias_parts, axis=0).astype(x.dtype),
        activated.T @ d_out,
    )


feed_forward.defvjp(_forward, _backward)


def runs(impl: str, dtype: str, length: int, width: int, features: int, activation: str) -> bool:
    """Whether the BERT layer's FFN runs these kernels for `impl` (`BertConfig.dense_impl`) on
    rows of `length` tokens; "triton" where they cannot: a ValueError that names the fix."""
    if impl == "xla":
        return False
    fit = fits(length, width, features, activation) and not _width_split()
    if impl == "triton" and not fit:
        raise ValueError(
            f"dense_impl='triton' needs a sequence length that is a multiple of {BLOCK_M}, an FFN "
            f"size that is a multiple of {BLOCK_N}, a hidden size that is a multiple of "
            f"{BLOCK_K}, an activation in {sorted(ACTIVATIONS)} and no mesh axis splitting the "
            f"FFN's width, got length {length}, hidden size {width}, FFN size {features}, "
            f"activation {activation!r}; use dense_impl='xla'"
        )
    on_gpu = compile_target.target_platform() in ("gpu", "cuda")
    return fit and (impl == "triton" or (on_gpu and dtype != "float32"))


def _width_split() -> bool:
    """Whether the active mesh splits the FFN's width (tensor parallelism)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = mesh_axes(ACT_MLP)
    names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return not mesh.empty and any(mesh.shape[name] > 1 for name in names if name in mesh.shape)


def feed_forward_layer(
    x_BxLxH: jax.Array,
    kernel_HxF: jax.Array,
    bias_F: jax.Array,
    out_kernel_FxH: jax.Array,
    activation: str,
) -> jax.Array:
    """`feed_forward` on the layer's `[B, L, H]`, every operand in x's dtype (`gpu_kernels`:
    compiled on CUDA, else interpreted; per shard of the batch under a mesh)."""

    def run(x: jax.Array, *kernels: jax.Array) -> jax.Array:
        def kernel(interpret: bool) -> Callable:
            return lambda *args: feed_forward(*args, activation, interpret)

        x_MxH = x.reshape(-1, x.shape[-1])
        return gpu_kernels.compiled_or_interpreted(kernel, x_MxH, *kernels).reshape(x.shape)

    return gpu_kernels.per_batch_shard(run, (x_BxLxH,), (kernel_HxF, bias_F, out_kernel_FxH))
