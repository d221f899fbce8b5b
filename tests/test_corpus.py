"""Tests for bertjax.data.corpus: text files, tfds, sentence splitting (data.sentences), default corpus."""

import codecs
import os
import pathlib
import random
import shutil
import tempfile

import pytest

import tfds_fixture  # tests/ is on sys.path under pytest's default import mode.
from bertjax.data import corpus, default_corpus, sentences, tfds_source


def write(path, data: bytes | str):
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


LINES_TEXT = (
    "The first document starts here.\n"
    "It has a second sentence.\n"
    "\n"
    "\n"
    "The second document is short.\n"
    "\n"
    "A third document.\n"
    "With two lines.\n"
)

PARAGRAPHS_TEXT = (
    "This paragraph is wrapped over several lines, like plain text in a book. It\n"
    "contains more than one sentence. Mr. Smith wrote it in the U.S. on a\n"
    "rainy day.\n"
    "\n"
    "A second paragraph ends the first document. See you soon!\n"
    "\f\n"
    "Another document starts after the form feed. It is brief.\n"
)


def test_lines_format_splits_documents_at_blank_lines(tmp_path):
    stats = corpus.CorpusStats()
    docs = list(corpus.read_text_files([write(tmp_path / "a.txt", LINES_TEXT)], "lines", stats))
    assert docs == [
        ["The first document starts here.", "It has a second sentence."],
        ["The second document is short."],
        ["A third document.", "With two lines."],
    ]
    assert (stats.files, stats.documents, stats.sentences) == (1, 3, 5)


def test_documents_do_not_span_files(tmp_path):
    paths = [write(tmp_path / "a.txt", "One.\nTwo."), write(tmp_path / "b.txt", "Three.\n")]
    assert list(corpus.read_text_files(paths, "lines")) == [["One.", "Two."], ["Three."]]


def test_paragraphs_format(tmp_path):
    path = write(tmp_path / "book.txt", PARAGRAPHS_TEXT)
    docs = list(corpus.read_text_files([path], "paragraphs"))
    assert docs == [
        [
            "This paragraph is wrapped over several lines, like plain text in a book.",
            "It contains more than one sentence.",
            "Mr. Smith wrote it in the U.S. on a rainy day.",
            "A second paragraph ends the first document.",
            "See you soon!",
        ],
        ["Another document starts after the form feed.", "It is brief."],
    ]


def test_auto_detects_each_file_format(tmp_path):
    lines_path = write(tmp_path / "lines.txt", LINES_TEXT)
    paragraphs_path = write(tmp_path / "paragraphs.txt", PARAGRAPHS_TEXT)
    one_paragraph_per_line = write(
        tmp_path / "wiki.txt", "Long line one. It has sentences. Many of them.\n" * 5
    )
    assert corpus.detect_text_format(lines_path) == "lines"
    assert corpus.detect_text_format(paragraphs_path) == "paragraphs"
    assert corpus.detect_text_format(one_paragraph_per_line) == "paragraphs"
    auto = list(corpus.read_text_files([lines_path, paragraphs_path]))
    explicit = list(corpus.read_text_files([lines_path], "lines")) + list(
        corpus.read_text_files([paragraphs_path], "paragraphs")
    )
    assert auto == explicit


def test_crlf_line_endings(tmp_path):
    path = write(tmp_path / "crlf.txt", LINES_TEXT.replace("\n", "\r\n"))
    crlf_docs = list(corpus.read_text_files([path], "auto"))
    assert crlf_docs == list(corpus.read_text_files([write(tmp_path / "lf.txt", LINES_TEXT)]))
    assert all("\r" not in sentence for doc in crlf_docs for sentence in doc)


def test_cr_only_line_endings_read_as_lines(tmp_path):
    """Old-Mac line endings (CR alone): every line and document of the LF original, none cut
    at max_line_chars (read as one line, the file was truncated there)."""
    text = LINES_TEXT * 20
    stats = corpus.CorpusStats()
    cr_docs = list(
        corpus.read_text_files(
            [write(tmp_path / "cr.txt", text.replace("\n", "\r"))],
            "auto",
            stats,
            max_line_chars=200,
        )
    )
    assert cr_docs == list(
        corpus.read_text_files([write(tmp_path / "lf.txt", text)], "auto", max_line_chars=200)
    )
    assert len(text) > 200 and stats.truncated_long_lines == 0


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    data = b"Good line.\nBad \xff\xfe bytes here.\nAlso \xc3 bad.\n\nCaf\xc3\xa9 is fine.\n"
    stats = corpus.CorpusStats()
    docs = list(corpus.read_text_files([write(tmp_path / "bad.txt", data)], "lines", stats))
    assert docs == [
        ["Good line.", "Bad \ufffd\ufffd bytes here.", "Also \ufffd bad."],
        ["Caf\u00e9 is fine."],
    ]
    assert stats.invalid_utf8_lines == 2


