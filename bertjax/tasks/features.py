"""What every task shares: input encoding (run_classifier's convert_single_example), the
bad-input counter every reader uses, and the fine-tuning adapter interface (`Finetune`,
`SplitData`, `TaskOptions`) that each task module implements."""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
from absl import logging

from bertjax.data import tokenization
from bertjax.errors import UserError

if TYPE_CHECKING:  # (the model modules: only for the adapter's annotations)
    import flax.linen as nn
    import jax

    from bertjax.models.families import ModelConfig
    from bertjax.models.layers.losses import Loss


class TaskDataError(UserError, ValueError):
    """Task data that cannot be read (missing file, no usable rows); the message says why."""


@contextlib.contextmanager
def decoding(path: str) -> Iterator[None]:
    """Names `path` when reading it in the block meets bytes that are not UTF-8."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise TaskDataError(
            f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); convert it "
            "to UTF-8 or replace it"
        ) from None


class SkipCounter(collections.Counter):
    """Counts skipped inputs by reason; `report` logs them and returns a plain dict."""

    def report(self, where: str) -> dict[str, int]:
        if self:
            logging.warning("%s: skipped %s", where, dict(self))
        return dict(self)


def truncate_pair(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """The original `_truncate_seq_pair`: pop from the end of the longer list until they fit."""
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


def word_tokenizer(tokenizer: tokenization.Tokenizer, ids: bool = False) -> Callable[[str], list]:
    """How a word tokenized alone (CoNLL's, a SQuAD context's) is split: as the tokenizer
    splits it inside running text (a BPE tokenizer.json's pieces after a space,
    `bpe.BpeTokenizer.tokenize_word`), else as text of its own. `ids`: ids, not pieces."""
    if ids:
        return getattr(tokenizer, "encode_word", tokenizer.encode)
    return getattr(tokenizer, "tokenize_word", tokenizer.tokenize)


def special_ids(tokenizer: tokenization.Tokenizer) -> dict[str, int]:
    cls, sep, pad = tokenizer.convert_tokens_to_ids(
        [tokenization.CLS, tokenization.SEP, tokenization.PAD]
    )
    return {"cls": cls, "sep": sep, "pad": pad}


def encode_pair(
    ids_a: list[int], ids_b: list[int] | None, max_seq_length: int, specials: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[CLS] a [SEP] (b [SEP])`, truncated as the original, padded to `max_seq_length`.
    Returns `(input_ids, input_mask, segment_ids)`."""
    ids_a, ids_b = list(ids_a), list(ids_b) if ids_b is not None else None
    if ids_b is None:
        ids_a = ids_a[: max_seq_length - 2]
        ids_b = []
        tokens = [specials["cls"], *ids_a, specials["sep"]]
    else:
        truncate_pair(ids_a, ids_b, max_seq_length - 3)
        tokens = [specials["cls"], *ids_a, specials["sep"], *ids_b, specials["sep"]]
    segments = [0] * (len(ids_a) + 2) + [1] * (len(tokens) - len(ids_a) - 2)
    return pad_row(tokens, segments, max_seq_length, specials["pad"])


