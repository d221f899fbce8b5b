"""Prepared shard files read so that nothing changed under a running job is trained on, as the
original's TFRecords check a CRC on every record they read.

Loading reads each file once, checking its size and SHA-256 against meta.json's record and its
.npy header (element type, row shape, rows) against this run's phase, and takes, in the same
pass and so from the same bytes, a 32-bit hash of every row. The arrays of
a few bytes per row (`NARROW`: lengths, labels) are then held in memory; the wide ones (token
ids, masked positions and ids) stay on disk and are read per batch with `pread`, every row
checked against its hash before it is used. A file shortened under the job reads short (an
error naming it; a memory map's page past the end would kill the process with SIGBUS), and a
file replaced under the job keeps being read as loaded (the open file is the loaded one).
"""

from __future__ import annotations

import functools
import hashlib
import os
import weakref
from collections.abc import Sequence
from typing import Any, BinaryIO

import numpy as np

from bertjax.data import shard_format
from bertjax.data.errors import DataError

NARROW = ("lengths", "b_starts", "num_predictions", "next_sentence_labels")
READ_BYTES = 1 << 24  # bytes read at a time while loading


@functools.lru_cache(maxsize=16)
def _coefficients(width: int) -> np.ndarray:
    """Fixed odd multipliers: an odd number is invertible modulo 2**32, so a change to any one
    element always changes the row's hash (several changes cancel with odds of 2**-32)."""
    drawn = np.random.default_rng(0x6A09E667).integers(0, 1 << 31, width, dtype=np.uint32)
    return drawn * np.uint32(2) + np.uint32(1)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """A uint32 hash of each row (first axis) of `rows`."""
    flat = np.asarray(rows).reshape(len(rows), -1)
    return (flat.astype(np.uint32) * _coefficients(flat.shape[1])).sum(axis=1, dtype=np.uint32)


class RowFile:
    """The rows of one wide stored array, read on demand from the file loaded, each checked against its hash from loading; `what_to_do` ends every error."""

    def __init__(
        self,
        fd: int,
        path: str,
        dtype: np.dtype,
        row_shape: tuple[int, ...],
        offset: int,
        hashes: np.ndarray,
        largest: int,
        what_to_do: str,
    ) -> None:
        self.fd, self.path, self.dtype, self.row_shape = fd, path, dtype, row_shape
        self.offset, self.hashes, self.largest = offset, hashes, largest
        self.row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        self.what_to_do = what_to_do
        weakref.finalize(self, os.close, fd)

    def __len__(self) -> int:
        return len(self.hashes)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.row_shape)

    def max(self) -> int:
        """The largest element (taken while loading)."""
        return self.largest

    def __getitem__(self, rows: slice | Sequence[int] | np.ndarray) -> np.ndarray:
        """Rows `rows`, read now and checked."""
        rows = np.arange(len(self))[rows] if isinstance(rows, slice) else np.asarray(rows)
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        for i, row in enumerate(rows.tolist()):
            at = self.offset + row * self.row_bytes
            # (numpy's stubs declare arrays buffers only for Python >= 3.12)
            if os.preadv(self.fd, [out[i : i + 1]], at) != self.row_bytes:  # type: ignore[list-item]
                raise DataError(
                    f"prepared data file {self.path} was shortened while in use (to "
                    f"{os.fstat(self.fd).st_size} bytes; row {row} ends at byte "
                    f"{at + self.row_bytes}); the run stopped before training on it: "
                    f"{self.what_to_do}"
                )
        changed = (
            np.flatnonzero(row_hashes(out) != self.hashes[rows])
            if len(rows)
            else np.zeros(0, np.int64)
        )
        if len(changed):
            raise DataError(
                f"prepared data file {self.path} changed while in use (row "
                f"{int(rows[changed[0]])} differs from what was loaded and "
                f"checked); the run stopped before training on it: {self.what_to_do}"
            )
        return out

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype)


def _header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    read = {
        (1, 0): np.lib.format.read_array_header_1_0,
        (2, 0): np.lib.format.read_array_header_2_0,
    }.get(version)
    if read is None:
        raise ValueError(f".npy format version {version}")
    return read(f)


