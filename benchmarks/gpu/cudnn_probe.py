"""One probe of cuDNN's fused attention on a GPU, in its own process (issue 44, item 5).

    PYTHONPATH=. python benchmarks/gpu/cudnn_probe.py CASE

A C++ abort in XLA's cuDNN code (`cuda_dnn.cc ... Check failed`, seen on an H100 on
2026-11-27) ends the process with no Python error, so each case runs alone and the caller
reads its exit status. The cases go from the smallest use of cuDNN to the product's step:

- `raw`: `jax.nn.dot_product_attention(implementation="cudnn")`, padding, no dropout,
  forward and gradients against `implementation="xla"`;
- `model_nodrop`: BERT-large's layer sizes, 2 layers, attention_impl="cudnn" without dropout,
  loss and gradients against the einsum path;
- `model_dropout_fwd`: the same forward with attention dropout 0.1 (cuDNN's own dropout);
- `model_dropout_grad`: its loss and gradients;
- `step_nodrop` / `step_dropout`: the product's jitted train step on a mesh (NamedSharding,
  the recipe's optimizer), 2 layers, three steps, without and with attention dropout.

It prints one line `PROBE CASE ok {...}` with what it measured. `CASE einsum` runs the same
code with the einsum path in cuDNN's place (a check of this script on the CPU).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from step_levers import LARGE, synthetic_batch, time_variant  # (benchmarks/)

from bertjax.models.bert import model as M

TWO_LAYERS = dataclasses.replace(LARGE, num_hidden_layers=2)
IMPL = sys.argv[2] if len(sys.argv) > 2 else "cudnn"  # "einsum": the CPU check


def relative_errors(got, ref) -> list[float]:
    """|got - ref| / |ref| for each leaf, in float64."""
    return [
        float(
            np.linalg.norm(np.asarray(a, np.float64) - np.asarray(r, np.float64))
            / max(np.linalg.norm(np.asarray(r, np.float64)), 1e-30)
        )
        for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref))
    ]


def raw() -> dict:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(4, 128, 16, 64)), jnp.bfloat16) for _ in range(3))
    lengths = jnp.asarray([128, 100, 77, 64], jnp.int32)

    def loss(q, k, v, impl):
        out = jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=lengths, implementation=impl
        )
        return jnp.sum(out.astype(jnp.float32) ** 2), out

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    errs = relative_errors(f(q, k, v, "cudnn" if IMPL == "cudnn" else "xla"), f(q, k, v, "xla"))
    return {"max_relative_error": max(errs)}


def model_inputs(cfg):
    b = synthetic_batch(8, 128, 20, cfg.vocab_size, seed=1)
    inputs = (b["input_ids"], b["segment_ids"], b["input_mask"], b["masked_lm_positions"])
    params = nn.meta.unbox(
        jax.jit(M.BertForPreTraining(cfg).init)(jax.random.PRNGKey(0), *inputs)["params"]
    )
    return inputs, params


def model_loss(cfg, inputs, deterministic):
    def loss(params, rng):
        mlm, nsp = M.BertForPreTraining(cfg).apply(
            {"params": params}, *inputs, deterministic=deterministic, rngs={"dropout": rng}
        )
        return jnp.mean(mlm.astype(jnp.float32) ** 2) + jnp.mean(nsp**2)

    return loss


def model_nodrop() -> dict:
    cfg = dataclasses.replace(TWO_LAYERS, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    inputs, params = model_inputs(cfg)
    key = jax.random.PRNGKey(0)
    results = {}
    for impl in ("einsum", "xla", IMPL):
        c = dataclasses.replace(cfg, attention_impl=impl)
        results[impl] = jax.jit(jax.value_and_grad(model_loss(c, inputs, True)))(params, key)
    hlo = (
        jax.jit(model_loss(dataclasses.replace(cfg, attention_impl=IMPL), inputs, True))
        .lower(params, key)
        .as_text()
    )
    errs = relative_errors(results[IMPL], results["einsum"])
    names = ["loss"] + [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(results["einsum"][1])
    ]
    norms = [
        float(np.linalg.norm(np.asarray(r, np.float64))) for r in jax.tree.leaves(results["einsum"])
    ]
    worst = sorted(zip(errs, names, norms), reverse=True)[:6]
    return {
        "max_relative_error_loss_and_grads": max(errs),
        "median_relative_error": float(np.median(errs)),
        "worst (error, leaf, reference norm)": worst,
        "xla_path_max_relative_error": max(relative_errors(results["xla"], results["einsum"])),
        "custom_call_is_cudnn_fmha": "__cudnn$fmha" in hlo,
    }


def dropout_config():
    return dataclasses.replace(
        TWO_LAYERS, attention_impl=IMPL, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.1
    )


def model_dropout_fwd() -> dict:
    cfg = dropout_config()
    inputs, params = model_inputs(cfg)
    f = jax.jit(model_loss(cfg, inputs, False))
    key = jax.random.PRNGKey(0)
    first, second = float(f(params, key)), float(f(params, key))
    return {
        "loss_first_call": first,
        "loss_second_call": second,
        "masks_differ_between_calls": first != second,
    }


def model_dropout_grad() -> dict:
    cfg = dropout_config()
    inputs, params = model_inputs(cfg)
    value, grads = jax.jit(jax.value_and_grad(model_loss(cfg, inputs, False)))(
        params, jax.random.PRNGKey(0)
    )
    norm = float(
        np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    )
    return {"loss": float(value), "grad_norm": norm, "finite": bool(np.isfinite(norm))}


def step(dropout: float) -> dict:
    cfg = dataclasses.replace(TWO_LAYERS, attention_impl=IMPL, attention_probs_dropout_prob=dropout)
    r = time_variant(cfg, synthetic_batch(32, 128, 20, cfg.vocab_size), 3)
    return {k: r[k] for k in ("compile_s", "step_ms", "mlm_loss_first_last")}


CASES = {
    "raw": raw,
    "model_nodrop": model_nodrop,
    "model_dropout_fwd": model_dropout_fwd,
    "model_dropout_grad": model_dropout_grad,
    "step_nodrop": lambda: step(0.0),
    "step_dropout": lambda: step(0.1),
}

if __name__ == "__main__":
    case = sys.argv[1]
    print(f"PROBE {case} start on {jax.devices()[0].device_kind}", flush=True)
    print(f"PROBE {case} ok {json.dumps(CASES[case]())}", flush=True)
