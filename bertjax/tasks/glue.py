"""GLUE's data and fine-tuning: readers for the GLUE download layout (TSV), Hugging Face
parquet files and tfds `glue/...`; encoding; official metrics; leaderboard submissions; the
task's fine-tuning adapter. What each task is (labels, columns, splits): `glue_tasks`.

Test predictions are written as the leaderboard's `<TASK>.tsv` files with an
`index<TAB>prediction` header.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from bertjax.data import tfds_source, tokenization
from bertjax.models import families
from bertjax.models.layers import losses
from bertjax.runtime import files
from bertjax.tasks import features, metrics
from bertjax.tasks.glue_tasks import GlueTask, Split, get_task


@dataclasses.dataclass
class Example:
    index: str  # the row's id (the leaderboard's `index` column for test rows)
    text_a: str
    text_b: str | None
    label: str | float | None  # label name, STS-B score, or None (test)


# ----------------------------------------------------------------------------- readers


def _task_dir(data_dir: str, task: GlueTask) -> str:
    """`data_dir` may be the GLUE root (holding MRPC/, ...) or the task's own folder."""
    nested = os.path.join(data_dir, task.directory)
    return nested if files.isdir(nested) else data_dir


def _read_tsv(path: str) -> Iterable[list[str]]:
    # The GLUE TSVs have no quoting; utf-8-sig drops MRPC's byte-order mark.
    with files.open(path, encoding="utf-8-sig", newline="") as f, features.decoding(path):
        yield from csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)


def _label_value(task: GlueTask, raw: Any, skips: features.SkipCounter) -> str | float | None:
    if task.is_regression:
        try:
            return float(raw)
        except (TypeError, ValueError):
            skips["unparsable score"] += 1
            return None
    label = str(raw).strip()
    if label not in task.class_names:
        skips["unknown label"] += 1
        return None
    return label


def _tsv_examples(
    task: GlueTask, split: Split, paths: Sequence[str], skips: features.SkipCounter
) -> list[Example]:
    examples = []
    columns = [c for c in (split.text_a, split.text_b, split.label) if c is not None]
    for path in paths:
        for line_number, row in enumerate(_read_tsv(path)):
            if split.header and line_number == 0:
                continue
            if not row or row == [""]:
                continue
            if max(columns) >= len(row) or (min(columns) < 0 and -min(columns) > len(row)):
                skips["missing column"] += 1
                continue
            label = None
            if split.label is not None:
                label = _label_value(task, row[split.label], skips)
                if label is None:
                    continue
            index = row[0] if split.submission else f"{os.path.basename(path)}-{line_number}"
            examples.append(
                Example(
                    index,
                    row[split.text_a],
                    None if split.text_b is None else row[split.text_b],
                    label,
                )
            )
    return examples


def _text(record: dict, key: str) -> str:
    """A text feature of a record, decoded where tfds gives bytes."""
    return record[key].decode("utf-8") if isinstance(record[key], bytes) else record[key]


def _record_examples(
    task: GlueTask, split: Split, records: Iterable[dict], skips: features.SkipCounter
) -> list[Example]:
    """Examples from tfds / Hugging Face records (text features, integer labels, `idx`)."""
    key_a, key_b = task.hf_keys
    examples = []
    for position, record in enumerate(records):
        if key_a not in record or (key_b and key_b not in record):
            skips["missing column"] += 1
            continue
        label = None
        if not split.submission:
            raw = record.get("label")
            if (
                task.hf_labels is not None
                and raw is not None
                and 0 <= int(raw) < len(task.hf_labels)
            ):
                raw = task.hf_labels[int(raw)]
            label = _label_value(task, raw, skips)
            if label is None:
                continue
        examples.append(
            Example(
                str(record.get("idx", position)),
                _text(record, key_a),
                _text(record, key_b) if key_b else None,
                label,
            )
        )
    return examples


def _read_parquet(path: str) -> list[dict]:
    import pyarrow.parquet as pq  # only for Hugging Face parquet layouts

    with files.open(path, "rb") as f:
        return pq.read_table(f).to_pylist()


def read_examples(
    task: GlueTask, split_name: str, data_dir: str = "", tfds_data_dir: str = ""
) -> tuple[list[Example], dict[str, int]]:
    """Reads one split from `data_dir` (TSV, or `<split>.parquet` as Hugging Face writes it)
    or, with `data_dir` empty, from tfds `glue/<task>`. Returns examples and skip counts."""
    split = task.split(split_name)
    skips = features.SkipCounter()
    if not data_dir:
        try:
            source = tfds_source.open_tfds_source(
                split.tfds_name or f"glue/{task.name}", split.hf, tfds_data_dir or None
            )
        except FileNotFoundError as e:
            raise features.TaskDataError(
                f"{e} Or set --config.data_dir to the GLUE download "
                f"(TSV files, e.g. {task.directory}/train.tsv)."
            ) from e
        examples = _record_examples(task, split, source, skips)
        where = f"tfds {split.tfds_name or 'glue/' + task.name}:{split.hf}"
    else:
        directory = _task_dir(data_dir, task)
        parquet = os.path.join(directory, f"{split.hf}.parquet")
        tsvs = next(
            (
                paths
                for paths in ([os.path.join(directory, p) for p in files] for files in split.tsv)
                if all(files.exists(p) for p in paths)
            ),
            None,
        )
        if tsvs:
            examples, where = _tsv_examples(task, split, tsvs, skips), ", ".join(tsvs)
        elif files.exists(parquet):
            examples, where = _record_examples(task, split, _read_parquet(parquet), skips), parquet
        else:
            raise features.TaskDataError(
                f"GLUE {task.name} {split_name}: none of {[list(f) for f in split.tsv]} or "
                f"{split.hf}.parquet in {directory}; point --config.data_dir at the GLUE download "
                "(or leave it empty to use tfds)"
            )
    counts = skips.report(f"GLUE {task.name} {split_name} ({where})")
    logging.info("GLUE %s %s: %d examples from %s", task.name, split_name, len(examples), where)
    if not examples:
        raise features.TaskDataError(
            f"GLUE {task.name} {split_name}: no usable rows in {where} (skipped: {counts})"
        )
    return examples, counts


