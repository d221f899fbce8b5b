"""Reading raw text into documents, the unit BERT pretraining samples from.

A document is a ``list[str]`` of non-empty, stripped sentences. Three sources:

* ``read_text_files``: local text files, either the original BERT format (one
  sentence per line, blank line between documents) or plain paragraphs.
* ``read_tfds``: a tensorflow-datasets dataset prepared in ``array_record``
  format, read by random access without TensorFlow.
* ``default_corpus``: an offline corpus of real English assembled from the
  documentation that ships with every Python installation: the language
  reference topics in ``pydoc_data.topics`` plus the docstrings of a fixed list
  of standard-library modules (about 1 MB of text; its exact content depends on
  the Python version, and is identical between runs of the same version).
"""

from __future__ import annotations

import codecs
import dataclasses
import glob
import importlib
import inspect
import os
import re
import statistics
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from absl import logging

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
            path, int(100 * _BINARY_FRACTION), _SNIFF_BYTES)
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
# Sentence splitting
# ---------------------------------------------------------------------------

# Sentence-final punctuation, optional closing quotes/brackets, then whitespace.
_BOUNDARY = re.compile(r"[.!?]+[\"'\u201d\u2019\u00bb)\]]*\s+")
_SENTENCE_OPENERS = "\"'\u201c\u2018\u00ab(["
_ABBREVIATIONS = frozenset(
    """mr. mrs. ms. dr. prof. st. jr. sr. mt. rev. hon. gen. col. lt. sgt. capt. gov.
    sen. rep. pres. vs. etc. e.g. i.e. cf. al. viz. approx. no. nos. vol. fig. figs.
    ch. sec. inc. ltd. co. corp. jan. feb. mar. apr. jun. jul. aug. sep. sept. oct.
    nov. dec.""".split()
)
# Initials and dotted acronyms such as "J." or "U.S." rarely end a sentence.
_INITIALS = re.compile(r"(?:[A-Za-z]\.)*[A-Z]")


def _ends_with_abbreviation(text: str, period_index: int) -> bool:
    """Whether the word ending at ``text[period_index] == '.'`` is an abbreviation."""
    word_start = period_index
    while word_start > 0 and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:period_index].lstrip(_SENTENCE_OPENERS)
    return (word + ".").lower() in _ABBREVIATIONS or _INITIALS.fullmatch(word) is not None


def _is_boundary(text: str, match: re.Match[str]) -> bool:
    if match.end() >= len(text):
        return False
    following = text[match.end()]
    if not (following.isupper() or following.isdigit() or following in _SENTENCE_OPENERS):
        return False
    # Only a lone period can belong to an abbreviation; "?", "!" and "..." end sentences.
    is_lone_period = match.group().startswith(".") and not match.group().startswith("..")
    return not (is_lone_period and _ends_with_abbreviation(text, match.start()))


def split_sentences(text: str) -> list[str]:
    """Splits English text into sentences with simple deterministic rules."""
    sentences = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if _is_boundary(text, match):
            sentences.append(text[start : match.end()].strip())
            start = match.end()
    sentences.append(text[start:].strip())
    return [sentence for sentence in sentences if sentence]


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
    files = []
    for path in paths:
        if _GLOB_CHARS.search(path):
            matches = sorted(glob.glob(path))
            if not matches:
                raise FileNotFoundError(f"Glob pattern {path!r} matches no files. {_FORMAT_HELP}")
            files.extend(matches)
        elif os.path.isdir(path):
            raise IsADirectoryError(
                f"{path!r} is a directory; pass a glob such as {os.path.join(path, '*.txt')!r}."
            )
        elif not os.path.exists(path):
            raise FileNotFoundError(f"Input file {path!r} does not exist. {_FORMAT_HELP}")
        else:
            files.append(path)
    return files


def _skip_rest_of_line(file: Any) -> int:
    """Consumes the remainder of an over-long line; returns how many bytes it had."""
    skipped = 0
    while chunk := file.readline(1 << 20):
        skipped += len(chunk)
        if chunk[-1:] in (b"\n", "\n"):
            break
    return skipped


def _decode(raw: bytes, final: bool, stats: CorpusStats) -> str:
    # A non-final decode drops an incomplete trailing character left by truncation
    # instead of reporting it as invalid UTF-8.
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final)
    except UnicodeDecodeError:
        stats.invalid_utf8_lines += 1
        return codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final)


