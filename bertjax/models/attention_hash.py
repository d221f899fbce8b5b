"""The attention-dropout mask of bertjax's fused attention kernels, one function of (the
layer's seed for a batch row and head, the query, the key) that the Pallas TPU kernel
(`flash_dropout`), the Pallas GPU kernel (`flash_dropout_gpu`) and the einsum reference
(`hash_dropout`) all draw: the same mask wherever the step runs, replayed from the
checkpointed RNG on resume.

Keep `(query, key)` of batch row b and head n when the top 16 bits of
`mix((query * L + key) ^ seed[b, n])` are >= round(rate * 2**16); kept values are scaled by
1 / (1 - rate) (the einsum path's rule and rounding). `seed[b, n]` are 32 random bits per row
and head from the layer's dropout stream (`AttentionSeeds`), so the stream depends on (the
step's seed, the layer, the batch row, the head, the query, the key). Only int32 wrapping
multiplies, xors and logical shifts: Mosaic, Triton and XLA compute the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

KEEP_BITS = 16  # random bits per element, as bertjax.models.dropout
# lowbias32 (C. Wellons' hash prospector): multiply / xor-shift rounds, a bijection on 32 bits.
MIX_MULTIPLIERS = tuple(int(np.uint32(m).view(np.int32)) for m in (0x7FEB352D, 0x846CA68B))


class AttentionSeeds(nn.Module):
    """32 random bits (as int32) per batch row and head from the calling layer's "dropout"
    stream: the kernels' seeds, a different draw at every step and layer."""

    @nn.compact
    def __call__(self, batch: int, heads: int) -> jax.Array:
        bits = jax.random.bits(self.make_rng("dropout"), (batch, heads), jnp.uint32)
        return lax.bitcast_convert_type(bits, jnp.int32)


def shift(x: jax.Array, bits: int) -> jax.Array:
    """Logical right shift of int32 `x` by a static number of bits."""
    return lax.shift_right_logical(x, jnp.full(x.shape, bits, jnp.int32))


def premix(x: jax.Array) -> jax.Array:
    """lowbias32's first xor-shift, x ^ x >>> 16. It distributes over xor, premix(counter ^
    seed) == premix(counter) ^ premix(seed): a kernel premixes its counters once for all
    its heads and each head's seed once (a scalar)."""
    return x ^ shift(x, 16)


def _mix_rounds(premixed: jax.Array) -> jax.Array:
    """lowbias32 after its first xor-shift and before its last, which leaves the top 16
    bits as they are."""
    x = premixed * jnp.int32(MIX_MULTIPLIERS[0])
    x = x ^ shift(x, 15)
    return x * jnp.int32(MIX_MULTIPLIERS[1])


def mix(x: jax.Array) -> jax.Array:
    """lowbias32 on int32 (wrapping multiplies, logical shifts)."""
    x = _mix_rounds(premix(x))
    return x ^ shift(x, 16)


def threshold(rate: float) -> int:
    """The 16-bit draws below which an element is dropped: `rate` in [0, 1), rounded to a
    multiple of 2**-16 below 1."""
    drawn = round(rate * 2**KEEP_BITS)
    if rate < 0 or drawn >= 2**KEEP_BITS:
        raise ValueError(
            f"attention dropout rate {rate}: the fused kernels take a rate in [0, 1 - 2**-17)"
        )
    return drawn


def keep_premixed(
    premixed_counter_QxK: jax.Array, premixed_seed: jax.Array, rate: float
) -> jax.Array:
    """`keep` of counters and a seed already `premix`ed. The top 16 bits of x at least t
    is x at least t * 2**16 unsigned: no shift before the compare."""
    mixed = _mix_rounds(premixed_counter_QxK ^ premixed_seed)
    bound = jnp.uint32(threshold(rate) << (32 - KEEP_BITS))
    return lax.bitcast_convert_type(mixed, jnp.uint32) >= bound


def keep(counter_QxK: jax.Array, seed: jax.Array, rate: float) -> jax.Array:
    """Which of the (query, key) counters `query * L + key` are kept under `seed`: the top 16
    bits of `mix(counter ^ seed)` at least `threshold(rate)`, read before mix's last
    xor-shift (x ^ x >>> 16 has x's top 16 bits: two vector operations fewer per element)."""
    return keep_premixed(premix(counter_QxK), premix(seed), rate)


def counters(
    queries: int,
    keys: int,
    length: int | None = None,
    first_query: int | jax.Array = 0,
    first_key: int | jax.Array = 0,
) -> jax.Array:
    """int32 `[queries, keys]`: the counters `query * length + key` of a tile of rows of
    `length` keys (default `keys`) whose first query and key are `first_query`, `first_key`
    (static or traced)."""
    rows = lax.broadcasted_iota(jnp.int32, (queries, keys), 0)
    cols = lax.broadcasted_iota(jnp.int32, (queries, keys), 1)
    if not isinstance(first_query, int) or first_query:
        rows = rows + first_query
    if not isinstance(first_key, int) or first_key:
        cols = cols + first_key
    return rows * (length or keys) + cols


def keep_mask(seeds_BxN: jax.Array, length: int, rate: float) -> jax.Array:
    """bool `[B, N, L, L]`: the kernels' keep mask, drawn in plain jnp."""
    return keep(counters(length, length)[None, None], seeds_BxN[:, :, None, None], rate)


def hash_dropout(seeds_BxN: jax.Array, rate: float) -> Callable[[jax.Array], jax.Array]:
    """The einsum path's `dropout` (on probabilities `[B, N, L, L]`) with the kernels' mask."""

    def dropout(probs_BxNxLxL: jax.Array) -> jax.Array:
        kept = keep_mask(seeds_BxN, probs_BxNxLxL.shape[-1], rate)
        return jnp.where(kept, probs_BxNxLxL / jnp.asarray(1.0 - rate, probs_BxNxLxL.dtype), 0)

    return dropout
