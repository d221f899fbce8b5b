"""Shared input encoding for fine-tuning (run_classifier's convert_single_example) and the
bad-input counter every reader uses."""
from __future__ import annotations

import collections
from typing import Sequence

import numpy as np
from absl import logging

from bertjax.data import tokenization


class TaskDataError(ValueError):
    """Task data that cannot be read (missing file, no usable rows); the message says why."""


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


def special_ids(tokenizer: tokenization.Tokenizer) -> dict[str, int]:
    cls, sep, pad = tokenizer.convert_tokens_to_ids(
        [tokenization.CLS, tokenization.SEP, tokenization.PAD])
    return {"cls": cls, "sep": sep, "pad": pad}


def encode_pair(ids_a: list[int], ids_b: list[int] | None, max_seq_length: int,
                specials: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`[CLS] a [SEP] (b [SEP])`, truncated as the original, padded to `max_seq_length`.
    Returns `(input_ids, input_mask, segment_ids)`."""
    ids_a, ids_b = list(ids_a), list(ids_b) if ids_b is not None else None
    if ids_b is None:
        ids_a = ids_a[:max_seq_length - 2]
        ids_b = []
        tokens = [specials["cls"], *ids_a, specials["sep"]]
    else:
        truncate_pair(ids_a, ids_b, max_seq_length - 3)
        tokens = [specials["cls"], *ids_a, specials["sep"], *ids_b, specials["sep"]]
    segments = [0] * (len(ids_a) + 2) + [1] * (len(tokens) - len(ids_a) - 2)
    return pad_row(tokens, segments, max_seq_length, specials["pad"])


def pad_row(tokens: Sequence[int], segments: Sequence[int], max_seq_length: int,
            pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    padding = max_seq_length - len(tokens)
    input_ids = np.array(list(tokens) + [pad_id] * padding, np.int32)
    input_mask = np.array([1] * len(tokens) + [0] * padding, np.int32)
    segment_ids = np.array(list(segments) + [0] * padding, np.int32)
    return input_ids, input_mask, segment_ids
