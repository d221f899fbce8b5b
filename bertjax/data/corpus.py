"""Reading raw text into documents, the unit BERT pretraining samples from.

A document is a ``list[str]`` of non-empty, stripped sentences. This module reads text files
(the "text" source, `corpora`), local or URLs (gs://), either in the original BERT format (one
sentence per line, blank line between documents) or as plain paragraphs; the other sources
(`tfds_source`, `default_corpus`) count their documents in its `CorpusStats`.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from absl import logging

from bertjax.data import corpora, sentences
from bertjax.data.errors import DataError
from bertjax.runtime import files

if TYPE_CHECKING:
    from bertjax.data.settings import DataSettings

Document = list[str]

TEXT_FORMATS = ("auto", "lines", "paragraphs")


@dataclasses.dataclass
class CorpusStats:
    """Counters describing what was read and what was skipped or repaired.

    ``files`` counts input files (a tfds split counts as one). Lines with invalid
    UTF-8 are kept: the bad bytes become U+FFFD and the line
    is counted in ``invalid_utf8_lines`` (dropping them could silently merge the
    neighbouring sentences into one document). Lines longer than the limit are
    cut, not dropped, and counted in ``truncated_long_lines``. Files that start
    with a UTF-16 byte-order mark are decoded as UTF-16 (``utf16_files``); files
    that look binary are skipped whole (``skipped_binary_files``).
    """

    files: int = 0
    empty_files: int = 0
    documents: int = 0
    sentences: int = 0
    characters: int = 0
    skipped_empty_documents: int = 0
    invalid_utf8_lines: int = 0
    truncated_long_lines: int = 0
    utf16_files: int = 0
    skipped_binary_files: int = 0

    def add(self, other: CorpusStats) -> None:
        """Adds another set of counters into this one."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))

    def repaired(self) -> bool:
        """Whether anything was skipped, cut or decoded specially."""
        return any(
            (
                self.empty_files,
                self.skipped_empty_documents,
                self.invalid_utf8_lines,
                self.truncated_long_lines,
                self.utf16_files,
                self.skipped_binary_files,
            )
        )

    def summary(self) -> str:
        """Returns the counters as one line of text."""
        return (
            f"{self.files} files ({self.empty_files} empty), {self.documents} documents, "
            f"{self.sentences} sentences, {self.characters} characters; "
            f"skipped {self.skipped_empty_documents} empty documents; "
            f"{self.invalid_utf8_lines} lines with invalid UTF-8 (bad bytes replaced); "
            f"{self.truncated_long_lines} long lines truncated; "
            f"{self.utf16_files} UTF-16 files decoded; "
            f"{self.skipped_binary_files} binary files skipped"
        )


def _count_document(document: Document, stats: CorpusStats) -> None:
    stats.documents += 1
    stats.sentences += len(document)
    stats.characters += sum(len(sentence) for sentence in document)


def _log_file_problems(path: str, file_stats: CorpusStats) -> None:
    """Logs each problem category once per file, so huge corpora don't flood the log."""
    if file_stats.empty_files:
        logging.warning("Empty input file: %s", path)
    if file_stats.skipped_binary_files:
        logging.warning(
            "%s looks binary (over %d%% of its first %d bytes are control bytes or invalid "
            "UTF-8); skipped. Remove it from input_files to silence this.",
            path,
            int(100 * _BINARY_FRACTION),
            _SNIFF_BYTES,
        )
    if file_stats.invalid_utf8_lines:
        logging.warning(
            "%s: %d lines contain invalid UTF-8; bad bytes were replaced with U+FFFD.",
            path,
            file_stats.invalid_utf8_lines,
        )
    if file_stats.truncated_long_lines:
        logging.warning(
            "%s: %d lines were longer than max_line_chars and were truncated.",
            path,
            file_stats.truncated_long_lines,
        )
    if file_stats.skipped_empty_documents:
        logging.warning(
            "%s: skipped %d documents without any text.", path, file_stats.skipped_empty_documents
        )


