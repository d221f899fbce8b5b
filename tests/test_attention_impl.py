"""`attention_impl`: jax.nn.dot_product_attention (padding as key lengths) gives the einsum
path's outputs and gradients (fp32) and refuses to train with attention dropout it cannot
apply; the cuDNN path lowers for CUDA to cuDNN's fused kernel with the padding mask and
attention dropout; `auto` picks per backend; the 16-bit dropout drops the configured rate."""
import dataclasses
import re

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax import model as M
from bertjax.dropout import Dropout

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


def test_auto_picks_cudnn_only_where_it_runs():
    bf16 = dataclasses.replace(CONFIG, dtype="bfloat16")
    assert bf16.resolved_attention_impl("gpu") == "cudnn"
    assert bf16.resolved_attention_impl("cpu") == "einsum"
    assert bf16.resolved_attention_impl("tpu") == "einsum"
    assert CONFIG.resolved_attention_impl("gpu") == "einsum"  # float32: no cuDNN flash kernel
    big_heads = dataclasses.replace(bf16, hidden_size=1024, num_attention_heads=4)  # D = 256
    assert big_heads.resolved_attention_impl("gpu") == "einsum"
    assert dataclasses.replace(CONFIG, attention_impl="xla").resolved_attention_impl("gpu") == "xla"
    assert M.BertConfig().resolved_attention_impl("cpu") == "einsum"


def test_cudnn_path_lowers_to_fused_kernel_with_padding_and_dropout(monkeypatch):
    """What crashed on a real GPU (a [B,1,1,L] bias the kernel refuses) is refused by JAX's
    own checks while tracing, so lowering for CUDA on the CPU catches it: here the training
    step must lower to cuDNN's forward and backward fused attention with dropout, taking the
    key lengths of the padding mask."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 90800)  # no cuDNN on the CPU
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    config = dataclasses.replace(CONFIG, dtype="bfloat16", attention_impl="cudnn")
    ids, segments, mask, positions = _inputs()
    module = M.BertForPreTraining(config)
    params = jax.eval_shape(module.init, jax.random.PRNGKey(0), ids, segments, mask, positions)

    def loss(params):
        mlm, nsp = module.apply(params, ids, segments, mask, positions, deterministic=False,
                                rngs={"dropout": jax.random.PRNGKey(1)})
        return mlm.astype(np.float32).sum() + nsp.sum()

    hlo = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$fmha\w+)\((.*?)\)", hlo)
    names = sorted({name for name, _ in calls})
    assert names == ["__cudnn$fmhaSoftmaxDropout", "__cudnn$fmhaSoftmaxDropoutBackward"]
    assert len(calls) == 2 * CONFIG.num_hidden_layers
    assert hlo.count("dropout_rate\\22: 0.1") == 2 * CONFIG.num_hidden_layers
    assert "fmha_scale\\22: 0.353553" in hlo  # 1/sqrt(head size 8)
    # q, k, v, then the query and key lengths: [B] int32 each (no [B,1,1,L] bias operand).
    forward_operands = [operands for name, operands in calls if not name.endswith("Backward")]
    assert all(operands.count(",") == 4 for operands in forward_operands)
    assert "tensor<3xi32>" in hlo


def test_cudnn_path_is_refused_by_jax_without_a_gpu():
    ids, segments, mask, positions = _inputs()
    config = dataclasses.replace(CONFIG, dtype="bfloat16", attention_impl="cudnn")
    with pytest.raises(Exception, match="cuDNN|GPU|gpu|cuda|CUDA"):
        jax.eval_shape(M.BertForPreTraining(config).init, jax.random.PRNGKey(0), ids, segments,
                       mask, positions)


def test_dropout_drops_the_configured_rate_and_keeps_the_mean():
    x = np.ones((64, 32, 64), np.float32)
    dropout = Dropout(0.1)
    y = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(0)})
    dropped = float(np.mean(np.asarray(y) == 0))
    assert abs(dropped - 0.1) < 0.004  # 131k draws: 5 standard deviations is 0.0041
    np.testing.assert_allclose(np.asarray(y)[np.asarray(y) != 0], 1 / 0.9, rtol=1e-6)
    # Neighbouring elements (the two halves of one 32-bit draw) are independent.
    keep = np.asarray(y) != 0
    both = float(np.mean(keep[..., 0::2] & keep[..., 1::2]))
    assert abs(both - 0.81) < 0.006
    again = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(0)})
    np.testing.assert_array_equal(np.asarray(again), np.asarray(y))
    other = dropout.apply({}, x, False, rngs={"dropout": jax.random.PRNGKey(1)})
    assert not np.array_equal(np.asarray(other), np.asarray(y))
    assert dropout.apply({}, x, True) is x
    odd = dropout.apply({}, np.ones((7, 5), np.float32), False,
                        rngs={"dropout": jax.random.PRNGKey(0)})
    assert odd.shape == (7, 5) and 0 < float(np.mean(np.asarray(odd) == 0)) < 0.5