def load(
    path: str,
    record: dict[str, Any],
    name: str,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    what_to_do: str,
) -> np.ndarray | RowFile:
    """Shard file `path` (stored array `name`) checked against its meta.json `record` and the
    `dtype` and `row_shape` this run expects: in memory for a `NARROW` array, else a
    `RowFile`."""

    def fail(problem: str) -> DataError:
        return DataError(f"prepared data file {path} {problem}; {what_to_do}")

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise fail("is missing") from None
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            try:
                shape, fortran, found = _header(f)
            except ValueError as e:
                raise fail(f"is unreadable ({e})") from None
            if found != dtype or tuple(shape[1:]) != row_shape or fortran:
                raise fail(
                    f"holds {found} rows of shape {tuple(shape[1:])}, not the {dtype} rows "
                    f"of shape {row_shape} that its meta.json and this run's phase "
                    "(max_seq_length, max_predictions_per_seq) say"
                )
            if shape[0] != record["rows"]:
                raise fail(f"holds {shape[0]} rows, not the {record['rows']} of its meta.json")
            offset = f.tell()
            f.seek(0)
            digest = hashlib.sha256(f.read(offset))
            kept, size = _read_rows(f, digest, dtype, row_shape, shape[0], name in NARROW)
        if size + offset != record["bytes"] or digest.hexdigest() != record["sha256"]:
            raise fail(
                f"changed since preparation ({record['bytes']} bytes, sha256 "
                f"{record['sha256'][:12]}...)"
            )
    except BaseException:
        os.close(fd)
        raise
    if name in NARROW:
        os.close(fd)
        return kept
    hashes, largest = kept
    return RowFile(fd, path, dtype, row_shape, offset, hashes, largest, what_to_do)


def _read_rows(
    f: BinaryIO,
    digest: hashlib._Hash,
    dtype: np.dtype,
    row_shape: tuple[int, ...],
    rows: int,
    narrow: bool,
) -> tuple[Any, int]:
    """Reads the rest of `f` into `digest`; its rows as an array (`narrow`), else as their
    hashes and largest element. Returns them and the bytes read."""
    row_bytes = dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    per_read = max(1, READ_BYTES // max(row_bytes, 1))
    parts, size, row = [], 0, 0
    while block := f.read(per_read * row_bytes):
        digest.update(block)
        size += len(block)
        count = len(block) // row_bytes if row_bytes else 0
        if count and len(block) % max(row_bytes, 1) == 0:
            array = np.frombuffer(block, dtype).reshape((count, *row_shape))
            parts.append(array.copy() if narrow else (row_hashes(array), array.max()))
        row += count
    if row != rows:  # (a short file: its digest fails too)
        parts = []
    if narrow:
        empty = np.zeros((0, *row_shape), dtype)
        return np.concatenate([empty, *parts]) if parts else empty, size
    hashes = np.concatenate([np.zeros(0, np.uint32), *[h for h, _ in parts]])
    return (hashes, int(max((m for _, m in parts), default=0))), size


def load_split(
    directory: str,
    split: str,
    records: dict[str, dict[str, Any]],
    masked: bool,
    expected: tuple[int, int, int],
    what_to_do: str,
) -> shard_format.PreparedSplit:
    """The shards of `split` listed in meta.json's `records`, each file checked (`load`)
    against `expected` = (max_seq_length, max_predictions_per_seq, vocab_size) of this run."""
    dtypes = shard_format.stored_dtypes(*expected)
    shapes = shard_format.stored_shapes(*expected[:2])
    shards: dict[str, dict[str, Any]] = {}
    for relative, record in records.items():
        if not relative.startswith(split + "/"):
            continue
        _, shard, file_name = relative.split("/")
        name = file_name[: -len(".npy")]
        if name not in dtypes:
            raise DataError(
                f"prepared data {directory}/meta.json lists {relative}, not a "
                f"stored array; {what_to_do}"
            )
        shards.setdefault(shard, {})[name] = load(
            os.path.join(directory, relative),
            record,
            name,
            dtypes[name],
            shapes[name],
            what_to_do,
        )
    for shard, arrays in sorted(shards.items()):
        if set(arrays) != set(dtypes) or len({len(a) for a in arrays.values()}) != 1:
            raise DataError(
                f"prepared data {directory}/meta.json lists {sorted(arrays)} with "
                f"rows {sorted({len(a) for a in arrays.values()})} for {split}/"
                f"{shard}, not every stored array with one row count; {what_to_do}"
            )
    return shard_format.PreparedSplit([shards[name] for name in sorted(shards)], masked)
