"""One file layer for local paths and remote URLs (`gs://bucket/...`, or any fsspec URL).

Local paths go to the standard library unchanged; a path with `://` goes through fsspec
(gcsfs for `gs://`, installed by the `gcs` extra). Orbax reads and writes `gs://`
checkpoints itself (etils epath and tensorstore); everything else the runs read (corpus
files and globs, vocab and SentencePiece files, init checkpoints, task files) or write
in a workdir (config, metrics, summaries) comes through here. Remote requests that fail
transiently (429, 5xx, a reset, a cut-short body) are retried for a bounded time
(`bertjax.runtime.storage`, which also sets Orbax's retries).

`STORAGE_EMULATOR_HOST` (a local GCS emulator) points gcsfs, tensorstore and tensorboardX's
GCS client at the emulator; this module then also turns off gcsfs's bucket-type probe over
gRPC, which an emulator does not answer (60 s per call before the fallback).
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import errno
import functools
import glob as _glob
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from typing import IO, TYPE_CHECKING, Any

from bertjax.runtime import storage


def no_space(path: str) -> OSError:
    """The OSError of a full disk under `path` (for a library that reports none)."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


@contextlib.contextmanager
def naming(path: str) -> Iterator[None]:
    """Gives an OSError raised in the block without a file name (a failed write names none)
    the name `path`."""
    try:
        yield
    except OSError as e:
        if e.errno is not None and e.filename is None:
            raise OSError(e.errno, e.strerror, path) from e
        raise


if TYPE_CHECKING:  # (fsspec is imported where a remote path is used)
    from fsspec import AbstractFileSystem


def _emulator_defaults() -> None:
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", host if "://" in host else f"http://{host}")
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")  # tensorstore: no auth


_emulator_defaults()


def is_remote(path: str) -> bool:
    """Whether `path` is a URL (`gs://...`) rather than a local path."""
    return "://" in str(path)


def _fs(path: str) -> tuple[AbstractFileSystem, str]:
    _emulator_defaults()  # (an emulator named after this module was imported)
    storage.install_gcsfs()
    try:
        import fsspec

        return fsspec.core.url_to_fs(path)
    except ImportError as e:  # fsspec's message names the protocol's package
        raise ImportError(f"cannot read {path}: {e}; pip install 'bertjax[gcs]'") from None


def _url(fs: AbstractFileSystem, fs_path: str) -> str:
    """fsspec's bare path (`bucket/key`) back to a URL."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return fs_path if "://" in fs_path else f"{protocol}://{fs_path}"


def open(  # noqa: A001 (files.open: builtins.open for URLs too)
    path: str,
    mode: str = "r",
    encoding: str | None = None,
    errors: str | None = None,
    newline: str | None = None,
) -> IO:
    """`builtins.open` for local paths; for URLs a buffered (binary) or text file that
    supports `readline(size)`. A remote file opened for writing is uploaded on close."""
    if not is_remote(path):
        return builtins.open(path, mode, encoding=encoding, errors=errors, newline=newline)
    fs, fs_path = _fs(path)
    if "r" in mode and not _exists_remote(fs, fs_path):
        raise FileNotFoundError(2, "No such file", path)
    raw = fs.open(fs_path, mode.replace("t", "").replace("b", "") + "b")
    binary = io.BufferedReader(raw, 1 << 20) if "r" in mode else raw
    if "b" in mode:
        return binary
    return io.TextIOWrapper(binary, encoding=encoding or "utf-8", errors=errors, newline=newline)


def read_bytes(path: str) -> bytes:
    """The whole file's bytes."""
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str, encoding: str = "utf-8") -> str:
    """The whole file's text."""
    with open(path, encoding=encoding) as f:
        return f.read()


