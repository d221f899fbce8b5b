"""The exact GELU as the original writes it, `x * 0.5 * (1 + erf(x / sqrt(2)))`, whose backward
pass keeps only its input.

`jax.nn.gelu(approximate=False)` is `0.5 * x * erfc(-x / sqrt(2))`, the same function. Its
autodiff keeps two arrays of the activation's size for the backward pass, `x` and the erfc
term, and XLA rebuilds the activation from both wherever it is read: BERT-large's forward
FFN fusion wrote those two `[B, L, 4096]` arrays, and the output dense's forward and
weight-gradient matmuls each read both, in place of the activation alone. Here the forward pass
writes the activation and keeps `x`; the backward pass computes the derivative
`Phi(x) + x * phi(x)` from `x` (benchmarks/aot/tpu_census.md). The erf form is also what the
original code and Hugging Face compute, and XLA's erf is a third of erfc's operations (one
rational polynomial, against two and an exp).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _cdf(x: jax.Array) -> jax.Array:
    """The standard normal CDF Phi(x), in x's dtype."""
    return 0.5 * (1.0 + lax.erf(x * jnp.asarray(_SQRT_HALF, x.dtype)))


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """`x * Phi(x)` in x's dtype, as `jax.nn.gelu`; its derivative in at least float32."""
    return x * _cdf(x)


def _forward(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu(x), x


def _backward(x: jax.Array, cotangent: jax.Array) -> tuple[jax.Array]:
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    slope = _cdf(wide) + wide * jnp.exp(-0.5 * wide * wide) * _INV_SQRT_2PI
    return ((cotangent.astype(wide.dtype) * slope).astype(cotangent.dtype),)


gelu.defvjp(_forward, _backward)
