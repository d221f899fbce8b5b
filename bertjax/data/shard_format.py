"""The compact on-disk layout of prepared instances, written as they are made and read back
(`shard_reader`: checked as read) as the original's fixed-shape features (`bertjax.data.batch`).

A shard stores, per instance: the padded token ids in the narrowest unsigned type that holds
the vocabulary (uint16 below 65,536 ids), the sequence length and where segment B starts
(instead of the padded `input_mask` and `segment_ids`), the masked positions and ids, the
number of predictions (instead of `masked_lm_weights`) and the NSP label: 320 bytes at
L=128 with 20 predictions, against 1,708 for the int32 features and about 830 for the
original's TFRecord.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from bertjax.data.batch import FEATURES
from bertjax.runtime import files

STORED = (
    "input_ids",
    "lengths",
    "b_starts",
    "masked_lm_positions",
    "masked_lm_ids",
    "num_predictions",
    "next_sentence_labels",
)


def _unsigned(largest: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if largest <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def stored_dtypes(
    max_seq_length: int, max_predictions: int, vocab_size: int
) -> dict[str, np.dtype]:
    """Each stored array's element type for this shape and vocabulary."""
    ids, position = _unsigned(vocab_size - 1), _unsigned(max_seq_length)
    return {
        "input_ids": ids,
        "lengths": position,
        "b_starts": position,
        "masked_lm_positions": position,
        "masked_lm_ids": ids,
        "num_predictions": _unsigned(max_predictions),
        "next_sentence_labels": np.dtype(np.uint8),
    }


def stored_shapes(max_seq_length: int, max_predictions: int) -> dict[str, tuple[int, ...]]:
    """Each stored array's shape per row."""
    return {
        "input_ids": (max_seq_length,),
        "lengths": (),
        "b_starts": (),
        "masked_lm_positions": (max_predictions,),
        "masked_lm_ids": (max_predictions,),
        "num_predictions": (),
        "next_sentence_labels": (),
    }


def unmasked_rows(
    tokens: Sequence[np.ndarray],
    b_starts: Sequence[int],
    is_random_next: Sequence[bool],
    max_seq_length: int,
    max_predictions: int,
    vocab_size: int,
    pad_id: int,
) -> dict[str, np.ndarray]:
    """Stored rows of instances (`tokens` unpadded, segment B from `b_starts`, their length
    if none), without predictions yet (masking fills them in)."""
    dtypes = stored_dtypes(max_seq_length, max_predictions, vocab_size)
    shapes = stored_shapes(max_seq_length, max_predictions)
    rows = {name: np.zeros((len(tokens),) + shapes[name], dtypes[name]) for name in STORED}
    lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
    if len(tokens) and lengths.max() > max_seq_length:
        raise ValueError(
            f"an instance of {lengths.max()} tokens does not fit {max_seq_length} tokens"
        )
    ids = rows["input_ids"]
    ids[:] = pad_id
    if len(tokens):
        ids[np.arange(max_seq_length)[None] < lengths[:, None]] = np.concatenate(tokens)
    rows["lengths"][:] = lengths
    rows["b_starts"][:] = b_starts
    rows["next_sentence_labels"][:] = is_random_next
    return rows


class ShardWriter:
    """Writes `rows` rows of every stored array to `directory`/NAME.npy, chunk by chunk (the
    .npy header first, so nothing is held beyond one chunk)."""

    def __init__(
        self, directory: str, rows: int, max_seq_length: int, max_predictions: int, vocab_size: int
    ) -> None:
        os.makedirs(directory, exist_ok=True)
        dtypes = stored_dtypes(max_seq_length, max_predictions, vocab_size)
        shapes = stored_shapes(max_seq_length, max_predictions)
        self.rows, self.written, self.files = rows, 0, {}
        for name in STORED:  # (a failed write, e.g. a full disk, names its file)
            path = os.path.join(directory, name + ".npy")
            with files.naming(path):
                f = open(path, "wb")  # noqa: SIM115 (kept in self.files: close() closes it)
                np.lib.format.write_array_header_1_0(
                    f,
                    {
                        "descr": np.lib.format.dtype_to_descr(dtypes[name]),
                        "fortran_order": False,
                        "shape": (rows,) + shapes[name],
                    },
                )
            self.files[name] = f

    def write(self, chunk: dict[str, np.ndarray]) -> None:
        for name, f in self.files.items():
            with files.naming(f.name):
                f.write(np.ascontiguousarray(chunk[name]).tobytes())
        self.written += len(chunk["lengths"])

    def close(self) -> None:
        for f in self.files.values():
            with files.naming(f.name):
                f.close()
        if self.written != self.rows:
            raise RuntimeError(f"wrote {self.written} rows of {self.rows}")