def pad_row(
    tokens: Sequence[int], segments: Sequence[int], max_seq_length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    padding = max_seq_length - len(tokens)
    input_ids = np.array(list(tokens) + [pad_id] * padding, np.int32)
    input_mask = np.array([1] * len(tokens) + [0] * padding, np.int32)
    segment_ids = np.array(list(segments) + [0] * padding, np.int32)
    return input_ids, input_mask, segment_ids


# ----------------------------------------------------------------------------- adapters


@dataclasses.dataclass(frozen=True)
class TaskOptions:
    """The fine-tuning config fields that tasks read (configs/finetune/*.py)."""

    task: str = ""  # GLUE task name (cola, sst2, mrpc, ...)
    data_dir: str = ""  # task data on disk; empty = tfds
    tfds_data_dir: str = ""
    max_seq_length: int = 128
    max_train_examples: int = 0  # random subset of the training set; 0 = all
    do_lower_case: bool = True
    feature_based: bool = False  # NER: frozen encoder, BiLSTM tagger on its last 4 layers
    lstm_size: int = 768
    causal_attention: bool = False  # left-to-right encoder (a train.objective=ltr model)
    train_file: str = ""  # SQuAD: official JSON path or tfds:NAME:SPLIT
    predict_file: str = ""
    version_2_with_negative: bool = False
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    null_score_diff_threshold: float = 0.0


@dataclasses.dataclass
class SplitData:
    """One split, encoded: `features` [N, ...] arrays (model inputs and targets) and whatever
    the task needs to score or write predictions (`examples`)."""

    name: str
    features: dict[str, np.ndarray]
    examples: Any
    skipped: dict[str, int]

    def __len__(self) -> int:
        return len(self.features["input_ids"])


def subset(items: list, limit: int, split: str) -> list:
    """A fixed random subset of `limit` training items (max_train_examples; all when 0)."""
    if split != "train" or not limit or len(items) <= limit:
        return items
    keep = np.sort(np.random.default_rng(0).permutation(len(items))[:limit])
    logging.info("Using %d of %d training examples (max_train_examples)", limit, len(items))
    return [items[i] for i in keep]


Outputs = TypeVar("Outputs")  # a batch's model outputs: logits, or (start, end) logits
Fetched = TypeVar("Fetched")  # `outputs` over a split, fetched (numpy)


class Finetune(abc.ABC, Generic[Outputs, Fetched]):
    """What the fine-tuning driver (and the probes) need from a task, its adapter. A task
    sets `main_metric`, `eval_splits` and `test_splits` (on the class or in `__init__`) and
    provides the abstract methods: the model head, loading a split, the loss, scoring and
    writing predictions; the others have defaults it may override."""

    main_metric: str  # the metric that picks the best checkpoint
    eval_splits: list[str]  # scored every epoch; the first one picks the best checkpoint
    test_splits: list[str]  # predicted (and written) with the best checkpoint
    scored_test_splits: list[str] = []  # test splits with labels, also scored  # noqa: RUF012
    frozen_encoder = False  # train only the head (feature-based)
    # Metrics in percent (0-100), as the task's official scorer reports them; others are
    # fractions (0-1), as GLUE's scorers and conlleval's counts give them.
    percent_metrics: frozenset[str] = frozenset()

    @abc.abstractmethod
    def model(self, model_config: ModelConfig) -> nn.Module:
        """The encoder with this task's head, for `model_config`'s family (`families.head`)."""

    @abc.abstractmethod
    def load(self, split: str) -> SplitData:
        """The split `split` read and encoded; TaskDataError (or a reader's ValueError)
        naming the file and what is wrong."""

    @abc.abstractmethod
    def loss(self, logits: Outputs, batch: dict[str, jax.Array]) -> Loss:
        """The training loss (a scalar: the weighted mean) of the model's `logits` on
        `batch`, inside jit."""

    @abc.abstractmethod
    def evaluate(self, data: SplitData, outputs: Fetched) -> dict[str, float]:
        """The task's metrics on `data` from the fetched `outputs(model outputs)`."""

    @abc.abstractmethod
    def write_predictions(self, data: SplitData, outputs: Fetched, directory: str) -> str:
        """Writes the predictions on `data` into `directory` in the task's format; returns
        the path written."""

    def num_train_examples(self, train: SplitData) -> int:
        """What the step count counts: examples, one row each (as run_classifier.py)."""
        return len(train)

    def outputs(self, model_outputs: Outputs) -> Outputs:
        """Reduces the model outputs on device before they are fetched (default: as is)."""
        return model_outputs

    def baseline(self, train: SplitData, data: SplitData) -> tuple[str, dict[str, float]] | None:
        """How a model that ignores its input would predict `data` (learned from `train`) and
        its metrics there; None when the task has no such baseline."""
        return None