def test_empty_file_is_counted(tmp_path):
    stats = corpus.CorpusStats()
    paths = [write(tmp_path / "empty.txt", b""), write(tmp_path / "one.txt", "Hello there.\n")]
    assert list(corpus.read_text_files(paths, stats=stats)) == [["Hello there."]]
    assert (stats.files, stats.empty_files, stats.documents) == (2, 1, 1)
    assert "1 empty" in stats.summary()


def test_long_line_is_truncated_and_counted(tmp_path):
    data = b"Before.\n" + b"x" * 2_000_000 + b"\nAfter.\n"
    stats = corpus.CorpusStats()
    path = write(tmp_path / "long.txt", data)
    docs = list(corpus.read_text_files([path], "lines", stats, max_line_chars=100_000))
    assert docs == [["Before.", "x" * 100_000, "After."]]
    assert stats.truncated_long_lines == 1


def test_truncation_inside_multibyte_character_is_not_invalid_utf8(tmp_path):
    stats = corpus.CorpusStats()
    path = write(tmp_path / "euro.txt", "\u20ac" * 50 + "\n")  # 3 bytes per character.
    docs = list(corpus.read_text_files([path], "lines", stats, max_line_chars=10))
    assert docs == [["\u20ac" * 10]]
    assert (stats.truncated_long_lines, stats.invalid_utf8_lines) == (1, 0)


def test_utf16_file_reads_like_its_utf8_original(tmp_path):
    text = LINES_TEXT.replace("first", "f\u00efrst \u4e2d\u6587").replace("\n", "\r\n")
    stats = corpus.CorpusStats()
    utf16 = list(
        corpus.read_text_files(
            [
                write(tmp_path / "le.txt", text.encode("utf-16")),
                write(tmp_path / "be.txt", codecs.BOM_UTF16_BE + text.encode("utf-16-be")),
            ],
            "auto",
            stats,
            max_line_chars=20,
        )
    )
    utf8 = list(
        corpus.read_text_files([write(tmp_path / "u8.txt", text)], "auto", max_line_chars=20)
    )
    assert utf16 == utf8 + utf8 and "f\u00efrst \u4e2d\u6587" in utf16[0][0]
    assert (stats.utf16_files, stats.truncated_long_lines, stats.invalid_utf8_lines) == (2, 6, 0)


def test_binary_file_is_skipped_and_counted_but_stray_control_bytes_are_not(tmp_path):
    rng = random.Random(0)
    stats = corpus.CorpusStats()
    paths = [
        write(tmp_path / "model.bin", bytes(rng.randrange(256) for _ in range(50_000))),
        write(tmp_path / "zeros.bin", bytes(4096)),
        write(tmp_path / "text.txt", LINES_TEXT.replace(" a ", " a\x00\x07 ")),
    ]
    docs = list(corpus.read_text_files(paths, "lines", stats))
    assert len(docs) == 3 and docs[2] == ["A third document.", "With two lines."]
    assert (stats.files, stats.skipped_binary_files, stats.documents) == (3, 2, 3)
    assert "2 binary files skipped" in stats.summary()


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        corpus.read_text_files([missing])


def test_glob_is_expanded_sorted_and_must_match(tmp_path):
    write(tmp_path / "b.txt", "Second file.\n")
    write(tmp_path / "a.txt", "First file.\n")
    docs = list(corpus.read_text_files([str(tmp_path / "*.txt")]))
    assert docs == [["First file."], ["Second file."]]
    with pytest.raises(FileNotFoundError, match="matches no files"):
        corpus.read_text_files([str(tmp_path / "*.json")])


