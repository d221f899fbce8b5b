"""Probing a frozen encoder layer by layer: which layer knows what (the paper's section 5.3,
Table 7). The encoder runs once per example; small probes are then trained on its frozen
features (standardised per layer), one per layer (embeddings, layer 1..N) and one per Table 7
combination, each with the same budget and seeds, and scored with the task's official metric
through its fine-tuning adapter (GLUE: accuracy/F1/...; CoNLL-2003: conlleval entity F1).

Features: CoNLL-2003 uses each word's first sub-token vector (the fine-tuning setup); a
single-sentence GLUE task the mean over the real tokens; a pair task [a, b, |a - b|, a * b] of
the two segments' means (a [CLS] vector carries nothing below the top layer of an encoder
trained without NSP, and nothing at all at the embeddings). Shape legend: K layers stacked,
N examples (or tokens), H hidden size, F probe input size, C classes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bertjax.data import tokenization
from bertjax.runtime import files
from bertjax.tasks import features, glue, glue_tasks, metrics, ner

# Table 7's rows besides single layers; the last two of the "last four" when there are fewer.
COMBINATIONS = (
    "second_to_last",
    "last",
    "weighted_sum_last_four",
    "concat_last_four",
    "weighted_sum_all",
)
Adapter = features.Finetune[jax.Array, np.ndarray]  # a classifier's: GLUE's or CoNLL-2003's
ProbeState = tuple[dict, optax.OptState]  # a probe's parameters and Adam's state


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """The budget every probe gets (the same for every layer and combination)."""

    seeds: tuple[int, ...] = (1, 2, 3)
    epochs: int = 10  # passes over the training features
    batch_size: int = 64  # examples (tokens for CoNLL-2003) per step
    learning_rate: float = 1e-3  # Adam
    hidden_size: int = 0  # 0: a linear probe; else one ReLU hidden layer of this size
    extract_batch_size: int = 32  # sequences per encoder forward pass


def task_adapter(
    task: str, options: features.TaskOptions, tokenizer: tokenization.Tokenizer
) -> Adapter:
    """The fine-tuning adapter of `task` (conll2003 or a GLUE task name); ValueError if unknown."""
    if task == "conll2003":
        return ner.NerFinetune(options, tokenizer)
    if glue_tasks.get_task(task).is_regression:
        raise ValueError(
            f"task {task!r} is a regression; probes are classifiers (use a "
            "classification task: conll2003 or a GLUE task other than stsb)"
        )
    return glue.GlueFinetune(dataclasses.replace(options, task=task), tokenizer)


# ----------------------------------------------------------------------------- features


def layer_features(
    model: nn.Module, params: Mapping[str, Any], data: features.SplitData, batch_size: int
) -> np.ndarray:
    """The probe inputs of every example at every layer: `[N + 1, examples, F]` for GLUE,
    `[N + 1, labelled tokens, H]` for CoNLL-2003 (layer 0 = the embedding output)."""
    inputs = data.features
    tokens = "label_weights" in inputs
    pair = bool(np.any(inputs["segment_ids"]))

    @jax.jit
    def pooled(input_ids: jax.Array, input_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
        (layers_NxBxLxH, _), sown = model.apply(
            {"params": params},
            input_ids,
            segment_ids,
            input_mask,
            True,
            all_layers=True,
            mutable=["intermediates"],
        )
        embeddings_BxLxH = sown["intermediates"]["encoder"]["embedding_output"][0]
        stack_KxBxLxH = jnp.concatenate([embeddings_BxLxH[None], layers_NxBxLxH])
        if tokens:
            return stack_KxBxLxH
        if not pair:
            return _masked_mean(stack_KxBxLxH, input_mask)
        a, b = (_masked_mean(stack_KxBxLxH, input_mask * (segment_ids == s)) for s in (0, 1))
        return jnp.concatenate([a, b, jnp.abs(a - b), a * b], axis=-1)

    chunks, count = [], len(inputs["input_ids"])
    for start in range(0, count, batch_size):
        rows = np.arange(start, start + batch_size) % count  # fixed shapes: one compile
        out = np.asarray(
            jax.device_get(
                pooled(*(inputs[k][rows] for k in ("input_ids", "input_mask", "segment_ids")))
            )
        )[:, : min(batch_size, count - start)]
        if tokens:
            out = out[:, inputs["label_weights"][rows[: out.shape[1]]] > 0]
        chunks.append(out)
    return np.concatenate(chunks, axis=1)


def _masked_mean(x_KxBxLxH: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    mask = mask_BxL.astype(x_KxBxLxH.dtype)[None, :, :, None]
    return jnp.sum(x_KxBxLxH * mask, axis=2) / jnp.maximum(jnp.sum(mask, axis=2), 1.0)


def probe_labels(data: features.SplitData) -> np.ndarray:
    """The label of each probe input (example, or labelled token for CoNLL-2003)."""
    if "label_weights" in data.features:
        return data.features["labels"][data.features["label_weights"] > 0]
    return data.features["labels"]


def layer_sets(num_layers: int) -> dict[str, tuple[list[int], str]]:
    """Probe name -> (stacked layers, "mix" or "concat"): each layer, then Table 7's rows
    (second-to-last and last are the single-layer probes again, by name)."""
    last_four = list(range(max(1, num_layers - 3), num_layers + 1))
    sets = {("embeddings" if k == 0 else f"layer_{k}"): ([k], "mix") for k in range(num_layers + 1)}
    sets.update(
        second_to_last=([num_layers - 1], "mix"),
        last=([num_layers], "mix"),
        weighted_sum_last_four=(last_four, "mix"),
        concat_last_four=(last_four, "concat"),
        weighted_sum_all=(list(range(1, num_layers + 1)), "mix"),
    )
    return sets


# ----------------------------------------------------------------------------- probes


def _probe_logits(params: dict, x_KxNxH: jax.Array, combine: str) -> jax.Array:
    if combine == "concat":
        h_NxF = jnp.concatenate(list(x_KxNxH), axis=-1)
    else:  # ELMo's scalar mix: softmax-normalised layer weights times a scale
        weights_K = jax.nn.softmax(params["layer_weights"])
        h_NxF = params["scale"] * jnp.einsum("k,knh->nh", weights_K, x_KxNxH)
    if "hidden" in params:
        h_NxF = jax.nn.relu(h_NxF @ params["hidden"]["w"] + params["hidden"]["b"])
    return h_NxF @ params["out"]["w"] + params["out"]["b"]


def _init_probe(
    key: jax.Array, num_layers: int, input_size: int, num_classes: int, hidden_size: int
) -> dict:
    def dense(key: jax.Array, fan_in: int, fan_out: int) -> dict[str, jax.Array]:
        return {
            "w": jax.random.normal(key, (fan_in, fan_out)) / np.sqrt(fan_in),
            "b": jnp.zeros(fan_out),
        }

    hidden_key, out_key = jax.random.split(key)
    params: dict[str, Any] = {"layer_weights": jnp.zeros(num_layers), "scale": jnp.ones(())}
    if hidden_size:
        params["hidden"] = dense(hidden_key, input_size, hidden_size)
        input_size = hidden_size
    params["out"] = dense(out_key, input_size, num_classes)
    return params


@functools.partial(jax.jit, static_argnames=("combine", "num_classes", "settings"))
def train_probe(
    x_KxNxH: jax.Array,
    labels_N: jax.Array,
    seed: int,
    combine: str,
    num_classes: int,
    settings: ProbeSettings,
) -> dict:
    """A probe trained on frozen features with Adam, `settings.epochs` passes of shuffled
    batches (a seeded init and order)."""
    num_layers, count, width = x_KxNxH.shape
    batch = min(settings.batch_size, count)
    steps_per_epoch = count // batch
    input_size = width * num_layers if combine == "concat" else width
    init_key, order_key = jax.random.split(jax.random.PRNGKey(seed))
    params = _init_probe(init_key, num_layers, input_size, num_classes, settings.hidden_size)
    tx = optax.adam(settings.learning_rate)

    def loss_fn(params: dict, rows: jax.Array) -> jax.Array:
        logits = _probe_logits(params, x_KxNxH[:, rows], combine)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels_N[rows]).mean()

    def step(carry: ProbeState, rows: jax.Array) -> tuple[ProbeState, None]:
        params, opt_state = carry
        grads = jax.grad(loss_fn)(params, rows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    def epoch(carry: ProbeState, key: jax.Array) -> tuple[ProbeState, None]:
        order = jax.random.permutation(key, count)[: steps_per_epoch * batch]
        return jax.lax.scan(step, carry, order.reshape(steps_per_epoch, batch))[0], None

    keys = jax.random.split(order_key, settings.epochs)
    (params, _), _ = jax.lax.scan(epoch, (params, tx.init(params)), keys)
    return params


def _outputs(adapter: Adapter, data: features.SplitData, logits: np.ndarray) -> np.ndarray:
    """What the adapter scores: logits per example (GLUE) or tag ids per token (CoNLL)."""
    if "label_weights" not in data.features:
        return logits
    predicted = np.zeros(data.features["labels"].shape, np.int32)
    predicted[data.features["label_weights"] > 0] = np.argmax(logits, axis=-1)
    return predicted


def probe_task(
    adapter: Adapter,
    train: features.SplitData,
    evaluation: features.SplitData,
    train_x: np.ndarray,
    eval_x: np.ndarray,
    num_classes: int,
    settings: ProbeSettings,
) -> dict[str, Any]:
    """Every layer's and combination's probe, each seed: `{name: {metric: spread}}` of the
    adapter's official metrics on `evaluation`."""
    labels = jnp.asarray(probe_labels(train))
    # Each layer's features standardised with the training set's statistics, so that every
    # probe starts on the same scale (mean pooling shrinks the features, layers differ).
    mean = train_x.mean(axis=1, keepdims=True)
    std = train_x.std(axis=1, keepdims=True) + 1e-6
    train_x, eval_x = (train_x - mean) / std, (eval_x - mean) / std
    results: dict[str, Any] = {}
    for name, (layers, combine) in layer_sets(train_x.shape[0] - 1).items():
        runs = []
        for seed in settings.seeds:
            params = train_probe(
                jnp.asarray(train_x[layers]), labels, seed, combine, num_classes, settings
            )
            logits = np.asarray(_probe_logits(params, jnp.asarray(eval_x[layers]), combine))
            runs.append(adapter.evaluate(evaluation, _outputs(adapter, evaluation, logits)))
        results[name] = {
            metric: metrics.spread([run[metric] for run in runs]) for metric in runs[0]
        }
    return results


