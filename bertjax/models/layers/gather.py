"""The hidden states at given positions (the masked-LM heads' input)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gather_positions(x_BxLxH: jax.Array, positions_BxP: jax.Array) -> jax.Array:
    """Picks the hidden states at the masked positions: `[B, L, H] -> [B, P, H]`.

    In 16-bit compute, a one-hot matmul (exact: one product by 1, the rest by 0): a gather's
    gradient is a scatter, and for the gather and scatter the H100 compiler laid the whole
    residual stream out batch-minor, with a transpose at every matmul (benchmarks/aot/
    levers.md). float32 keeps the gather (a float32 matmul may round through TF32)."""
    positions_BxP = positions_BxP.astype(jnp.int32)
    if x_BxLxH.dtype == jnp.float32:
        return jnp.take_along_axis(x_BxLxH, positions_BxP[:, :, None], axis=1)
    one_hot_BxPxL = positions_BxP[:, :, None] == jnp.arange(x_BxLxH.shape[1])
    return jnp.einsum("bpl,blh->bph", one_hot_BxPxL.astype(x_BxLxH.dtype), x_BxLxH)
