"""GLUE: the nine tasks and the AX diagnostic; readers for the GLUE download layout (TSV),
Hugging Face parquet files and tfds `glue/...`; official metrics; leaderboard submissions.

Labels and columns follow the original run_classifier processors (and jiant/GLUE for the
tasks it lacks); test predictions are written as the leaderboard's `<TASK>.tsv` files with an
`index<TAB>prediction` header.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import numpy as np
from absl import logging

from bertjax.data import tfds_source, tokenization
from bertjax.models import families
from bertjax.runtime import files
from bertjax.tasks import features, metrics
from bertjax.training import objectives

BINARY = ("0", "1")
NLI_2 = ("entailment", "not_entailment")


@dataclasses.dataclass(frozen=True)
class Split:
    """One split of a task: where it lives in each source and its leaderboard file."""

    name: str  # train, dev, dev_matched, test, test_matched, ax, ...
    tsv: tuple[tuple[str, ...], ...]  # alternatives, each a tuple of files read in order
    hf: str  # tfds split / parquet file stem
    text_a: int  # TSV column of the first text
    text_b: int | None  # TSV column of the second text (None: single sentence)
    label: int | None = None  # TSV column of the label; None for test splits
    header: bool = True  # TSV has a header row
    submission: str = ""  # leaderboard file for test splits
    tfds_name: str = ""  # tfds dataset if not the task's (AX)


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str
    directory: str  # folder in the GLUE download
    labels: tuple[str, ...] | None  # None: regression
    metric_names: tuple[str, ...]  # the first one selects the best checkpoint
    hf_keys: tuple[str, str | None]  # tfds / parquet text features
    hf_labels: tuple[str, ...] | None  # label names in tfds / HF integer order
    splits: tuple[Split, ...]

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def class_names(self) -> tuple[str, ...]:
        """`labels` of a classification task (a regression task has none)."""
        if self.labels is None:
            raise ValueError(f"{self.name} is a regression task: it has no class labels")
        return self.labels

    def split(self, name: str) -> Split:
        for split in self.splits:
            if split.name == name:
                return split
        raise KeyError(
            f"task {self.name} has no split {name!r}; it has {[s.name for s in self.splits]}"
        )

    @property
    def eval_splits(self) -> list[str]:
        return [s.name for s in self.splits if s.name.startswith("dev")]

    @property
    def test_splits(self) -> list[str]:
        return [s.name for s in self.splits if s.submission]


def _pair_task(
    name,
    directory,
    labels,
    metric_names,
    hf_keys,
    hf_labels,
    a,
    b,
    label,
    test_a=None,
    test_b=None,
    test_file="test.tsv",
    submission=None,
):
    test_a = a if test_a is None else test_a
    test_b = b if test_b is None else test_b
    return GlueTask(
        name,
        directory,
        labels,
        metric_names,
        hf_keys,
        hf_labels,
        (
            Split("train", (("train.tsv",),), "train", a, b, label),
            Split("dev", (("dev.tsv",),), "validation", a, b, label),
            Split(
                "test",
                ((test_file,),),
                "test",
                test_a,
                test_b,
                submission=submission or f"{directory}.tsv",
            ),
        ),
    )


_AX = Split(
    "ax",
    (("AX.tsv",), ("diagnostic.tsv",), ("../diagnostic/diagnostic.tsv",)),
    "test",
    1,
    2,
    submission="AX.tsv",
    tfds_name="glue/ax",
)

TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        GlueTask(
            "cola",
            "CoLA",
            BINARY,
            ("matthews_corrcoef", "accuracy"),
            ("sentence", None),
            None,
            (
                Split(
                    "train",
                    (
                        ("train.tsv",),
                        ("cola_public/raw/in_domain_train.tsv",),
                        ("raw/in_domain_train.tsv",),
                    ),
                    "train",
                    3,
                    None,
                    1,
                    header=False,
                ),
                Split(
                    "dev",
                    (
                        ("dev.tsv",),
                        (
                            "cola_public/raw/in_domain_dev.tsv",
                            "cola_public/raw/out_of_domain_dev.tsv",
                        ),
                        ("raw/in_domain_dev.tsv", "raw/out_of_domain_dev.tsv"),
                    ),
                    "validation",
                    3,
                    None,
                    1,
                    header=False,
                ),
                Split("test", (("test.tsv",),), "test", 1, None, submission="CoLA.tsv"),
            ),
        ),
        GlueTask(
            "sst2",
            "SST-2",
            BINARY,
            ("accuracy",),
            ("sentence", None),
            None,
            (
                Split("train", (("train.tsv",),), "train", 0, None, 1),
                Split("dev", (("dev.tsv",),), "validation", 0, None, 1),
                Split("test", (("test.tsv",),), "test", 1, None, submission="SST-2.tsv"),
            ),
        ),
        _pair_task(
            "mrpc", "MRPC", BINARY, ("f1", "accuracy"), ("sentence1", "sentence2"), None, 3, 4, 0
        ),
        _pair_task(
            "stsb",
            "STS-B",
            None,
            ("pearson", "spearman"),
            ("sentence1", "sentence2"),
            None,
            7,
            8,
            9,
        ),
        _pair_task(
            "qqp",
            "QQP",
            BINARY,
            ("f1", "accuracy"),
            ("question1", "question2"),
            None,
            3,
            4,
            5,
            test_a=1,
            test_b=2,
        ),
        GlueTask(
            "mnli",
            "MNLI",
            ("contradiction", "entailment", "neutral"),
            ("accuracy",),
            ("premise", "hypothesis"),
            ("entailment", "neutral", "contradiction"),
            (
                Split("train", (("train.tsv",),), "train", 8, 9, -1),
                Split("dev_matched", (("dev_matched.tsv",),), "validation_matched", 8, 9, -1),
                Split(
                    "dev_mismatched", (("dev_mismatched.tsv",),), "validation_mismatched", 8, 9, -1
                ),
                Split(
                    "test_matched",
                    (("test_matched.tsv",),),
                    "test_matched",
                    8,
                    9,
                    submission="MNLI-m.tsv",
                ),
                Split(
                    "test_mismatched",
                    (("test_mismatched.tsv",),),
                    "test_mismatched",
                    8,
                    9,
                    submission="MNLI-mm.tsv",
                ),
                _AX,
            ),
        ),
        _pair_task("qnli", "QNLI", NLI_2, ("accuracy",), ("question", "sentence"), NLI_2, 1, 2, 3),
        _pair_task("rte", "RTE", NLI_2, ("accuracy",), ("sentence1", "sentence2"), NLI_2, 1, 2, 3),
        _pair_task(
            "wnli", "WNLI", BINARY, ("accuracy",), ("sentence1", "sentence2"), None, 1, 2, 3
        ),
    )
}
ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "ax": "mnli"}


def get_task(name: str) -> GlueTask:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in TASKS:
        raise ValueError(
            f"unknown GLUE task {name!r}; choose one of {sorted(TASKS)} "
            "(AX is predicted by the mnli task)"
        )
    return TASKS[key]


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


class GlueFinetune(features.Finetune):
    """Sentence(-pair) classification or regression on the pooled output."""

    def __init__(self, options: features.TaskOptions, tokenizer: tokenization.Tokenizer):
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

    def loss(self, logits, batch):
        if self.task.is_regression:
            return objectives.regression_loss(logits, batch["labels"], batch["weights"])
        return objectives.classification_loss(logits, batch["labels"], batch["weights"])

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