def run_probes(
    model: nn.Module,
    params: Mapping[str, Any],
    tokenizer: tokenization.Tokenizer,
    tasks: Sequence[str],
    options: features.TaskOptions,
    settings: ProbeSettings,
) -> dict[str, Any]:
    """Probes every task in `tasks` (features extracted once per example); the probe.json
    content without the run's own description."""
    out = {}
    for task in tasks:
        try:
            adapter = task_adapter(task, options, tokenizer)
            train, evaluation = adapter.load("train"), adapter.load(adapter.eval_splits[0])
        except ValueError as e:  # an unknown task; the readers' name the file and the fault
            raise features.TaskDataError(str(e)) from e
        train_x, eval_x = (
            layer_features(model, params, split, settings.extract_batch_size)
            for split in (train, evaluation)
        )
        num_classes = (
            len(ner.LABELS) if task == "conll2003" else glue_tasks.get_task(task).num_labels
        )
        out[task] = {
            "metric": adapter.main_metric,
            "eval_split": evaluation.name,
            "train_examples": len(train),
            "eval_examples": len(evaluation),
            "probe_inputs": int(train_x.shape[1]),
            "feature_size": int(train_x.shape[2]),
            "results": probe_task(
                adapter, train, evaluation, train_x, eval_x, num_classes, settings
            ),
        }
    return out


