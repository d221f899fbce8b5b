"""Each shard's token ids kept on disk, so that the corpus is tokenized once per corpus and
tokenizer whatever the number of phases (configs/base.py has two): the first phase's worker
tokenizes a shard and stores its ids; every phase then reads them memory-mapped.

A shard's entry is a directory `shard_NNNNN` of three .npy files (the ids end to end in the
narrowest unsigned type of the vocabulary, where each sentence ends, where each document
ends, in sentences) and `counts.json` (what tokenizing dropped or cut), written under a
temporary name and renamed into place, so an entry is whole or absent. The directory that
holds the entries is named by a hash of everything the ids depend on (`pipeline.build`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import numpy as np

from bertjax.data import corpus, shard_format, tokenization, tokenize_corpus

VERSION = 1  # bump when the stored layout or what tokenizing drops changes
_ARRAYS = ("ids", "sentence_ends", "document_ends")

TokenizedShard = tuple[list[list[np.ndarray]], dict[str, int]]


def tokenized_shard(
    directory: str,
    index: int,
    read: Callable[[], list[corpus.Document]],
    tokenizer: tokenization.Tokenizer,
) -> TokenizedShard:
    """Shard `index`'s documents as token ids (views of memory-mapped files) and the counts of
    `tokenize_corpus.tokenize_documents`: from `directory` when stored there, else tokenized
    from `read()` and stored first ("": tokenized, not stored)."""
    if not directory:
        return tokenize_corpus.tokenize_documents(read(), tokenizer)
    path = os.path.join(directory, f"shard_{index:05d}")
    stored = _load(path)
    if stored is None:
        documents, counts = tokenize_corpus.tokenize_documents(read(), tokenizer)
        _store(path, documents, counts, tokenizer.vocab_size)
        del documents  # read back below: the ids then live in the page cache, not the heap
        stored = _load(path)
        if stored is None:
            raise OSError(f"the token ids just stored in {path} cannot be read back")
    return stored


def _store(
    path: str, documents: list[list[np.ndarray]], counts: dict[str, int], vocab_size: int
) -> None:
    sentences = [sentence for document in documents for sentence in document]
    ids_type = shard_format.stored_dtypes(1, 1, vocab_size)["input_ids"]
    arrays = {
        "ids": (np.concatenate(sentences) if sentences else np.zeros(0)).astype(ids_type),
        "sentence_ends": np.cumsum([len(sentence) for sentence in sentences], dtype=np.int64),
        "document_ends": np.cumsum([len(document) for document in documents], dtype=np.int64),
    }
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, array in arrays.items():
        np.save(os.path.join(tmp, name + ".npy"), array)
    with open(os.path.join(tmp, "counts.json"), "w") as f:
        json.dump(counts, f)
    shutil.rmtree(path, ignore_errors=True)  # a damaged entry
    try:
        os.rename(tmp, path)
    except OSError:  # another process stored the same entry first
        shutil.rmtree(tmp, ignore_errors=True)


def _load(path: str) -> TokenizedShard | None:
    """The entry at `path`, or None if it is absent or damaged."""
    try:
        with open(os.path.join(path, "counts.json")) as f:
            counts = json.load(f)
        ids, sentence_ends, document_ends = (
            np.load(os.path.join(path, name + ".npy"), mmap_mode="r") for name in _ARRAYS
        )
        sentence_ends, document_ends = np.array(sentence_ends), np.array(document_ends)
    except (OSError, ValueError):
        return None
    whole = (
        len(sentence_ends) == (document_ends[-1] if len(document_ends) else 0)
        and (sentence_ends[-1] if len(sentence_ends) else 0) == len(ids)
        and (np.diff(sentence_ends, prepend=0) > 0).all()
        and (np.diff(document_ends, prepend=0) > 0).all()
    )
    if not whole:
        return None
    sentences = np.split(np.asarray(ids), sentence_ends[:-1]) if len(sentence_ends) else []
    starts = np.concatenate([[0], document_ends[:-1]]).tolist()
    return [sentences[a:b] for a, b in zip(starts, document_ends.tolist())], counts