# ---------------------------------------------------------------------------
# Text files
# ---------------------------------------------------------------------------

_GLOB_CHARS = re.compile(r"[*?\[]")
_FORMAT_HELP = (
    "Pass existing text files or glob patterns (e.g. 'data/*.txt'); the expected "
    "format is one sentence per line with a blank line between documents."
)


def expand_paths(paths: Sequence[str] | str) -> list[str]:
    """Expands globs (sorted) and checks that every file exists."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError(f"No input files given. {_FORMAT_HELP}")
    found = []
    for path in paths:
        if _GLOB_CHARS.search(path):
            matches = files.glob(path)
            if not matches:
                raise FileNotFoundError(f"Glob pattern {path!r} matches no files. {_FORMAT_HELP}")
            found.extend(matches)
        elif not files.exists(path):
            raise FileNotFoundError(f"Input file {path!r} does not exist. {_FORMAT_HELP}")
        else:
            found.append(path)
    for path in found:
        if files.isdir(path):
            raise IsADirectoryError(
                f"input {path!r} is a directory; pass its files, e.g. the "
                f"glob {os.path.join(path, '*.txt')!r}."
            )
        if not files.is_remote(path) and not os.access(
            path, os.R_OK, effective_ids=os.access in os.supports_effective_ids
        ):
            raise PermissionError(
                f"input file {path!r} is not readable (permission denied); check its permissions."
            )
    return found


def content_fingerprint(path: str, sample_bytes: int = 4 << 20, blocks: int = 64) -> dict[str, Any]:
    """A cheap identity of a file's content: its size, mtime and the SHA-256 of `blocks`
    evenly spaced blocks, `sample_bytes` in all (the whole file when it is no larger)."""
    size = files.getsize(path)
    digest = hashlib.sha256()
    with files.open(path, "rb") as file:
        if size <= sample_bytes:
            digest.update(file.read())
        else:
            block = sample_bytes // blocks
            for i in range(blocks):
                file.seek((size - block) * i // (blocks - 1))
                digest.update(file.read(block))
    return {"bytes": size, "mtime": int(files.getmtime(path)), "sampled_sha256": digest.hexdigest()}


def _skip_rest_of_line(file: IO) -> int:
    """Consumes the remainder of an over-long line; returns how many bytes it had."""
    skipped = 0
    while chunk := file.readline(1 << 20):
        skipped += len(chunk)
        if chunk[-1:] in (b"\n", "\n"):
            break
    return skipped


def _decode(raw: bytes, final: bool, stats: CorpusStats) -> str:
    # A non-final decode drops an incomplete trailing character left by truncation instead
    # of reporting it as invalid UTF-8; a final one is bytes.decode (no decoder to make).
    try:
        return raw.decode("utf-8") if final else codecs.getincrementaldecoder("utf-8")().decode(raw)
    except UnicodeDecodeError:
        stats.invalid_utf8_lines += 1
        return codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final)


_SNIFF_BYTES = 1 << 16
_BINARY_FRACTION = 0.3
# C0 control bytes that do not occur in text (tab, newlines, form feed and escape do).
_CONTROL_BYTES = bytes(set(range(32)) - set(b"\t\n\v\f\r\x1b")) + b"\x7f"
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _head(path: str) -> bytes:
    with files.open(path, "rb") as file:
        return file.read(_SNIFF_BYTES)


def looks_binary(head: bytes) -> bool:
    """Whether the first bytes of a file are mostly control bytes or invalid UTF-8."""
    if not head or head.startswith(_UTF16_BOMS):
        return False
    control = len(head) - len(head.translate(None, _CONTROL_BYTES))
    invalid = head.decode("utf-8", "replace").count("\ufffd")
    return control + invalid > _BINARY_FRACTION * len(head)


@dataclasses.dataclass
class Cursor:
    """Where a file's reading starts (a byte offset), advanced past every line read (not for
    files read as text, UTF-16 or CR line ends: `seekable` False)."""

    offset: int = 0
    seekable: bool = True


def _decoded_lines(
    path: str, max_line_chars: int, stats: CorpusStats, cursor: Cursor
) -> Iterator[tuple[str, bool]]:
    """Yields `(decoded line with its ending, whether the line went on past what was read)`:
    UTF-8 (bad bytes replaced and counted), or UTF-16 for a file with its byte-order mark.
    Those, and files whose lines end in CR alone (old Mac), are read with universal newlines
    from their start; UTF-8 files from `cursor.offset`."""
    head = _head(path)
    utf16 = head.startswith(_UTF16_BOMS)
    if utf16 or (b"\r" in head and b"\n" not in head):
        stats.utf16_files += utf16
        cursor.seekable = False
        with files.open(path, encoding="utf-16" if utf16 else "utf-8", errors="replace") as file:
            while line := file.readline(max_line_chars + 1):
                overflow = not line.endswith("\n") and _skip_rest_of_line(file) > 0
                stats.invalid_utf8_lines += "\ufffd" in line
                yield line, overflow
        return
    max_bytes = 4 * max_line_chars  # UTF-8 needs at most 4 bytes per character.
    with files.open(path, "rb") as file:
        file.seek(cursor.offset)
        while raw := file.readline(max_bytes):
            skipped = 0 if raw.endswith(b"\n") else _skip_rest_of_line(file)
            cursor.offset += len(raw) + skipped
            yield _decode(raw, final=not skipped, stats=stats), skipped > 0


def _read_lines(
    path: str, max_line_chars: int, stats: CorpusStats, cursor: Cursor | None = None
) -> Iterator[str]:
    """Yields decoded lines without their line ending, each at most max_line_chars long."""
    for decoded, overflow in _decoded_lines(path, max_line_chars, stats, cursor or Cursor()):
        line = decoded.rstrip("\r\n")
        if overflow or len(line) > max_line_chars:
            stats.truncated_long_lines += 1
            line = line[:max_line_chars]
        yield line.lstrip("\ufeff")  # Drop a byte-order mark.


def _documents_from_lines(lines: Iterable[str]) -> Iterator[Document]:
    """Original BERT format: one sentence per line, blank lines end documents."""
    document: Document = []
    for line in lines:
        sentence = line.strip()
        if sentence:
            document.append(sentence)
        elif document:
            yield document
            document = []
    if document:
        yield document


def _documents_from_paragraphs(lines: Iterable[str]) -> Iterator[Document]:
    """Plain text: blank lines end paragraphs, form feeds and file ends end documents."""
    document: Document = []
    paragraph: list[str] = []
    for line in lines:
        text = line.strip()
        if text:
            paragraph.append(text)
            continue
        document.extend(sentences.split_sentences(" ".join(paragraph)))
        paragraph = []
        if "\f" in line and document:
            yield document
            document = []
    document.extend(sentences.split_sentences(" ".join(paragraph)))
    if document:
        yield document


def detect_text_format(path: str, max_line_chars: int = 1_000_000, sample_lines: int = 1000) -> str:
    """Guesses "lines" or "paragraphs" for one file from its first non-blank lines."""
    sample = []
    for line in _read_lines(path, max_line_chars, CorpusStats()):
        if line.strip():
            sample.append(line.strip())
            if len(sample) >= sample_lines:
                break
    return "lines" if sentences.looks_like_sentence_per_line(sample) else "paragraphs"


def _read_one_file(
    path: str, text_format: str, file_stats: CorpusStats, max_line_chars: int, cursor: Cursor
) -> Iterator[Document]:
    file_stats.empty_files = int(files.getsize(path) == 0)
    if looks_binary(_head(path)):
        file_stats.skipped_binary_files = 1
        return iter(())
    if text_format == "auto":
        text_format = detect_text_format(path, max_line_chars)
        logging.debug("Reading %s as %r text.", path, text_format)
    lines = _read_lines(path, max_line_chars, file_stats, cursor)
    parse = _documents_from_lines if text_format == "lines" else _documents_from_paragraphs
    return parse(lines)


def counted(
    source: str, documents: Iterable[Document], file_stats: CorpusStats, stats: CorpusStats
) -> Iterator[Document]:
    """Counts one source's documents; when it ends or is closed, logs and merges counts."""
    try:
        for document in documents:
            _count_document(document, file_stats)
            yield document
    finally:
        _log_file_problems(source, file_stats)
        stats.add(file_stats)


