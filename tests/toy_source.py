"""A corpus source defined here in tests/ only: "jsonl", JSON Lines files (`data.input_files`)
whose lines are `{"text": ...}` documents, one sentence per line of the text. It plugs into
bertjax through `corpora.register` alone (the test registers it), to show that shared code
needs no edit for a new source."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

from bertjax.data import corpora, corpus
from bertjax.data.errors import DataError
from bertjax.data.settings import DataSettings
from bertjax.runtime import files


def arguments(data: DataSettings) -> tuple[str, ...]:
    """The files (globs expanded)."""
    if not data.input_files:
        raise DataError("data.source=jsonl needs --config.data.input_files=PATH")
    return tuple(corpus.expand_paths(data.input_files.split(",")))


def _file_documents(path: str) -> Iterator[corpus.Document]:
    with files.open(path, "r") as f:
        for line in f:
            document = [s.strip() for s in json.loads(line)["text"].splitlines() if s.strip()]
            if document:
                yield document


def documents(
    paths: tuple[str, ...],
    index: int,
    count: int,
    stats: corpus.CorpusStats | None,
    start: int | None,
) -> Iterator[tuple[int, corpus.Document]]:
    """`(document number, document)`, this process's (number mod count), from `start`."""
    every = (
        corpus.counted(path, _file_documents(path), corpus.CorpusStats(files=1), stats)
        if start is None and stats is not None
        else _file_documents(path)
        for path in paths
    )
    numbered = itertools.islice(enumerate(itertools.chain.from_iterable(every)), start, None)
    return ((n, document) for n, document in numbered if n % count == index)


def identity(data: DataSettings) -> dict[str, Any]:
    """The files with their sizes (so their times join the cache key), and the format."""
    return {
        "files": [(files.abspath(f), files.getsize(f)) for f in arguments(data)],
        "format": "jsonl",
    }


SOURCE = corpora.Source("jsonl", arguments, documents, identity)
