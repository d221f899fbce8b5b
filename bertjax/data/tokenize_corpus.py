"""Corpus tokenization for data preparation: token ids per sentence, in worker processes."""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from typing import Any, Sequence

import numpy as np

from bertjax.data import tokenization


_worker_tokenizer: tokenization.Tokenizer | None = None


def _start_worker(tokenizer: tokenization.Tokenizer, in_pool: bool = False) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer
    if in_pool:  # Ctrl-C is the main process's to handle (workers would print tracebacks)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_document(document: list[str]) -> list[np.ndarray]:
    """Token ids of each sentence, in a tokenizing worker process."""
    return [np.asarray(_worker_tokenizer.encode(sentence), np.int32) for sentence in document]


@contextlib.contextmanager
def tokenizing_pool(tokenizer: tokenization.Tokenizer, num_workers: int):
    """Worker processes that tokenize documents (None for one process). `spawn`, since forking
    a process that may already run JAX's threads can deadlock."""
    num_workers = num_workers or os.cpu_count() or 1
    if num_workers <= 1:
        yield None
        return
    with multiprocessing.get_context("spawn").Pool(
            num_workers, initializer=_start_worker, initargs=(tokenizer, True)) as pool:
        yield pool


# Longer sentences (a huge line without punctuation) are cut: no sequence can hold more, and
# instance creation trims a pair one token at a time, so their full length would only cost time.
MAX_SENTENCE_TOKENS = 4096


def tokenize_documents(documents: Sequence[list[str]], tokenizer: tokenization.Tokenizer,
                       pool: Any = None) -> tuple[list[list[np.ndarray]], dict[str, int]]:
    """Token ids (int32 arrays, compact) per sentence, tokenized in `pool` if given; empty
    sentences and documents are dropped and counted, sentences over MAX_SENTENCE_TOKENS cut
    and counted."""
    if pool is None:
        _start_worker(tokenizer)
        encoded = map(_encode_document, documents)
    else:
        # Small chunks when documents are few (e.g. whole books), larger ones to save IPC.
        encoded = pool.imap(_encode_document, documents,
                            chunksize=max(1, min(64, len(documents) // 32)))
    tokenized = []
    counts = {"empty_sentences": 0, "empty_documents": 0, "long_sentences_cut": 0, "tokens": 0}
    for sentences in encoded:
        kept = [ids[:MAX_SENTENCE_TOKENS] for ids in sentences if len(ids)]
        counts["long_sentences_cut"] += sum(len(ids) > MAX_SENTENCE_TOKENS for ids in sentences)
        counts["empty_sentences"] += len(sentences) - len(kept)
        counts["tokens"] += sum(len(ids) for ids in kept)
        if kept:
            tokenized.append(kept)
        else:
            counts["empty_documents"] += 1
    return tokenized, counts
