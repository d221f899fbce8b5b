"""`attention_impl`: jax.nn.dot_product_attention gives the einsum path's outputs and
gradients (fp32), and refuses to train with attention dropout it cannot apply."""
import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax import model as M

CONFIG = M.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=24)


def _inputs():
    rng = np.random.default_rng(0)
    ids = rng.integers(5, CONFIG.vocab_size, (3, 12)).astype(np.int32)
    mask = np.ones((3, 12), np.int32)
    mask[1, 7:] = 0
    mask[2, 4:] = 0
    positions = np.array([[1, 2, 5], [1, 3, 6], [1, 2, 3]], np.int32)
    return ids, (np.arange(12) >= 6).astype(np.int32)[None].repeat(3, 0) * mask, mask, positions


def test_dot_product_attention_matches_einsum():
    inputs = _inputs()
    params = nn.meta.unbox(jax.jit(M.BertForPreTraining(CONFIG).init)(
        jax.random.PRNGKey(0), *inputs)["params"])
    fused = dataclasses.replace(CONFIG, attention_impl="xla")

    def loss(params, config):
        mlm, nsp = M.BertForPreTraining(config).apply({"params": params}, *inputs)
        return (mlm ** 2).mean() + (nsp ** 2).mean(), (mlm, nsp)

    grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, outputs), grads = grad_fn(params, CONFIG)
    (_, fused_outputs), fused_grads = grad_fn(params, fused)
    for got, want in zip(jax.tree.leaves((fused_outputs, fused_grads)),
                         jax.tree.leaves((outputs, grads))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_fused_attention_refuses_attention_dropout():
    inputs = _inputs()
    rngs = {"dropout": jax.random.PRNGKey(1)}

    def train_forward(config):  # traced only (eval_shape): nothing is compiled or run
        module = M.BertForPreTraining(config)
        params = jax.eval_shape(module.init, jax.random.PRNGKey(0), *inputs)
        return jax.eval_shape(lambda p: module.apply(p, *inputs, deterministic=False, rngs=rngs),
                              params)

    with pytest.raises(ValueError, match="attention_probs_dropout_prob=0"):
        train_forward(dataclasses.replace(CONFIG, attention_impl="xla"))
    mlm, _ = train_forward(dataclasses.replace(CONFIG, attention_impl="xla",
                                               attention_probs_dropout_prob=0.0))
    assert mlm.shape == (3, 3, CONFIG.vocab_size)
    with pytest.raises(ValueError, match="attention_impl"):
        M.BertConfig(attention_impl="flash")
