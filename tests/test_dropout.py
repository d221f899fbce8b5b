"""Dropout: the configured rate with the original's scaling, independent elements, a packed
mask that is exactly its 16-bit rule, gradients through the same mask, and a mask that does
not depend on how the array is sharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models import dropout as D
from bertjax.training import sharding


def test_dropout_drops_the_configured_rate_and_keeps_the_mean():
    x = np.ones((64, 32, 64), np.float32)
    dropout = D.Dropout(0.1)
    y = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(0)})
    dropped = float(np.mean(np.asarray(y) == 0))
    assert abs(dropped - 0.1) < 0.004  # 131k draws: 5 standard deviations is 0.0041
    np.testing.assert_allclose(np.asarray(y)[np.asarray(y) != 0], 1 / 0.9, rtol=1e-6)
    # Pairs from one 32-bit word, from two words of one hash, from two hashes of one byte and
    # from neighbouring bytes are independent: P(both kept) = 0.81 (5 sigma: 0.006).
    keep = np.asarray(y) != 0
    for stride, offset in ((1, 0), (2, 0), (4, 0), (1, 7)):
        first = keep[..., offset::8]
        second = keep[..., offset + stride :: 8]
        pairs = min(first.shape[-1], second.shape[-1])
        both = float(np.mean(first[..., :pairs] & second[..., :pairs]))
        assert abs(both - 0.81) < 0.012, (stride, offset, both)  # 16k pairs: 5 sigma 0.011
    again = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(0)})
    np.testing.assert_array_equal(np.asarray(again), np.asarray(y))
    other = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(1)})
    assert not np.array_equal(np.asarray(other), np.asarray(y))
    assert dropout.apply({}, x, True) is x


@pytest.mark.parametrize("shape", [(6, 40), (7, 5), (3, 2, 17)])
def test_the_packed_mask_is_the_16_bit_rule_bit_by_bit(shape):
    """Element 8j + i of the last axis is bit i of byte j; bits 2k and 2k + 1 of a byte are
    the low and high halves of hash word k, kept when >= round(rate * 2**16)."""
    key = jax.random.PRNGKey(7)
    packed = np.asarray(D.packed_keep_mask(key, shape, 0.3))
    assert packed.dtype == np.uint8 and packed.shape == (*shape[:-1], -(-shape[-1] // 8))
    words = np.stack([np.asarray(w) for w in D._hash_words(key, packed.shape)], -1)
    halves = np.stack([words & 0xFFFF, words >> 16], -1).reshape((*packed.shape, 8))
    expected = (halves >= round(0.3 * 2**16)).reshape((*shape[:-1], -1))[..., : shape[-1]]
    x = np.arange(1, np.prod(shape) + 1, dtype=np.float32).reshape(shape)
    y = np.asarray(D.apply_packed_mask(jnp.asarray(x), jnp.asarray(packed), 0.3))
    np.testing.assert_array_equal(y != 0, expected)
    np.testing.assert_allclose(y, np.where(expected, x / 0.7, 0), rtol=1e-6)
    assert 0 < expected.mean() < 1


def test_the_hash_words_are_distinct_threefry_outputs_and_other_keys_work():
    key = jax.random.PRNGKey(3)
    words = [np.asarray(w) for w in D._hash_words(key, (4, 5))]
    flat = np.concatenate([w.ravel() for w in words])
    assert len(np.unique(flat)) == flat.size  # 80 distinct 32-bit words
    first_hash = jax.extend.random.threefry2x32_p.bind(
        key[0], key[1], jnp.arange(20, dtype=jnp.uint32), jnp.zeros(20, jnp.uint32)
    )
    np.testing.assert_array_equal(words[0].ravel(), np.asarray(first_hash[0]))
    rbg = D.packed_keep_mask(jax.random.key(0, impl="rbg"), (4, 16), 0.5)
    assert rbg.shape == (4, 2) and len(np.unique(np.asarray(rbg))) > 1


def test_the_gradient_goes_through_the_same_mask():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 24)), jnp.float32)
    packed = D.packed_keep_mask(jax.random.PRNGKey(2), x.shape, 0.25)
    cotangent = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    out, vjp = jax.vjp(lambda x: D.apply_packed_mask(x, packed, 0.25), x)
    keep = np.asarray(out) != 0
    np.testing.assert_allclose(
        np.asarray(vjp(cotangent)[0]), np.where(keep, np.asarray(cotangent) / 0.75, 0), rtol=1e-6
    )
    reference = jax.vjp(lambda x: jnp.where(keep, x / 0.75, 0.0), x)[1](cotangent)[0]
    np.testing.assert_array_equal(np.asarray(vjp(cotangent)[0]), np.asarray(reference))


def test_the_mask_does_not_depend_on_the_sharding():
    """The counters are the global flat index: a batch-sharded array on 8 devices draws the
    mask of the unsharded one (a resumed run on another mesh drops the same elements)."""
    mesh = sharding.make_mesh({"data": -1})
    x = np.ones((16, 8, 32), np.float32)
    apply = jax.jit(lambda x, key: D.Dropout(0.1).apply({}, x, False, rngs={"dropout": key}))
    whole = apply(x, jax.random.PRNGKey(5))
    spread = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    assert len(spread.sharding.device_set) == 8
    np.testing.assert_array_equal(
        np.asarray(apply(spread, jax.random.PRNGKey(5))), np.asarray(whole)
    )
