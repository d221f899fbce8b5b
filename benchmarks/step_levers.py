"""Levers of the BERT train step, one at a time, in one process (issue 13).

    TRACE_SUMMARY=../shared/tools/trace_summary.py PYTHONPATH=. \
        python benchmarks/step_levers.py --check --lengths=512,128 --profile=0,5 --out=DIR
    PYTHONPATH=. python benchmarks/step_levers.py --cost --layers=2 --variants=0,1,4,5

`--cost` compiles each variant (on any backend, the CPU included) and records XLA's cost
analysis of the step instead of timing it: bytes accessed and FLOPs per step, and the
largest `compare` ops of the optimised HLO (what the GPU profile's compare fusions are).

`--check` first compares the cuDNN attention path with the einsum reference on the GPU
(bf16, padding in the batch, dropout off: outputs and gradients) and checks that cuDNN's
attention dropout draws new masks every step. Then it times BERT-large (bf16, the paper's
recipe: dropout 0.1 everywhere, BERT-Adam, clipping) for each variant below on a synthetic
batch with padding, and profiles the chosen ones (`jax.profiler`, kernel time by kind).
Earlier implementations are restored for measurement by patching them back in here; the
product keeps only the winners.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bertjax.models import attention, flops
from bertjax.models.bert import model as M
from bertjax.training import optim, sharding, steps
from bertjax.training.state import create_train_state

LARGE = M.BertConfig(
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    intermediate_size=4096,
    dtype="bfloat16",
)


class FlaxDropout(nn.Module):
    """The earlier hidden dropout: flax's nn.Dropout (32 random bits per element)."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic):
        return nn.Dropout(self.rate)(x, deterministic=deterministic)


def apply_update_select(state, tx, loss, grads, metrics, batch):
    """Guard as a select fused into the update (one pass over the state; `batch` unused)."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    def keep(new, old):
        return jnp.where(finite, new, old)

    new_state = state.replace(
        step=state.step + 1,
        params=jax.tree.map(keep, params, state.params),
        opt_state=jax.tree.map(keep, opt_state, state.opt_state),
    )
    return new_state, dict(metrics, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32))


def apply_update_loss_guard(state, tx, loss, grads, metrics, batch):
    """The guard before issue 15: loss and gradient norm only (the update is not checked)."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def update(_):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        return optax.apply_updates(state.params, updates), opt_state

    params, opt_state = jax.lax.cond(
        finite, update, lambda _: (state.params, state.opt_state), None
    )
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), dict(
        metrics, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32)
    )


def einsum_attention_bf16_probs(q, k, v, mask_bias, dropout):
    """Softmax statistics in float32, probabilities cast to the compute dtype before dropout."""
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(q.shape[-1]))
    probs = jax.nn.softmax(scores + mask_bias, axis=-1).astype(v.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", dropout(probs), v)


# Functions replaced by name in the module that owns them (the model looks them up there).
OWNERS = {"Dropout": M, "einsum_attention": attention, "_apply_update": steps}
ORIGINAL = {name: getattr(module, name) for name, module in OWNERS.items()}
LOSS_ONLY_GUARD = {"_apply_update": apply_update_loss_guard}
BEFORE = {"Dropout": FlaxDropout, **LOSS_ONLY_GUARD}  # steps.py's lax.cond guard of then
SELECT = {"_apply_update": apply_update_select}

# name -> (attention_impl, replacements of model/steps functions; the rest as in the product)
VARIANTS = {
    "before (einsum, flax dropout, cond guard)": ("einsum", BEFORE),
    "einsum + 16-bit dropout": ("einsum", {}),
    "cudnn + flax dropout": ("cudnn", {"Dropout": FlaxDropout}),
    "cudnn + 16-bit dropout": ("cudnn", {}),
    "cudnn + 16-bit dropout + select guard": ("cudnn", SELECT),
    "einsum + 16-bit dropout + select guard": ("einsum", SELECT),
    "cudnn + 16-bit dropout + vocab padded to 128": ("cudnn", {"vocab_pad_multiple": 128}),
    "einsum + 16-bit dropout + vocab padded to 128": ("einsum", {"vocab_pad_multiple": 128}),
    "einsum + 16-bit dropout + bf16 probabilities": (
        "einsum",
        {"einsum_attention": einsum_attention_bf16_probs},
    ),
    "einsum + 16-bit dropout + loss-only guard": ("einsum", LOSS_ONLY_GUARD),
    "cudnn + 16-bit dropout + loss-only guard": ("cudnn", LOSS_ONLY_GUARD),
}


def synthetic_batch(batch, length, predictions, vocab, seed=0):
    """Sequence pairs whose real lengths vary from 60% to 100% of `length` (padding present)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(int(0.6 * length), length + 1, batch)
    mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
    positions = np.stack(
        [np.sort(rng.choice(np.arange(1, n), predictions, replace=False)) for n in lengths]
    ).astype(np.int32)
    return {
        "input_ids": (rng.integers(5, vocab, (batch, length)) * mask).astype(np.int32),
        "input_mask": mask,
        "segment_ids": ((np.arange(length)[None] >= lengths[:, None] // 2) * mask).astype(np.int32),
        "masked_lm_positions": positions,
        "masked_lm_ids": rng.integers(5, vocab, (batch, predictions)).astype(np.int32),
        "masked_lm_weights": np.ones((batch, predictions), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,)).astype(np.int32),
    }


def patch(replacements):
    """Restores the product's functions, then applies `replacements` by name."""
    for name, value in {**ORIGINAL, **replacements}.items():
        if name in OWNERS:
            setattr(OWNERS[name], name, value)


def build(config, batch_np, accum=1):
    mesh = sharding.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    model = M.BertForPreTraining(config)
    opt = optim.OptimizerConfig(
        name="bert_adam",
        peak_learning_rate=1e-4,
        warmup_steps=10000,
        total_steps=1000000,
        weight_decay_rate=0.01,
        eps=1e-6,
        clip_global_norm=1.0,
    )
    tx = optim.make_optimizer(opt)
    state, _, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(0), M.example_inputs(model), mesh
    )
    step = steps.jit_train_step(steps.make_train_step(model, tx, accum), shardings, mesh)
    with sharding.activate(mesh):
        batch = sharding.global_batch_from_host(batch_np, mesh)
    return mesh, state, step, batch


