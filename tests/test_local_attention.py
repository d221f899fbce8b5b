"""ModernBERT's sliding windows in blocks (bertjax.models.local_attention): equal to the band-masked
einsum reference, forward and backward, with its dropped probabilities; the model's window
against transformers' definition; no L x L array in a long row's local layer."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.models import attention, local_attention as LA
from bertjax.models.dropout import apply_packed_mask, packed_keep_mask
from bertjax.models.modernbert import model as MB
from bertjax.models.modernbert.config import ModernBertConfig

CONFIG = ModernBertConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    local_attention=8,
    max_position_embeddings=64,
    pad_token_id=0,
)


def _rows(length: int, packed: bool) -> np.ndarray:
    """Two rows: padded (the second ends in 15 padding tokens), or packed (instances 1 and 2,
    then padding; one instance then padding)."""
    ids = np.ones((2, length), np.int32)
    if packed:
        ids[0, 20:] = 2
        ids[0, length - 3 :] = 0
        ids[1, length - 5 :] = 0
    else:
        ids[1, length - 15 :] = 0
    return ids


@pytest.mark.parametrize(
    "length,half_window,packed,rate",
    [(40, 4, False, 0.0), (37, 5, False, 0.3), (64, 8, True, 0.3), (37, 5, True, 0.0)],
)
def test_blocks_equal_the_band_masked_einsum(length, half_window, packed, rate):
    """Outputs and gradients at every query that sees a key (all but padding far from a real
    token), with the reference's dropout mask drawn from the same key."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, length, 3, 8)), jnp.float32) for _ in range(3))
    ids = _rows(length, packed)
    mask = attention.Mask(jnp.asarray(ids), length if packed else 0, half_window)
    key = jax.random.PRNGKey(3)

    def reference(q, k, v):
        drop = (
            (lambda p: apply_packed_mask(p, packed_keep_mask(key, p.shape, rate), rate))
            if rate
            else (lambda p: p)
        )
        return attention.einsum_attention(q, k, v, attention.mask_bias(mask), drop)

    def blocked(q, k, v):
        return LA.blocked_attention(q, k, v, mask, rate, key)

    sees_a_key = np.ones_like(ids, bool) if packed else ids > 0
    weight = jnp.asarray(rng.standard_normal(q.shape) * sees_a_key[:, :, None, None], jnp.float32)

    def outputs_and_gradients(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(weight)

    (got, grads), (want, want_grads) = (
        jax.jit(outputs_and_gradients, static_argnums=0)(fn) for fn in (blocked, reference)
    )
    np.testing.assert_allclose(
        np.asarray(got)[sees_a_key], np.asarray(want)[sees_a_key], rtol=1e-5, atol=1e-6
    )
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def _attention_layer(config: ModernBertConfig, deterministic: bool, length: int):
    module = MB.ModernBertAttention(config, False, deterministic)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, length, config.hidden_size))
    ids = _rows(length, False)
    mask = attention.Mask(jnp.asarray(ids), 0, config.local_attention // 2)
    positions = jnp.broadcast_to(jnp.arange(length), (2, length))
    params = module.init(jax.random.PRNGKey(1), x, mask, positions)
    return module, params, (x, mask, positions), ids > 0


def test_the_model_drops_the_references_probabilities(monkeypatch):
    """A local layer with attention dropout draws the key the einsum path's dropout draws."""
    config = dataclasses.replace(CONFIG, attention_dropout=0.3)
    module, params, inputs, real = _attention_layer(config, False, 64)
    rngs = {"dropout": jax.random.PRNGKey(5)}
    assert LA.runs_blocked(
        config.attention_impl, config.dtype, jnp.zeros((2, 64, 2, 8)), inputs[1], 0.3
    )
    blocked = np.asarray(jax.jit(module.apply)(params, *inputs, rngs=rngs))
    monkeypatch.setattr(LA, "runs_blocked", lambda *args: False)
    reference = np.asarray(jax.jit(module.apply)(params, *inputs, rngs=rngs))
    assert np.abs(reference).max() > 1e-3
    np.testing.assert_allclose(blocked[real], reference[real], rtol=1e-5, atol=1e-8)


def test_a_long_rows_local_layer_holds_no_length_squared_array():
    length = 256
    module, params, inputs, _ = _attention_layer(CONFIG, True, length)
    jaxpr = str(
        jax.make_jaxpr(jax.grad(lambda p, *x: jnp.sum(module.apply(p, *x))))(params, *inputs)
    )
    assert f"[2,{length},2,8]" in jaxpr and f"{length},{length}]" not in jaxpr


def test_blocks_run_where_the_band_masked_einsum_would_over_twice_their_scores():
    mask = attention.Mask(jnp.ones((1, 64), jnp.int32), 0, 4)  # blocks of 8: 8 x 8 x 24 scores
    q = jnp.zeros((1, 64, 2, 8))
    assert LA.runs_blocked("auto", "float32", q, mask, 0.0)
    assert LA.runs_blocked("cudnn", "bfloat16", q, mask, 0.0)  # cuDNN: no two-sided window
    assert not LA.runs_blocked("xla", "float32", q, mask, 0.0)
    assert not LA.runs_blocked("pallas", "float32", q, mask, 0.0)  # splash takes the window
    assert LA.runs_blocked("pallas", "float32", q, mask, 0.1)  # but not attention dropout
    assert not LA.runs_blocked(
        "auto", "float32", q[:, :40], attention.Mask(jnp.ones((1, 40), jnp.int32), 0, 4), 0.0
    )  # 2 x 5 x 8 x 24 scores > 40 x 40
    assert not LA.runs_blocked("auto", "float32", q, attention.Mask(mask.ids_BxL), 0.0)
    assert (
        dataclasses.replace(CONFIG, dtype="bfloat16").resolved_attention_impl("gpu")
        == "cudnn (global layers), blocked einsum (sliding windows)"
    )


@pytest.mark.parametrize("local_attention,length", [(8, 64), (9, 64), (6, 64), (8, 40)])
def test_the_models_window_is_transformers(local_attention, length):
    """Which tokens a query of a ModernBertModel's local layer sees, told by changing one
    input token at a time, against transformers' definition (not bertjax's mask code):
    `ModernBertConfig.sliding_window = local_attention // 2` and the mask
    `abs(q_idx - kv_idx) <= sliding_window` (masking_utils'
    sliding_window_bidirectional_overlay). Layer 0 (global) has its attention output zeroed,
    so that only layer 1 (local) mixes positions; (8, 40) runs the band mask, the rest blocks."""
    config = dataclasses.replace(CONFIG, local_attention=local_attention)
    model = MB.ModernBertModel(config)
    ids = np.random.default_rng(0).integers(1, 40, (1, length))
    rng = np.random.default_rng(1)
    params = jax.tree.map(
        lambda a: (0.3 * rng.standard_normal(a.shape)).astype(np.float32),
        nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, np.ones_like(ids))),
    )
    params["params"]["layer_0"]["attn"]["Wo"]["kernel"] *= 0
    changed_ids = np.repeat(ids, length, axis=0)
    changed_ids[np.arange(length), np.arange(length)] = 1 + ids[0] % 39  # row j: token j
    apply = jax.jit(model.apply)
    mask = np.ones_like(changed_ids)
    before = np.asarray(apply(params, np.repeat(ids, length, axis=0), mask))
    after = np.asarray(apply(params, changed_ids, mask))
    sees_BxL = np.abs(after - before).max(-1).T > 1e-3  # [query i, changed key j]
    sliding_window = local_attention // 2
    q_idx, kv_idx = np.arange(length)[:, None], np.arange(length)[None]
    np.testing.assert_array_equal(sees_BxL, np.abs(q_idx - kv_idx) <= sliding_window)


