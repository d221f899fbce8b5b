"""The GLUE tasks: the nine tasks and the AX diagnostic, each with its labels, official
metrics, text features and splits (where each split lives in the GLUE download's TSVs, in
tfds / Hugging Face, and its leaderboard file).

Labels and columns follow the original run_classifier processors (and jiant/GLUE for the
tasks it lacks).
"""

from __future__ import annotations

import dataclasses

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


def _pair_task(  # noqa: PLR0913, PLR0917 (one row of the GLUE task table)
    name: str,
    directory: str,
    labels: tuple[str, ...] | None,
    metric_names: tuple[str, ...],
    hf_keys: tuple[str, str | None],
    hf_labels: tuple[str, ...] | None,
    a: int,
    b: int | None,
    label: int,
    test_a: int | None = None,
    test_b: int | None = None,
    test_file: str = "test.tsv",
    submission: str | None = None,
) -> GlueTask:
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