def time_variant(config, batch_np, n_steps, trace_dir=None):
    mesh, state, step, batch = build(config, batch_np)
    times, losses = [], []
    with sharding.activate(mesh):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        compile_s = time.perf_counter() - t0
        for i in range(n_steps + 2):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            if i >= 2:
                times.append(time.perf_counter() - t0)
            losses.append(float(metrics["mlm_loss_sum"] / metrics["mlm_weight_sum"]))
        summary = None
        if trace_dir:
            jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
            for _ in range(3):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            summary = summarize_trace(trace_dir, 3)
    del state, step, batch
    gc.collect()
    return {
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "step_ms_all": [1e3 * t for t in times],
        "mlm_loss_first_last": [losses[0], losses[-1]],
        "kernel_summary": summary,
    }


def cost_variant(config, batch_np):
    """XLA's cost analysis of the compiled step: bytes accessed, FLOPs, largest compares."""
    mesh, state, step, batch = build(config, batch_np)
    with sharding.activate(mesh):
        compiled = step.lower(state, batch).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    compares = collections.Counter()
    for line in compiled.as_text().splitlines():
        match = re.search(r"= (\w+)\[([\d,]*)\][^=]* compare\(", line)
        if match:
            dims = [int(d) for d in match.group(2).split(",") if d]
            compares[f"{match.group(1)}[{match.group(2)}]"] += 1 if dims else 0
    del state, step, batch
    gc.collect()
    largest = sorted(
        compares.items(),
        key=lambda kv: (
            -np.prod([int(d) for d in kv[0].split("[")[1].rstrip("]").split(",") if d] or [1])
        ),
    )[:4]
    return {
        "bytes_accessed": cost.get("bytes accessed"),
        "flops": cost.get("flops"),
        "largest_compares": [f"{shape} x{n}" for shape, n in largest],
    }


