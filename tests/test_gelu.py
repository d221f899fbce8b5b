"""The exact GELU (`bertjax.models.layers.gelu`): the original's erf form, its derivative, and
the one array its backward pass keeps."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models.layers.config import ACTIVATIONS
from bertjax.models.layers.gelu import gelu

_ERF = np.vectorize(math.erf)


def _reference(x: np.ndarray) -> np.ndarray:
    """The original's `x * 0.5 * (1 + erf(x / sqrt(2)))` in float64."""
    return x * 0.5 * (1.0 + _ERF(x / math.sqrt(2.0)))


def _reference_slope(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + _ERF(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(
        2.0 * math.pi
    )


X = np.linspace(-8.0, 8.0, 4001)


def test_is_the_models_gelu():
    assert ACTIVATIONS["gelu"] is gelu


def test_values_and_derivative_against_float64():
    x = jnp.asarray(X, jnp.float32)
    np.testing.assert_allclose(gelu(x), _reference(X), atol=1e-6, rtol=1e-6)
    slope = jax.vmap(jax.grad(gelu))(x)
    np.testing.assert_allclose(slope, _reference_slope(X), atol=1e-6, rtol=1e-6)


def test_matches_jax_gelu_and_its_autodiff():
    x = jnp.asarray(X, jnp.float32)
    exact = jax.tree_util.Partial(jax.nn.gelu, approximate=False)
    np.testing.assert_allclose(gelu(x), exact(x), atol=1e-6)
    cotangent = jnp.asarray(np.random.default_rng(0).normal(size=X.shape), jnp.float32)
    ours = jax.vjp(gelu, x)[1](cotangent)[0]
    theirs = jax.vjp(exact, x)[1](cotangent)[0]
    np.testing.assert_allclose(ours, theirs, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16_bit_in_and_out(dtype):
    x = jnp.asarray(X[::8], dtype)
    y, backward = jax.vjp(gelu, x)
    (dx,) = backward(jnp.ones_like(y))
    assert y.dtype == dx.dtype == dtype
    wide = np.asarray(x.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(y.astype(jnp.float32), _reference(wide), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(dx.astype(jnp.float32), _reference_slope(wide), atol=1e-2, rtol=1e-2)


def test_backward_keeps_only_the_input():
    """The point of the custom VJP: one residual, the input itself (jax.nn.gelu's autodiff
    keeps three activation-sized arrays)."""
    x = jnp.asarray(X[:4000].reshape(40, 100), jnp.float32)
    residuals = jax.tree.leaves(jax.vjp(gelu, x)[1])
    assert len(residuals) == 1 and residuals[0] is x
    exact = jax.tree_util.Partial(jax.nn.gelu, approximate=False)
    assert sum(r.shape == x.shape for r in jax.tree.leaves(jax.vjp(exact, x)[1])) > 1
