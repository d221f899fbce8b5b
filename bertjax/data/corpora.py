"""Corpus sources (`config.data.source`): each a `Source` registered here (`register`), found
by name (`get`). The built-in ones: "text" (`data.corpus`: text files), "tfds"
(`data.tfds_source`) and "default" (`data.default_corpus`: the embedded corpus). Shared code
(`corpus_source`, `shard_sources`) asks the source, it never branches on its name; a new
source is a module that registers one."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

from bertjax.data.errors import DataError

# The built-in sources, each registered by its module, in the order `names` lists them.
_BUILTIN = {
    "default": "bertjax.data.default_corpus",
    "text": "bertjax.data.corpus",
    "tfds": "bertjax.data.tfds_source",
}


@dataclasses.dataclass(frozen=True)
class Source:
    """One kind of corpus. Its functions are module-level (a source travels to the workers
    that prepare shards, pickled by reference). They are typed by their comments, not in
    terms of `DataSettings` and `corpus.CorpusStats`: the modules that define those import
    this one (a source registers itself), and no module imports one that imports it."""

    name: str  # `data.source`
    # (data settings) -> what its reader needs (picklable); DataError (one line naming the
    # --config.data field to set) where the settings lack it
    arguments: Callable[..., Any]
    # (arguments, process index, process count, stats, start) -> (position, document) of that
    # process's documents (document i goes to process i mod count), from the first (counted
    # into stats) or, not counted again, from `start` (a position it returned)
    documents: Callable[..., Iterator[tuple[Any, list[str]]]]
    # (data settings) -> what identifies the corpus (JSON values, in cache keys and checkpoints;
    # a "files" list of [path, bytes] also has its files' times in the cache key)
    identity: Callable[..., dict[str, Any]]


_SOURCES: dict[str, Source] = {}


def register(source: Source) -> Source:
    """Makes `source` known by its name (again: replaced)."""
    _SOURCES[source.name] = source
    return source


def names() -> tuple[str, ...]:
    """The registered sources' names, the built-in ones first ("default" first of all)."""
    for module in _BUILTIN.values():
        importlib.import_module(module)
    return (*_BUILTIN, *(name for name in _SOURCES if name not in _BUILTIN))


def get(name: str) -> Source:
    """The source registered as `name`; DataError (one line) if none is (a config or a
    record naming a source this process does not know)."""
    if name not in names():
        raise DataError(
            f"data.source={name!r} is not one of {', '.join(map(repr, names()))}: a source "
            "must be registered (bertjax.data.corpora.register) before its configs are read"
        )
    return _SOURCES[name]