def test_directories_and_unreadable_files_are_named(tmp_path):
    """A directory given or matched as an input file, and a file this user cannot read, are
    refused by name (as root, read as the user `nobody`, to whom permissions apply)."""
    (tmp_path / "sub.txt").mkdir()
    write(tmp_path / "a.txt", "First file.\n")
    for inputs in ([str(tmp_path)], [str(tmp_path / "*.txt")]):
        with pytest.raises(IsADirectoryError, match="is a directory; pass its files"):
            corpus.read_text_files(inputs)
    directory = tempfile.mkdtemp(dir="/tmp")  # (pytest's directories are closed to others)
    os.chmod(directory, 0o755)
    locked = os.path.join(directory, "corpus.txt")
    write(pathlib.Path(locked), "Private.\n")
    os.chmod(locked, 0)
    as_nobody = os.geteuid() == 0
    try:
        if as_nobody:
            os.seteuid(65534)
        with pytest.raises(PermissionError, match=f"input file '{locked}' is not readable"):
            corpus.read_text_files([locked])
    finally:
        if as_nobody:
            os.seteuid(0)
        shutil.rmtree(directory)


def test_bad_text_format_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="text_format"):
        corpus.read_text_files([write(tmp_path / "a.txt", "Hi.\n")], "markdown")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Hello world. How are you? Fine!", ["Hello world.", "How are you?", "Fine!"]),
        ("Mr. Smith met Dr. Jones at St. Paul's.", ["Mr. Smith met Dr. Jones at St. Paul's."]),
        ("Use e.g. C or i.e. Java. Then stop.", ["Use e.g. C or i.e. Java.", "Then stop."]),
        ("Apples, pears, etc. Were sold.", ["Apples, pears, etc. Were sold."]),
        ("J. R. R. Tolkien wrote it. It is long.", ["J. R. R. Tolkien wrote it.", "It is long."]),
        ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
        ("It ended (finally.) Next one.", ["It ended (finally.)", "Next one."]),
        ('Pi is 3.14 here. "Quoted" starts next.', ["Pi is 3.14 here.", '"Quoted" starts next.']),
        ("In 1999. 2000 came next.", ["In 1999.", "2000 came next."]),
        ("lowercase. after a period stays.", ["lowercase. after a period stays."]),
        ("Wait... What happened?", ["Wait...", "What happened?"]),
        ("  ", []),
    ],
)
def test_split_sentences(text, expected):
    assert sentences.split_sentences(text) == expected


def test_tfds_array_record_slices_partition_records(tmp_path):
    name = tfds_fixture.prepare(str(tmp_path))
    stats = corpus.CorpusStats()
    slices = [
        list(
            tfds_source.read_tfds(
                name, data_dir=str(tmp_path), process_index=i, process_count=2, stats=stats
            )
        )
        for i in range(2)
    ]
    expected = {
        (f"Record {i} begins here.", "It has a second sentence.", f"A new paragraph {i} follows.")
        for i in range(tfds_fixture.NUM_TEXT_RECORDS)
    }
    got = [tuple(doc) for part in slices for doc in part]
    assert len(got) == len(set(got)) == tfds_fixture.NUM_TEXT_RECORDS
    assert set(got) == expected
    assert min(len(part) for part in slices) >= 4  # Both processes got a share.
    assert (stats.documents, stats.skipped_empty_documents) == (10, 1)


def test_tfds_errors_are_actionable(tmp_path):
    with pytest.raises(FileNotFoundError, match="file_format=array_record"):
        tfds_source.read_tfds("bertjax_tiny_text", data_dir=str(tmp_path / "unprepared"))
    name = tfds_fixture.prepare(str(tmp_path / "prepared"))
    with pytest.raises(KeyError, match="available keys: \\['text'\\]"):
        tfds_source.read_tfds(name, data_dir=str(tmp_path / "prepared"), text_key="content")


@pytest.fixture(scope="module")
def default_docs():
    return list(default_corpus.default_corpus())


def test_default_corpus_is_large_english_and_clean(default_docs):
    text = "\n".join(sentence for doc in default_docs for sentence in doc)
    assert len(text.encode("utf-8")) >= 1_000_000
    visible = text.replace(" ", "").replace("\n", "")
    assert sum(c.isalpha() for c in visible) / len(visible) > 0.85
    assert all(doc and all(s and s == s.strip() for s in doc) for doc in default_docs)
    assert not any(s.startswith(">>>") for doc in default_docs for s in doc)
    assert sum(len(doc) >= 2 for doc in default_docs) > 1000  # Enough for next-sentence pairs.


def test_default_corpus_is_deterministic(default_docs):
    assert list(default_corpus.default_corpus()) == default_docs