def read_text_files(
    paths: Sequence[str],
    text_format: str = "auto",
    stats: CorpusStats | None = None,
    max_line_chars: int = 1_000_000,
) -> Iterator[Document]:
    """Reads documents from text files; paths may be globs (expanded in sorted order).

    ``text_format``:
      * ``"lines"``: the original BERT format, one sentence per line and a blank
        line between documents.
      * ``"paragraphs"``: plain text; each run of non-blank lines is a paragraph,
        joined with spaces and split with ``sentences.split_sentences``. A document is a
        whole file, or the text between lines containing a form feed (``\\f``).
      * ``"auto"``: per file, "lines" if most of its first 1000 non-blank lines
        are short and end exactly one sentence, else "paragraphs".

    Documents never span files. Files are read as bytes and decoded per line, so
    invalid UTF-8 never raises (see ``CorpusStats``). Paths are checked when this
    is called: a missing file or a glob matching nothing raises FileNotFoundError.
    """
    positioned = positioned_documents(expand_paths(paths), text_format, stats, max_line_chars)
    return (document for _, document in positioned)


TextPosition = tuple[int, int, int, int]  # document number, file index, byte offset, skip


def positioned_documents(
    paths: Sequence[str],
    text_format: str = "auto",
    stats: CorpusStats | None = None,
    max_line_chars: int = 1_000_000,
    start: TextPosition | None = None,
) -> Iterator[tuple[TextPosition, Document]]:
    """`(position, document)` of the files `paths` (as `read_text_files`), from the first
    (counted into `stats`) or, not counted again, from a `start` that this returned: (the
    document's number, its file's index, the byte offset to read from, documents to skip)."""
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {text_format!r}.")
    number, first_file, offset, skip = start or (0, 0, 0, 0)

    def generate(number: int) -> Iterator[tuple[TextPosition, Document]]:
        for file_index, path in enumerate(paths[first_file:], first_file):
            begin, to_skip = (offset, skip) if file_index == first_file else (0, 0)
            cursor, file_stats = Cursor(begin), CorpusStats(files=1)
            documents = _read_one_file(path, text_format, file_stats, max_line_chars, cursor)
            if start is None:
                documents = counted(
                    path, documents, file_stats, stats if stats is not None else CorpusStats()
                )
            position = (number, file_index, begin, to_skip)
            for in_file, document in enumerate(documents, 1):
                if in_file > to_skip:
                    yield position, document
                    number += 1
                position = (
                    (number, file_index, cursor.offset, 0)
                    if cursor.seekable
                    else (number, file_index, 0, in_file)
                )

    return generate(number)


def _text_arguments(data: DataSettings) -> tuple[tuple[str, ...], str]:
    """The "text" source's files (globs expanded) and their format."""
    if not data.input_files:
        raise DataError("data.source=text needs --config.data.input_files=PATH[,PATH...]")
    return tuple(expand_paths(data.input_files.split(","))), data.text_format


def _text_documents(
    arguments: tuple[tuple[str, ...], str],
    index: int,
    count: int,
    stats: CorpusStats | None,
    start: TextPosition | None,
) -> Iterator[tuple[TextPosition, Document]]:
    read = positioned_documents(*arguments, stats, start=start)
    return ((p, document) for p, document in read if p[0] % count == index)


def _text_identity(data: DataSettings) -> dict[str, Any]:
    paths, text_format = _text_arguments(data)
    return {"files": [(files.abspath(f), files.getsize(f)) for f in paths], "format": text_format}


corpora.register(corpora.Source("text", _text_arguments, _text_documents, _text_identity))