def table(task: str, entry: dict[str, Any]) -> list[str]:
    """The console table of one task's probe.json entry: the main metric (mean ± std over
    seeds) per layer and combination, the best one marked."""
    results, metric = entry["results"], entry["metric"]
    best = max(results, key=lambda n: results[n][metric]["mean"])
    width = max(len(n) for n in results)
    return [f"{task} ({entry['eval_split']} {metric}, mean ± std over seeds):"] + [
        f"  {name:<{width}}  {values[metric]['mean']:.4f} ± {values[metric]['std']:.4f}"
        + ("  best" if name == best else "")
        for name, values in results.items()
    ]


# ----------------------------------------------------------------------------- plot


def plot(record: dict[str, Any], path: str, title: str = "") -> None:
    """probe.png: the main metric against the layer, one line per task (mean ± std over
    seeds), Table 7's combinations as marked points to the right."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"{path} needs matplotlib: pip install -e '.[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    combos = ("concat_last_four", "weighted_sum_last_four", "weighted_sum_all")
    markers = ("s", "^", "D")
    num_layers = 0
    for task, entry in record["tasks"].items():
        results, metric = entry["results"], entry["metric"]
        layers = [n for n in results if n == "embeddings" or n.startswith("layer_")]
        num_layers = len(layers) - 1
        means = [100 * results[n][metric]["mean"] for n in layers]
        stds = [100 * results[n][metric]["std"] for n in layers]
        line = ax.errorbar(
            range(len(layers)), means, yerr=stds, marker="o", capsize=3, label=f"{task} ({metric})"
        )
        for i, (name, marker) in enumerate(zip(combos, markers)):
            ax.errorbar(
                len(layers) + i,
                100 * results[name][metric]["mean"],
                yerr=100 * results[name][metric]["std"],
                marker=marker,
                capsize=3,
                color=line.lines[0].get_color(),
                linestyle="none",
            )
    ticks = (
        ["emb"]
        + [str(k) for k in range(1, num_layers + 1)]
        + ["cat\nlast 4", "wsum\nlast 4", "wsum\nall"]
    )
    ax.set_xticks(range(len(ticks)), ticks)
    ax.axvline(num_layers + 0.5, color="grey", linewidth=0.5)
    ax.set_xlabel("layer (0 = embeddings) | Table 7 combinations")
    ax.set_ylabel("dev metric x 100 (mean ± std over seeds)")
    ax.set_title(title or "Probing a frozen encoder")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with files.open(path, "wb") as f:  # (a local path or a URL)
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
