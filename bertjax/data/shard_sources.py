"""Shards as descriptors: where a shard's first document is in the corpus and how many
documents it holds. The process that cuts the corpus into shards of `data.shard_bytes` reads it
once, one document at a time, and keeps only these; the process that prepares a shard (a local
worker or a Beam worker) reads the shard's documents itself from that position: a byte offset
in a text file, a record index in a tfds dataset, a document number in the default corpus:
whatever its source's reader returned."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

from bertjax.data import corpora, corpus


@dataclasses.dataclass(frozen=True)
class ShardSource:
    """One shard: its index, its first document's position and its number of documents."""

    index: int
    start: Any
    documents: int


@dataclasses.dataclass(frozen=True)
class CorpusReader:
    """Process `process_index` of `process_count`'s documents of one corpus: those of `source`
    (a registered `corpora.Source`) read with its `arguments` (document i goes to process i mod
    P)."""

    source: corpora.Source
    arguments: Any = None
    process_index: int = 0
    process_count: int = 1

    def documents(
        self, stats: corpus.CorpusStats | None = None, start: Any = None
    ) -> Iterator[tuple[Any, corpus.Document]]:
        """`(position, document)` of this process's documents, from the first (counted into
        `stats`) or, not counted again, from `start` (a position this returned)."""
        return self.source.documents(
            self.arguments, self.process_index, self.process_count, stats, start
        )

    def read(self, shard: ShardSource) -> list[corpus.Document]:
        """The documents of `shard`."""
        return [
            document
            for _, document in itertools.islice(self.documents(start=shard.start), shard.documents)
        ]


def document_bytes(document: corpus.Document) -> int:
    """A document's size as shards count it: UTF-8 bytes of its sentences, one per line."""
    return sum(len(sentence.encode()) + 1 for sentence in document)


def cut(reader: CorpusReader, stats: corpus.CorpusStats, shard_bytes: int) -> Iterator[ShardSource]:
    """This process's documents cut into shards of about `shard_bytes` bytes of text (counted
    into `stats`): a shard ends after the document that reaches the size, so documents never
    span shards."""
    index, start, documents, size = 0, None, 0, 0
    for position, document in reader.documents(stats):
        start = position if not documents else start
        documents, size = documents + 1, size + document_bytes(document)
        if size >= shard_bytes:
            yield ShardSource(index, start, documents)
            index, documents, size = index + 1, 0, 0
    if documents:
        yield ShardSource(index, start, documents)
