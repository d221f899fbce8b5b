"""The default pretraining corpus: an offline corpus of real English assembled from the
documentation that ships with every Python installation: the language reference topics in
``pydoc_data.topics`` plus the docstrings of a fixed list of standard-library modules (about
1 MB of text; its exact content depends on the Python version, and is identical between runs
of the same version)."""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
import sys
import types
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from bertjax.data import corpora, corpus, sentences

if TYPE_CHECKING:
    from bertjax.data.settings import DataSettings

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


def _clean_documentation(text: str) -> corpus.Document:
    """Turns a docstring or help topic into sentences, dropping code and tables."""
    document: corpus.Document = []
    block: list[str] = []
    for line in [*inspect.cleandoc(text).splitlines(), ""]:
        if line.strip() and not _CODE_LINE.search(line):
            block.append(line.strip())
            continue
        # A blank line or a code line ends a block.
        if block and _looks_like_prose(block):
            document.extend(sentences.split_sentences(" ".join(" ".join(block).split())))
        block = []
    return document


def _import_quietly(name: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except Exception:  # noqa: BLE001 (missing or broken on this platform: leave it out)
        return None


def _class_docstrings(cls: type) -> Iterator[Any]:
    yield cls.__doc__
    for name, member in sorted(vars(cls).items()):
        documented = inspect.isroutine(member) or isinstance(
            member, (property, classmethod, staticmethod)
        )
        if documented and (not name.startswith("_") or name == "__init__"):
            yield member.__doc__


def _module_docstrings(module: types.ModuleType) -> Iterator[Any]:
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


def default_corpus(stats: corpus.CorpusStats | None = None) -> Iterator[corpus.Document]:
    """Yields the offline default corpus built from Python's bundled documentation."""
    stats = stats if stats is not None else corpus.CorpusStats()
    return corpus.counted("the default corpus", _default_documents(), corpus.CorpusStats(), stats)


def _default_documents() -> Iterator[corpus.Document]:
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


def _no_arguments(data: DataSettings) -> None:
    return None


def _numbered_documents(
    arguments: None,
    index: int,
    count: int,
    stats: corpus.CorpusStats | None,
    start: int | None,
) -> Iterator[tuple[int, corpus.Document]]:
    numbered = itertools.islice(enumerate(default_corpus(stats)), start, None)
    return ((p, document) for p, document in numbered if p % count == index)


def _python_version(data: DataSettings) -> dict[str, Any]:
    return {"default": sys.version}  # (the corpus is the documentation of this Python)


corpora.register(corpora.Source("default", _no_arguments, _numbered_documents, _python_version))