def write_text(path: str, text: str, append: bool = False) -> None:
    """Writes a small text file so that a kill -9 never loses what it held: a rewrite replaces
    it whole, locally through a renamed temporary file, on an object store by one upload
    (objects are replaced whole). Locally, an append is one O_APPEND write (earlier lines
    are never rewritten; one that does not fit is taken back); object stores cannot append,
    so there an append rewrites the object."""
    if is_remote(path):
        if append and exists(path):
            text = read_text(path) + text
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    if append:
        fd, data = (
            os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644),
            text.encode("utf-8"),
        )
        try:
            with naming(path):
                written = os.write(fd, data)
                if written < len(data):  # a full disk: no partial line is left behind
                    os.ftruncate(fd, os.fstat(fd).st_size - written)
                    raise no_space(path)
        finally:
            os.close(fd)
        return
    temporary = f"{path}.tmp{os.getpid()}"
    with builtins.open(temporary, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(temporary, path)


def _local_or_remote(
    path: str, local: Callable[[str], Any], remote: Callable[[AbstractFileSystem, str], Any]
) -> Any:
    """`local(path)` for a local path, else `remote(filesystem, fsspec path)`."""
    if not is_remote(path):
        return local(path)
    return remote(*_fs(path))


def exists(path: str) -> bool:
    """Whether a file or directory (a prefix with objects under it) exists. On an object
    store, False only when the store says so: a request that fails raises (fsspec's own
    `exists` would answer False)."""
    return _local_or_remote(path, os.path.exists, _exists_remote)


def _exists_remote(fs: AbstractFileSystem, fs_path: str) -> bool:
    try:
        fs.info(fs_path)
        return True
    except FileNotFoundError:
        return False


def isfile(path: str) -> bool:
    """Whether `path` is a file (an object)."""
    return _local_or_remote(path, os.path.isfile, lambda fs, p: fs.isfile(p))


def isdir(path: str) -> bool:
    """Whether `path` is a directory (a prefix with objects under it)."""
    return _local_or_remote(path, os.path.isdir, lambda fs, p: fs.isdir(p))


def getsize(path: str) -> int:
    """The file's size in bytes."""
    return _local_or_remote(path, os.path.getsize, lambda fs, p: int(fs.size(p)))


def getmtime(path: str) -> float:
    """The file's modification time (seconds since the epoch)."""
    return _local_or_remote(path, os.path.getmtime, lambda fs, p: fs.modified(p).timestamp())


def glob(pattern: str) -> list[str]:
    """The paths matching a glob pattern, sorted (URLs keep their scheme)."""
    if not is_remote(pattern):
        return sorted(_glob.glob(pattern))
    fs, fs_path = _fs(pattern)
    return sorted(_url(fs, p) for p in fs.glob(fs_path))


def listdir(path: str) -> list[str]:
    """The names in a directory (`os.listdir`)."""
    if not is_remote(path):
        return os.listdir(path)
    fs, fs_path = _fs(path)
    return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(fs_path, detail=False)]


def makedirs(path: str) -> None:
    """Creates a directory and its parents if missing (object stores need none)."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def rename(source: str, target: str) -> None:
    """Moves a file or directory: `os.replace` locally, copy then delete on object stores
    (which have no rename; gcsfs's single-call move is not used, emulators lack it)."""
    if not is_remote(source):
        os.replace(source, target)
        return
    fs, fs_source = _fs(source)
    fs_target = _fs(target)[1]
    fs.copy(fs_source, fs_target, recursive=fs.isdir(fs_source))
    fs.rm(fs_source, recursive=True)


def copy(source: str, target: str) -> None:
    """Copies one file, either side local or a URL (a remote target is uploaded whole on
    close; a local target's parent directories are made)."""
    if not is_remote(target):
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    with open(source, "rb") as reader, open(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 24)


def remove(path: str) -> None:
    """Deletes a file, or a directory with everything under it."""
    if not is_remote(path):
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return
    fs, fs_path = _fs(path)
    fs.rm(fs_path, recursive=True)


def local_cache_dir(workdir: str) -> str:
    """Where a run's prepared data goes by default: on local disk, `WORKDIR/data`, or for a
    remote workdir the temporary directory (prepared again on a new machine)."""
    if is_remote(workdir):
        return os.path.join(tempfile.gettempdir(), "bertjax_data")
    return os.path.join(workdir, "data")


def local_copy(directory: str, names: Iterable[str]) -> str:
    """A local directory holding the files `names` of `directory`: the directory itself when
    local; for a URL a copy downloaded (once per process, deleted at exit) into a temporary
    folder of the same last name, so that readers that need local files (safetensors, torch,
    a TF bundle) and names that carry meaning (`uncased_L-12_H-768_A-12`) work unchanged."""
    if not is_remote(directory):
        return directory
    return _downloaded(directory.rstrip("/"), tuple(sorted(set(names))))


@functools.lru_cache(maxsize=8)
def _downloaded(directory: str, names: tuple[str, ...]) -> str:
    root = tempfile.mkdtemp(prefix="bertjax_remote_")
    atexit.register(shutil.rmtree, root, True)
    local = os.path.join(root, directory.rsplit("/", 1)[-1] or "remote")
    os.makedirs(local)
    fs = _fs(directory)[0]
    for name in names:
        fs.get(_fs(f"{directory}/{name}")[1], os.path.join(local, name))
    return local


def abspath(path: str) -> str:
    """`os.path.abspath` for local paths; URLs unchanged."""
    return path if is_remote(path) else os.path.abspath(path)


def generations(directory: str) -> dict[str, int]:
    """The objects directly in the remote `directory`, each with its generation (GCS numbers
    an object's writes by their time: the order of commits), listed afresh (fsspec's listing
    cache does not see other processes' writes); {} if there are none."""
    fs, fs_path = _fs(directory)
    try:
        listed = fs.ls(fs_path, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry.get("generation") or 0)
        for entry in listed
        if entry.get("type") == "file"
    }