def expand(stored: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fixed-shape int32/float32 features of stored rows (other arrays pass through)."""
    ids = np.asarray(stored["input_ids"]).astype(np.int32)
    lengths = np.asarray(stored["lengths"]).astype(np.int32)[:, None]
    b_starts = np.asarray(stored["b_starts"]).astype(np.int32)[:, None]
    steps = np.arange(ids.shape[1], dtype=np.int32)[None]
    counts = np.asarray(stored["num_predictions"]).astype(np.int32)[:, None]
    slots = np.arange(stored["masked_lm_ids"].shape[1], dtype=np.int32)[None]
    features = {
        "input_ids": ids,
        "input_mask": (steps < lengths).astype(np.int32),
        "segment_ids": ((steps >= b_starts) & (steps < lengths)).astype(np.int32),
        "masked_lm_positions": np.asarray(stored["masked_lm_positions"]).astype(np.int32),
        "masked_lm_ids": np.asarray(stored["masked_lm_ids"]).astype(np.int32),
        "masked_lm_weights": (slots < counts).astype(np.float32),
        "next_sentence_labels": np.asarray(stored["next_sentence_labels"]).astype(np.int32),
    }
    return {
        **features,
        **{k: np.asarray(v) for k, v in stored.items() if k not in STORED and k not in FEATURES},
    }


def empty_stored(
    max_seq_length: int, max_predictions: int, vocab_size: int = 2
) -> dict[str, np.ndarray]:
    """Zero rows of every stored array."""
    return unmasked_rows([], [], [], max_seq_length, max_predictions, vocab_size, 0)


class PreparedSplit:
    """One split's instances as shards of stored arrays (in memory, or `shard_reader.RowFile`s
    read on demand: the rows of each shard this split serves, e.g. one host's share), and
    whether masks are stored (static masking) or drawn by the loader (dynamic). `take` and
    `features` give `FEATURES`."""

    def __init__(self, shards: Sequence[dict[str, np.ndarray]], masked: bool) -> None:
        self.shards, self.masked = list(shards), masked
        self._offsets = np.cumsum([0] + [len(shard["lengths"]) for shard in self.shards])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def stored(self) -> dict[str, np.ndarray]:
        """All rows' stored arrays, concatenated."""
        return {
            name: np.concatenate([np.asarray(shard[name]) for shard in self.shards])
            for name in self.shards[0]
        }

    @property
    def features(self) -> dict[str, np.ndarray]:
        """All rows as one array per feature."""
        return expand(self.stored)

    def lengths(self) -> np.ndarray:
        """Real tokens of every row (int64)."""
        return np.concatenate([np.asarray(shard["lengths"], np.int64) for shard in self.shards])

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `rows` (global indices) of every feature, gathered across shards."""
        rows = np.asarray(rows)
        shard_of_row = np.searchsorted(self._offsets, rows, side="right") - 1
        out = {
            name: np.empty((len(rows), *array.shape[1:]), array.dtype)
            for name, array in self.shards[0].items()
        }
        for shard_index in np.unique(shard_of_row):
            selected = shard_of_row == shard_index
            local_rows = rows[selected] - self._offsets[shard_index]
            for name, array in self.shards[shard_index].items():
                out[name][selected] = array[local_rows]
        return expand(out)