@pytest.mark.parity
@pytest.mark.parametrize("name", ["odd-layers-window-smaller", "odd-window-own-thetas"])
def test_rows_in_blocks_give_transformers_logits(name, tmp_path):
    """test_modernbert_parity's random transformers models on rows of 64 tokens, long enough
    for blocks (its own rows of 16 run the band mask): MLM logits within 1e-5."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bertjax.families import modernbert_hf
    from test_modernbert_parity import (
        assert_close_at_real_tokens,
        bertjax_logits,
        hf_logits,
        random_hf_model,
    )

    model = random_hf_model(name)
    model.save_pretrained(tmp_path)
    config, params = modernbert_hf.load_hf(str(tmp_path))
    length = 64
    mask = np.ones((3, length), np.int64)
    mask[1, 40:] = 0
    mask[2, 9:] = 0
    ids = np.where(
        mask > 0, np.random.default_rng(0).integers(3, config.vocab_size, (3, length)), 0
    )
    assert LA.runs_blocked(
        config.attention_impl,
        config.dtype,
        jnp.zeros((1, length, 1, config.head_size)),
        attention.Mask(jnp.asarray(mask), 0, config.local_attention // 2),
        0.0,
    )
    assert_close_at_real_tokens(
        bertjax_logits(config, params, ids, mask), hf_logits(model, ids, mask), mask
    )
