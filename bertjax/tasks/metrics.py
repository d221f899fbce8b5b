"""Official task metrics: GLUE (accuracy, F1, Matthews, Pearson, Spearman) and CoNLL
entity-level precision/recall/F1 (conlleval's chunk rules, IOB1 and IOB2 alike).

All values are fractions in [0, 1] (correlations in [-1, 1]); inputs are host arrays. Also
their summary over a fine-tuning run's seeds, as printed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Mean, standard deviation (ddof 0), median and the values of repeated runs (seeds)."""
    return {
        "mean": float(np.mean(values)),
        "std": float(np.std(values)),
        "median": float(np.median(values)),
        "values": list(values),
    }


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.asarray(predictions) == np.asarray(labels)))


def binary_f1(predictions: np.ndarray, labels: np.ndarray, positive: int = 1) -> float:
    """F1 of the positive class (MRPC, QQP); 0 when there are no true positives."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    true_positives = np.sum((predictions == positive) & (labels == positive))
    if true_positives == 0:
        return 0.0
    precision = true_positives / np.sum(predictions == positive)
    recall = true_positives / np.sum(labels == positive)
    return float(2 * precision * recall / (precision + recall))


def matthews_corrcoef(predictions: np.ndarray, labels: np.ndarray) -> float:
    """Binary Matthews correlation (CoLA); 0 when a marginal is empty, as scikit-learn."""
    p, y = np.asarray(predictions) == 1, np.asarray(labels) == 1
    tp, tn = float(np.sum(p & y)), float(np.sum(~p & ~y))
    fp, fn = float(np.sum(p & ~y)), float(np.sum(~p & y))
    denominator = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return float((tp * tn - fp * fn) / denominator) if denominator else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    denominator = np.sqrt(np.sum(dx * dx) * np.sum(dy * dy))
    return float(np.sum(dx * dy) / denominator) if denominator else 0.0


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (as scipy.stats.rankdata)."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x), np.float64)
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2.0
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of the average ranks."""
    return pearson(
        _average_ranks(np.asarray(x, np.float64)), _average_ranks(np.asarray(y, np.float64))
    )


# ----------------------------------------------------------------------------- CoNLL entities


def _split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '')."""
    if tag == "O" or "-" not in tag:
        return "O", ""
    prefix, kind = tag.split("-", 1)
    return prefix, kind


# conlleval's endOfChunk / startOfChunk tables: (previous prefix, current prefix) pairs.
_CHUNK_ENDS = {("B", "B"), ("B", "O"), ("I", "B"), ("I", "O"), ("E", "E"), ("E", "I"), ("E", "O")}
_CHUNK_STARTS = {("B", "B"), ("I", "B"), ("O", "B"), ("O", "I"), ("E", "E"), ("E", "I"), ("O", "E")}


def _ends(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    """conlleval's endOfChunk: does the chunk holding the previous token end before this one?"""
    return (prev, tag) in _CHUNK_ENDS or (prev != "O" and prev_type != kind)


def _starts(prev: str, prev_type: str, tag: str, kind: str) -> bool:
    """conlleval's startOfChunk: does a chunk start at this token?"""
    return (prev, tag) in _CHUNK_STARTS or (tag != "O" and prev_type != kind)


def entities(tags: Sequence[str]) -> set[tuple[int, int, str]]:
    """Chunks `(first, last, type)` of one sentence under conlleval's rules, which read IOB1
    (I- starts a chunk unless it continues one of the same type) and IOB2 alike."""
    chunks, start = set(), None
    prev, prev_type = "O", ""
    for i, tag in enumerate([*tags, "O"]):
        prefix, kind = _split_tag(tag)
        if start is not None and _ends(prev, prev_type, prefix, kind):
            chunks.add((start, i - 1, prev_type))
            start = None
        if _starts(prev, prev_type, prefix, kind):
            start = i
        prev, prev_type = prefix, kind
    return chunks


def entity_scores(
    gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]
) -> dict[str, float]:
    """Micro-averaged entity precision, recall and F1 over sentences (conlleval's totals)."""
    correct = found_gold = found_predicted = 0
    for gold_tags, predicted_tags in zip(gold, predicted, strict=True):
        gold_chunks, predicted_chunks = entities(gold_tags), entities(predicted_tags)
        correct += len(gold_chunks & predicted_chunks)
        found_gold += len(gold_chunks)
        found_predicted += len(predicted_chunks)
    precision = correct / found_predicted if found_predicted else 0.0
    recall = correct / found_gold if found_gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


def summarize_seeds(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation (ddof 0) and median of every dev (and labelled test) metric
    over the seeds."""
    table: dict[str, list[float]] = {}
    for result in results:
        for split, values in {**result["dev"], **result["test"]}.items():
            for key, value in values.items():
                table.setdefault(f"{split}/{key}", []).append(value)
    return {key: spread(v) for key, v in table.items()}


def metric_value(name: str, value: float, percent: frozenset[str] = frozenset()) -> str:
    """A metric as printed: `88.50%` for one reported in percent (SQuAD's official EM/F1),
    `0.8850` for a fraction of 1 (GLUE, CoNLL-2003)."""
    return f"{value:.2f}%" if name in percent else f"{value:.4f}"


def summary_lines(
    task: str,
    stats: dict[str, dict[str, float]],
    num_seeds: int,
    baselines: dict[str, tuple[str, dict[str, float]]],
    percent: frozenset[str] = frozenset(),
) -> tuple[list[str], list[str]]:
    """The run's summary lines (each metric over the seeds, beside its split's baseline), and
    per split a warning naming the metrics whose mean does not beat the baseline: `baselines`
    maps a split to (how the baseline predicts, its metrics); `percent` names the metrics
    reported in percent."""
    lines: list[str] = []
    behind: dict[str, list[str]] = {}
    for key, values in stats.items():
        split, metric = key.split("/", 1)
        mean, std, median = (
            metric_value(metric, values[k], percent) for k in ("mean", "std", "median")
        )
        line = f"{task} {key}: mean {mean} std {std} median {median} over {num_seeds} seeds"
        if split in baselines and metric in baselines[split][1]:
            baseline = baselines[split][1][metric]
            line += f"; baseline {baseline:.4f}"
            if values["mean"] <= baseline:
                behind.setdefault(split, []).append(
                    f"{metric} {values['mean']:.4f} (baseline {baseline:.4f})"
                )
        lines.append(line)
    warnings = [
        f"{split}: {', '.join(names)} do not beat the baseline that ignores the input "
        f"({baselines[split][0]}): the model has not learned {task}; try more epochs "
        "(--config.num_train_epochs), another --config.learning_rate, or a longer "
        "pretrained init_checkpoint"
        for split, names in behind.items()
    ]
    return lines, warnings