_SNIFF_BYTES = 1 << 16
_BINARY_FRACTION = 0.3
# C0 control bytes that do not occur in text (tab, newlines, form feed and escape do).
_CONTROL_BYTES = bytes(set(range(32)) - set(b"\t\n\v\f\r\x1b")) + b"\x7f"
_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def _head(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read(_SNIFF_BYTES)


def looks_binary(head: bytes) -> bool:
    """Whether the first bytes of a file are mostly control bytes or invalid UTF-8."""
    if not head or head.startswith(_UTF16_BOMS):
        return False
    control = len(head) - len(head.translate(None, _CONTROL_BYTES))
    invalid = head.decode("utf-8", "replace").count("\ufffd")
    return control + invalid > _BINARY_FRACTION * len(head)


def _decoded_lines(path: str, max_line_chars: int, stats: CorpusStats) -> Iterator[tuple[str, bool]]:
    """Yields `(decoded line with its ending, whether the line went on past what was read)`:
    UTF-8 (bad bytes replaced and counted), or UTF-16 for a file with its byte-order mark."""
    if _head(path).startswith(_UTF16_BOMS):
        stats.utf16_files = 1
        with open(path, encoding="utf-16", errors="replace") as file:
            while line := file.readline(max_line_chars + 1):
                overflow = not line.endswith("\n") and _skip_rest_of_line(file) > 0
                stats.invalid_utf8_lines += "\ufffd" in line
                yield line, overflow
        return
    max_bytes = 4 * max_line_chars  # UTF-8 needs at most 4 bytes per character.
    with open(path, "rb") as file:
        while raw := file.readline(max_bytes):
            overflow = not raw.endswith(b"\n") and _skip_rest_of_line(file) > 0
            yield _decode(raw, final=not overflow, stats=stats), overflow


def _read_lines(path: str, max_line_chars: int, stats: CorpusStats) -> Iterator[str]:
    """Yields decoded lines without their line ending, each at most max_line_chars long."""
    for line, overflow in _decoded_lines(path, max_line_chars, stats):
        line = line.rstrip("\r\n")
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
        document.extend(split_sentences(" ".join(paragraph)))
        paragraph = []
        if "\f" in line and document:
            yield document
            document = []
    document.extend(split_sentences(" ".join(paragraph)))
    if document:
        yield document


_SENTENCE_END = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")


def _looks_like_sentence_per_line(lines: Sequence[str]) -> bool:
    """Heuristic for "auto": short lines that each end one (and only one) sentence."""
    if not lines:
        return True
    median_length = statistics.median(len(line) for line in lines)
    ends_sentence = sum(bool(_SENTENCE_END.search(line)) for line in lines) / len(lines)
    multi_sentence = sum(len(split_sentences(line)) > 1 for line in lines) / len(lines)
    return median_length < 400 and ends_sentence >= 0.5 and multi_sentence < 0.2


def detect_text_format(path: str, max_line_chars: int = 1_000_000, sample_lines: int = 1000) -> str:
    """Guesses "lines" or "paragraphs" for one file from its first non-blank lines."""
    sample = []
    for line in _read_lines(path, max_line_chars, CorpusStats()):
        if line.strip():
            sample.append(line.strip())
            if len(sample) >= sample_lines:
                break
    return "lines" if _looks_like_sentence_per_line(sample) else "paragraphs"


def _read_one_file(
    path: str, text_format: str, file_stats: CorpusStats, max_line_chars: int
) -> Iterator[Document]:
    file_stats.empty_files = int(os.path.getsize(path) == 0)
    if looks_binary(_head(path)):
        file_stats.skipped_binary_files = 1
        return iter(())
    if text_format == "auto":
        text_format = detect_text_format(path, max_line_chars)
        logging.info("Reading %s as %r text.", path, text_format)
    lines = _read_lines(path, max_line_chars, file_stats)
    parse = _documents_from_lines if text_format == "lines" else _documents_from_paragraphs
    return parse(lines)


def _counted(
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
        joined with spaces and split with ``split_sentences``. A document is a
        whole file, or the text between lines containing a form feed (``\\f``).
      * ``"auto"``: per file, "lines" if most of its first 1000 non-blank lines
        are short and end exactly one sentence, else "paragraphs".

    Documents never span files. Files are read as bytes and decoded per line, so
    invalid UTF-8 never raises (see ``CorpusStats``). Paths are checked when this
    is called: a missing file or a glob matching nothing raises FileNotFoundError.
    """
    if text_format not in TEXT_FORMATS:
        raise ValueError(f"text_format must be one of {TEXT_FORMATS}, got {text_format!r}.")
    files = expand_paths(paths)
    stats = stats if stats is not None else CorpusStats()

    def generate() -> Iterator[Document]:
        for path in files:
            file_stats = CorpusStats(files=1)
            documents = _read_one_file(path, text_format, file_stats, max_line_chars)
            yield from _counted(path, documents, file_stats, stats)

    return generate()


# ---------------------------------------------------------------------------
# tensorflow-datasets
# ---------------------------------------------------------------------------


def _text_to_document(text: bytes | str) -> Document:
    """Splits a text into paragraphs at newlines, then each paragraph into sentences."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    return [s for paragraph in text.splitlines() for s in split_sentences(paragraph.strip())]


def _open_tfds_source(name: str, split: str, data_dir: str | None) -> Sequence[Any]:
    """Returns the random-access data source of a prepared array_record dataset."""
    import tensorflow_datasets as tfds  # Imported lazily: slow, and only needed here.

    how_to_prepare = (
        f"Prepare it first with `tfds build {name} --file_format=array_record"
        + (f" --data_dir={data_dir}`" if data_dir else "`")
        + ", or pass data_dir= pointing at a directory where it is already prepared."
    )
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError as error:  # neither prepared nor known to this tfds
        where = data_dir or tfds.core.constants.DATA_DIR
        raise FileNotFoundError(
            f"tfds dataset {name!r} is not prepared in {where}, and this tensorflow-datasets "
            f"has no builder for it. {how_to_prepare}"
        ) from error
    if not builder.is_prepared():
        raise FileNotFoundError(
            f"tfds dataset {name!r} is not prepared in {builder.data_dir}. {how_to_prepare}"
        )
    try:
        return builder.as_data_source(split=split)
    except (NotImplementedError, ValueError) as error:
        raise ValueError(
            f"tfds dataset {name!r} at {builder.data_dir} cannot be read by random access "
            f"(needs array_record format; reading without TensorFlow). {how_to_prepare}"
        ) from error


def read_tfds(
    name: str,
    split: str = "train",
    data_dir: str | None = None,
    text_key: str = "text",
    process_index: int = 0,
    process_count: int = 1,
    stats: CorpusStats | None = None,
) -> Iterator[Document]:
    """Reads documents from a tfds dataset in array_record format, without TensorFlow.

    Each example's ``text_key`` field becomes one document: split into paragraphs
    at newlines and into sentences with ``split_sentences``. Process ``i`` of ``n``
    reads records ``i, i + n, i + 2n, ...``. Errors (dataset not prepared, wrong
    format, unknown text_key) are raised when this is called.
    """
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"Need 0 <= process_index < process_count, got {process_index}, {process_count}."
        )
    source = _open_tfds_source(name, split, data_dir)
    if len(source) and text_key not in source[0]:
        raise KeyError(
            f"text_key {text_key!r} is not a feature of tfds dataset {name!r}; "
            f"available keys: {sorted(source[0])}."
        )
    stats = stats if stats is not None else CorpusStats()
    file_stats = CorpusStats(files=1)

    def documents() -> Iterator[Document]:
        for index in range(process_index, len(source), process_count):
            document = _text_to_document(source[index][text_key])
            if document:
                yield document
            else:
                file_stats.skipped_empty_documents += 1

    return _counted(f"tfds:{name}/{split}", documents(), file_stats, stats)


# ---------------------------------------------------------------------------
# Default corpus: Python's own documentation
# ---------------------------------------------------------------------------

# Pure-Python (and a few documentation-rich builtin) modules, sorted so the corpus
# order is fixed. Left out: modules with import side effects (this, antigravity,
# rlcompleter, tkinter, turtle, idlelib), deprecated ones that warn on import, and
# test packages. Modules missing from a given Python version are skipped.
_DOC_MODULES = """
abc argparse ast asyncio asyncio.base_events asyncio.events asyncio.futures
asyncio.locks asyncio.queues asyncio.streams asyncio.subprocess asyncio.tasks base64
bdb bisect builtins bz2 calendar cmd code codecs codeop collections collections.abc
colorsys compileall concurrent.futures concurrent.futures._base
concurrent.futures.process concurrent.futures.thread configparser contextlib
contextvars copy copyreg csv ctypes dataclasses datetime dbm decimal difflib dis
doctest email email.charset email.contentmanager email.encoders email.errors
email.feedparser email.generator email.header email.headerregistry email.iterators
email.message email.mime.base email.mime.multipart email.mime.text email.parser
email.policy email.utils encodings enum filecmp fileinput fnmatch fractions ftplib
functools gc getopt getpass gettext glob graphlib gzip hashlib heapq hmac html
html.parser http http.client http.cookiejar http.cookies http.server imaplib
importlib importlib.abc importlib.machinery importlib.metadata importlib.resources
importlib.util inspect io ipaddress itertools json json.decoder json.encoder keyword
linecache locale logging logging.config logging.handlers lzma mailbox marshal math
mimetypes modulefinder multiprocessing multiprocessing.connection
multiprocessing.context multiprocessing.managers multiprocessing.pool
multiprocessing.process multiprocessing.queues multiprocessing.shared_memory
multiprocessing.synchronize netrc numbers operator optparse os os.path pathlib pdb
pickle pickletools pkgutil platform plistlib poplib pprint profile pstats py_compile
pyclbr pydoc queue quopri random re reprlib runpy sched secrets selectors
shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl stat statistics
string stringprep struct subprocess symtable sys sysconfig tabnanny tarfile tempfile
textwrap threading time timeit token tokenize tomllib trace traceback tracemalloc
types typing unicodedata unittest unittest.case unittest.loader unittest.mock
unittest.result unittest.runner unittest.suite urllib.error urllib.parse
urllib.request urllib.response urllib.robotparser uuid warnings wave weakref
wsgiref.handlers wsgiref.headers wsgiref.simple_server wsgiref.util wsgiref.validate
xml.dom xml.dom.minidom xml.dom.pulldom xml.etree.ElementTree xml.parsers.expat
xml.sax xml.sax.handler xml.sax.saxutils xml.sax.xmlreader xmlrpc.client
xmlrpc.server zipapp zipfile zipimport zlib zoneinfo
""".split()

_CODE_LINE = re.compile(r"^\s*(>>>|\.\.\.)|::=|^\s*[|+=]")


def _letter_fraction(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in visible) / len(visible) if visible else 0.0


def _looks_like_prose(block: list[str]) -> bool:
    """Code, grammar, tables and headings rarely end in sentence punctuation."""
    text = " ".join(block)
    return _letter_fraction(text) >= 0.75 and bool(re.search(r"[.!?:][\"')]*$", text))


def _clean_documentation(text: str) -> Document:
    """Turns a docstring or help topic into sentences, dropping code and tables."""
    document: Document = []
    block: list[str] = []
    for line in [*inspect.cleandoc(text).splitlines(), ""]:
        if line.strip() and not _CODE_LINE.search(line):
            block.append(line.strip())
            continue
        # A blank line or a code line ends a block.
        if block and _looks_like_prose(block):
            document.extend(split_sentences(" ".join(" ".join(block).split())))
        block = []
    return document


def _import_quietly(name: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # Missing or broken on this platform: leave it out.
        return None


def _class_docstrings(cls: type) -> Iterator[Any]:
    yield cls.__doc__
    for name, member in sorted(vars(cls).items()):
        documented = inspect.isroutine(member) or isinstance(
            member, (property, classmethod, staticmethod)
        )
        if documented and (not name.startswith("_") or name == "__init__"):
            yield member.__doc__


def _module_docstrings(module: Any) -> Iterator[Any]:
    """The module's docstring, then those of its public classes, methods and functions."""
    yield module.__doc__
    for name, member in sorted(vars(module).items()):
        # builtins objects report __module__ == "builtins"; others must be defined here.
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(member):
            yield from _class_docstrings(member)
        elif inspect.isroutine(member):
            yield member.__doc__


def _documentation_texts() -> Iterator[Any]:
    """Help topics, then docstrings in module order (None where there is no docstring)."""
    from pydoc_data.topics import topics

    yield from (topics[key] for key in sorted(topics))
    for name in _DOC_MODULES:
        module = _import_quietly(name)
        if module is not None:
            yield from _module_docstrings(module)


def default_corpus(stats: CorpusStats | None = None) -> Iterator[Document]:
    """Yields the offline default corpus built from Python's bundled documentation."""
    stats = stats if stats is not None else CorpusStats()
    return _counted("the default corpus", _default_documents(), CorpusStats(), stats)


def _default_documents() -> Iterator[Document]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Some attributes warn when touched (typing.io).
        texts = list(_documentation_texts())
    seen = set()  # Inherited and aliased objects repeat docstrings.
    for text in texts:
        if not isinstance(text, str) or text in seen:
            continue
        seen.add(text)
        document = _clean_documentation(text)
        if document:
            yield document
