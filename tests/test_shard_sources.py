"""Shards as descriptors (bertjax.data.shard_sources): a shard's documents read from its
descriptor's position are exactly the documents a reading from the start gives, for every
source and text layout (lines, paragraphs, UTF-16, CR line ends, cut long lines, bad UTF-8),
and with several processes."""

import pytest

import tfds_fixture
from bertjax.data import corpora, corpus, shard_sources
from test_corpus import LINES_TEXT, PARAGRAPHS_TEXT, write


@pytest.fixture
def mixed_files(tmp_path):
    long_line = "A sentence that is far longer than the limit of this read. " * 3 + "\n\n"
    return tuple(
        write(tmp_path / name, data)
        for name, data in (
            ("a_lines.txt", LINES_TEXT * 3 + long_line + "\u00e9t\u00e9.\n\n" + LINES_TEXT),
            ("b_paragraphs.txt", PARAGRAPHS_TEXT * 4),
            ("c_utf16.txt", (LINES_TEXT * 2).replace("\n", "\r\n").encode("utf-16")),
            ("d_cr.txt", (LINES_TEXT * 2).replace("\n", "\r")),
            ("e_lines.txt", b"One.\n\nTwo \xff bytes.\n\n" + LINES_TEXT.encode()),
        )
    )


def test_every_position_reads_the_rest_of_the_corpus(mixed_files):
    stats = corpus.CorpusStats()
    full = list(corpus.positioned_documents(mixed_files, "auto", stats, max_line_chars=60))
    documents = [document for _, document in full]
    assert stats.documents == len(documents) > 30 and stats.truncated_long_lines >= 3
    assert stats.utf16_files == 1 and stats.invalid_utf8_lines == 1
    assert len({position[1] for position, _ in full}) == 5  # every file
    assert any(position[2] > 0 for position, _ in full)  # byte offsets
    assert any(position[3] > 0 for position, _ in full)  # documents skipped (UTF-16, CR)
    for i, (position, _) in enumerate(full):
        again = corpus.CorpusStats()
        rest = corpus.positioned_documents(mixed_files, "auto", again, 60, start=position)
        assert list(rest) == full[i:]
        assert again.documents == 0  # a reading from a position is not counted again


@pytest.mark.parametrize("process_count", [1, 3])
def test_shards_read_from_their_descriptors_are_the_cut_documents(mixed_files, process_count):
    for index in range(process_count):
        reader = shard_sources.CorpusReader(
            corpora.get("text"), (mixed_files, "auto"), index, process_count
        )
        documents = [document for _, document in reader.documents()]
        stats = corpus.CorpusStats()
        shards = list(shard_sources.cut(reader, stats, shard_bytes=150))
        assert len(shards) >= 4 and stats.documents == 31  # every process's, as read
        assert [s.index for s in shards] == list(range(len(shards)))
        read = [reader.read(shard) for shard in shards]
        assert [d for shard in read for d in shard] == documents
        sizes = [sum(map(shard_sources.document_bytes, shard)) for shard in read]
        assert all(size >= 150 for size in sizes[:-1])
        assert all(
            size - shard_sources.document_bytes(shard[-1]) < 150 for size, shard in zip(sizes, read)
        )


def test_tfds_and_default_sources_read_their_shards_by_position(tmp_path):
    name = tfds_fixture.prepare(str(tmp_path))
    readers = [
        shard_sources.CorpusReader(
            corpora.get("tfds"), (name, "train", str(tmp_path), "text"), 1, 2
        ),
        shard_sources.CorpusReader(corpora.get("default"), None, 1, 2),
    ]
    for reader, shard_bytes in zip(readers, (60, 200_000)):
        documents = [document for _, document in reader.documents()]
        shards = list(shard_sources.cut(reader, corpus.CorpusStats(), shard_bytes))
        assert len(shards) >= 2
        assert [d for shard in shards for d in reader.read(shard)] == documents
    everything = [d for _, d in shard_sources.CorpusReader(corpora.get("default")).documents()]
    assert documents == everything[1::2]