def summarize_trace(trace_dir, n_steps):
    files = glob.glob(
        os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True
    ) or glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)
    tool = os.environ.get("TRACE_SUMMARY")
    if not files or not tool:
        return f"no trace summary (files={files}, tool={tool})"
    out = subprocess.run(
        [sys.executable, tool, sorted(files)[-1], "--steps", str(n_steps), "--top", "25"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout + out.stderr


def check_cudnn(log):
    """cuDNN attention vs the einsum reference on the GPU, bf16, padding, dropout off."""
    cfg = dataclasses.replace(LARGE, num_hidden_layers=2, hidden_dropout_prob=0.0)
    b = synthetic_batch(8, 128, 20, cfg.vocab_size, seed=1)
    inputs = (b["input_ids"], b["segment_ids"], b["input_mask"], b["masked_lm_positions"])
    params = nn.meta.unbox(
        jax.jit(M.BertForPreTraining(cfg).init)(jax.random.PRNGKey(0), *inputs)["params"]
    )

    def loss(params, impl):
        c = dataclasses.replace(cfg, attention_impl=impl)
        mlm, nsp = M.BertForPreTraining(c).apply({"params": params}, *inputs)
        return jnp.mean(mlm.astype(jnp.float32) ** 2) + jnp.mean(nsp**2), (mlm, nsp)

    f = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    ref = f(params, "einsum")
    got = f(params, "cudnn")

    def f32(t):
        return jax.tree.map(lambda x: np.asarray(x, np.float64), t)

    errs = []
    for a, r in zip(jax.tree.leaves(f32(got)), jax.tree.leaves(f32(ref))):
        errs.append(float(np.linalg.norm(a - r) / max(np.linalg.norm(r), 1e-30)))
    hlo = jax.jit(loss, static_argnums=1).lower(params, "cudnn").as_text()
    # With dropout: two steps on the same params and batch must draw different masks.
    cfg_d = dataclasses.replace(cfg, attention_impl="cudnn", attention_probs_dropout_prob=0.1)
    fwd = jax.jit(
        lambda p: M.BertForPreTraining(cfg_d).apply(
            {"params": p}, *inputs, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}
        )[0]
    )
    d1, d2 = np.asarray(fwd(params), np.float32), np.asarray(fwd(params), np.float32)
    result = {
        "max_relative_error_outputs_and_grads": max(errs),
        "median_relative_error": statistics.median(errs),
        "custom_call_is_cudnn_fmha": "__cudnn$fmha" in hlo,
        "dropout_masks_differ_between_calls": bool(np.abs(d1 - d2).max() > 0),
    }
    log(f"cudnn check: {result}")
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="512,128")
    p.add_argument("--variants", default="all", help="comma-separated indices into VARIANTS")
    p.add_argument("--profile", default="", help="comma-separated variant indices to profile")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--check", action="store_true")
    p.add_argument("--out", default="step_levers")
    p.add_argument("--smoke", action="store_true", help="a tiny model and batch (CPU check)")
    p.add_argument("--cost", action="store_true", help="XLA cost analysis instead of timing")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)

    def log(s):
        return print(s, flush=True)

    record = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "command": " ".join(sys.argv),
        "results": {},
    }
    if a.check:
        record["cudnn_check"] = check_cudnn(log)
    names = list(VARIANTS)
    chosen = range(len(names)) if a.variants == "all" else [int(i) for i in a.variants.split(",")]
    profiled = {int(i) for i in a.profile.split(",") if i}
    shapes = {512: (32, 80), 128: (128, 20)}
    if a.smoke:
        shapes = {512: (2, 80), 128: (4, 20)}
    for length in [int(x) for x in a.lengths.split(",")]:
        batch_size, predictions = shapes[length]
        batch_np = synthetic_batch(batch_size, length, predictions, LARGE.vocab_size)
        config = dataclasses.replace(LARGE, num_hidden_layers=a.layers)
        if a.smoke:
            config = dataclasses.replace(
                config,
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=128,
                dtype="float32",
            )
        step_flops = flops.train_flops_per_sequence(config, length, predictions) * batch_size
        for i in chosen:
            impl, replacements = VARIANTS[names[i]]
            patch(replacements)
            fields = {k: v for k, v in replacements.items() if k not in OWNERS}
            variant_config = dataclasses.replace(config, attention_impl=impl, **fields)
            name = f"L{length} B{batch_size} | {names[i]}"
            if a.cost:
                r = record["results"][name] = cost_variant(variant_config, batch_np)
                log(
                    f"L={length} B={batch_size} {names[i]:45s} {r['bytes_accessed'] / 1e9:8.2f} "
                    f"GB accessed, {r['flops'] / 1e12:7.3f} TFLOP; compares {r['largest_compares']}"
                )
                continue
            trace = os.path.join(a.out, f"trace_{length}_{i}") if i in profiled else None
            r = time_variant(variant_config, batch_np, a.steps, trace)
            r["mfu"] = (
                flops.mfu(step_flops / (r["step_ms"] / 1e3), 1, flops.peak_tflops(record["device"]))
                or 0.0
            )
            record["results"][name] = r
            log(
                f"L={length} B={batch_size} {names[i]:45s} {r['step_ms']:7.1f} ms  MFU "
                f"{r['mfu']:.1%}  compile {r['compile_s']:.0f}s  loss {r['mlm_loss_first_last']}"
            )
            if r["kernel_summary"]:
                log(r["kernel_summary"])
        with open(os.path.join(a.out, "step_levers.json"), "w") as f:
            json.dump(record, f, indent=1)
    patch({})


if __name__ == "__main__":
    main()
