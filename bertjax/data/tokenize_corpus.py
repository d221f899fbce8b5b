"""Corpus tokenization for data preparation: token ids per sentence."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bertjax.data import tokenization

# Longer sentences (a huge line without punctuation) are cut: no sequence can hold more, and
# instance creation trims a pair one token at a time, so their full length would only cost time.
MAX_SENTENCE_TOKENS = 4096


def tokenize_documents(
    documents: Sequence[list[str]], tokenizer: tokenization.Tokenizer
) -> tuple[list[list[np.ndarray]], dict[str, int]]:
    """Token ids (int32 arrays, compact) per sentence; empty sentences and documents are
    dropped and counted, sentences over MAX_SENTENCE_TOKENS cut and counted."""
    tokenized = []
    counts = {"empty_sentences": 0, "empty_documents": 0, "long_sentences_cut": 0, "tokens": 0}
    for document in documents:
        sentences = [np.asarray(tokenizer.encode(sentence), np.int32) for sentence in document]
        kept = [ids[:MAX_SENTENCE_TOKENS] for ids in sentences if len(ids)]
        counts["long_sentences_cut"] += sum(len(ids) > MAX_SENTENCE_TOKENS for ids in sentences)
        counts["empty_sentences"] += len(sentences) - len(kept)
        counts["tokens"] += sum(len(ids) for ids in kept)
        if kept:
            tokenized.append(kept)
        else:
            counts["empty_documents"] += 1
    return tokenized, counts