# ----------------------------------------------------------------------------- features


def encode(
    task: GlueTask,
    examples: Sequence[Example],
    tokenizer: tokenization.Tokenizer,
    max_seq_length: int,
) -> dict[str, np.ndarray]:
    """input_ids/input_mask/segment_ids [N, L], labels [N] (int32 ids or float32 scores)."""
    specials = features.special_ids(tokenizer)
    rows = [
        features.encode_pair(
            tokenizer.encode(e.text_a),
            None if e.text_b is None else tokenizer.encode(e.text_b),
            max_seq_length,
            specials,
        )
        for e in examples
    ]
    input_ids, input_mask, segment_ids = (
        np.stack(column).reshape(len(examples), max_seq_length) for column in zip(*rows)
    )
    if task.is_regression:
        labels = np.array([e.label if e.label is not None else 0.0 for e in examples], np.float32)
    else:
        labels = np.array(
            [task.class_names.index(e.label) if e.label is not None else 0 for e in examples],
            np.int32,
        )
    return {
        "input_ids": input_ids,
        "input_mask": input_mask,
        "segment_ids": segment_ids,
        "labels": labels,
    }


def predictions_from_logits(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    """Label ids (classification) or scores (regression) from `[N, num_labels]` outputs."""
    return logits[:, 0] if task.is_regression else np.argmax(logits, axis=-1)


def evaluate(task: GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """The task's official metrics."""
    functions = {
        "accuracy": metrics.accuracy,
        "f1": metrics.binary_f1,
        "matthews_corrcoef": metrics.matthews_corrcoef,
        "pearson": metrics.pearson,
        "spearman": metrics.spearman,
    }
    return {name: functions[name](predictions, labels) for name in task.metric_names}


def write_submission(
    task: GlueTask,
    split_name: str,
    examples: Sequence[Example],
    predictions: np.ndarray,
    directory: str,
) -> str:
    """Writes the leaderboard file `<directory>/<TASK>.tsv` (`index<TAB>prediction`)."""
    path = os.path.join(directory, task.split(split_name).submission)
    files.makedirs(directory)
    with files.open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for example, prediction in zip(examples, predictions, strict=True):
            value = (
                f"{float(np.clip(prediction, 0.0, 5.0)):.3f}"
                if task.is_regression
                else task.class_names[int(prediction)]
            )
            f.write(f"{example.index}\t{value}\n")
    return path


# ----------------------------------------------------------------------------- fine-tuning


class GlueFinetune(features.Finetune[jax.Array, np.ndarray]):
    """Sentence(-pair) classification or regression on the pooled output."""

    def __init__(self, options: features.TaskOptions, tokenizer: tokenization.Tokenizer) -> None:
        self.options, self.tokenizer = options, tokenizer
        self.task = get_task(options.task)
        self.main_metric = self.task.metric_names[0]
        self.eval_splits, self.test_splits = self.task.eval_splits, self.task.test_splits

    def model(self, model_config: families.ModelConfig) -> nn.Module:
        return families.head("classification", model_config, self.task.num_labels, self.options)

    def load(self, split: str) -> features.SplitData:
        examples, skipped = read_examples(
            self.task, split, self.options.data_dir, self.options.tfds_data_dir
        )
        examples = features.subset(examples, self.options.max_train_examples, split)
        return features.SplitData(
            split,
            encode(self.task, examples, self.tokenizer, self.options.max_seq_length),
            examples,
            skipped,
        )

    def loss(self, logits: jax.Array, batch: dict[str, jax.Array]) -> losses.Loss:
        if self.task.is_regression:
            return losses.regression_loss(logits, batch["labels"], batch["weights"])
        return losses.classification_loss(logits, batch["labels"], batch["weights"])

    def evaluate(self, data: features.SplitData, logits: np.ndarray) -> dict[str, float]:
        return evaluate(
            self.task, predictions_from_logits(self.task, logits), data.features["labels"]
        )

    def baseline(
        self, train: features.SplitData, data: features.SplitData
    ) -> tuple[str, dict[str, float]]:
        """The majority class of `train` (classification) or its mean score (regression)."""
        labels = train.features["labels"]
        if self.task.is_regression:
            value = float(np.mean(labels))
            how, predictions = f"always {value:.3f}, the mean", np.full(len(data), value)
        else:
            majority = int(np.bincount(labels, minlength=self.task.num_labels).argmax())
            how = f"always {self.task.class_names[majority]!r}, the majority class"
            predictions = np.full(len(data), majority)
        return how, evaluate(self.task, predictions, data.features["labels"])

    def write_predictions(
        self, data: features.SplitData, logits: np.ndarray, directory: str
    ) -> str:
        return write_submission(
            self.task,
            data.name,
            data.examples,
            predictions_from_logits(self.task, logits),
            directory,
        )
