"""Dropout for the BERT layers: the original's inverted dropout, its keep mask drawn from 16
random bits per element and kept packed, 8 elements a byte."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p


class Dropout(nn.Module):
    """Inverted dropout (kept values scaled by 1 / (1 - rate), as the original). The drop
    rate is rounded to a multiple of 2**-16 (0.1 -> 0.100006). The mask is one kernel's
    output of 1 bit per element, which the forward and backward passes read (measured in
    benchmarks/aot/levers.md), instead of 32-bit draws then a byte per element."""

    rate: float

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if deterministic or self.rate == 0.0:
            return x
        return apply_packed_mask(x, self.packed_mask(x.shape), self.rate)

    def packed_mask(self, shape: tuple[int, ...]) -> jax.Array:
        """The packed keep mask `__call__` draws for an input of `shape` (the same draw, for a
        kernel that applies it itself: `add_norm_gpu`)."""
        return packed_keep_mask(self.make_rng("dropout"), shape, self.rate)


def _hash_words(
    key: jax.Array, shape: tuple[int, ...], index: jax.Array | None = None
) -> list[jax.Array]:
    """Four uint32 arrays of `shape` (or `index`'s) of random bits: for a threefry key, both
    outputs of two hashes per element (counters: the flat index, or `index`, and 0 or 1),
    half the hashing of `jax.random.bits` (which keeps 32 of each hash's 64 bits); other keys
    through it (not addressed by `index`)."""
    data = jax.random.key_data(key)
    if index is None:
        index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    if data.shape != (2,):
        words = jax.random.bits(key, (*index.shape, 4), jnp.uint32)
        return [words[..., j] for j in range(4)]
    lanes: list[jax.Array] = []
    for lane in range(2):
        lanes += threefry2x32_p.bind(
            data[0], data[1], index, jnp.full(index.shape, lane, jnp.uint32)
        )
    return lanes


def packed_keep_mask(
    key: jax.Array, shape: tuple[int, ...], rate: float, byte_index: jax.Array | None = None
) -> jax.Array:
    """uint8 `[..., ceil(shape[-1] / 8)]`: bit i of byte j keeps element 8j + i of the last
    axis, kept when its 16 random bits are >= round(rate * 2**16). `byte_index` (uint32):
    instead, the bytes at these flat indices of that mask, in its shape."""
    packed_shape = (*shape[:-1], -(-shape[-1] // 8))
    threshold = jnp.uint32(round(rate * 2**16))
    words = _hash_words(key, packed_shape, byte_index)
    byte = jnp.zeros(words[0].shape, jnp.uint32)
    for j, word in enumerate(words):
        for half, bits in enumerate((word & 0xFFFF, word >> 16)):
            byte |= (bits >= threshold).astype(jnp.uint32) << (2 * j + half)
    return byte.astype(jnp.uint8)


def _unpacked(packed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape((*packed.shape[:-1], -1))[..., : shape[-1]].astype(jnp.bool_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def apply_packed_mask(x: jax.Array, packed: jax.Array, rate: float) -> jax.Array:
    """`x / (1 - rate)` where the packed mask keeps, 0 elsewhere; its backward pass reads the
    packed mask again (autodiff would keep the unpacked one)."""
    return jnp.where(
        _unpacked(packed, x.shape), x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x)
    )


def _apply_forward(x: jax.Array, packed: jax.Array, rate: float) -> tuple[jax.Array, jax.Array]:
    return apply_packed_mask(x, packed, rate), packed


def _apply_backward(rate: float, packed: jax.Array, cotangent: jax.Array) -> tuple[jax.Array, None]:
    return apply_packed_mask(cotangent, packed, rate), None


apply_packed_mask.defvjp(_apply_forward, _apply_backward)
