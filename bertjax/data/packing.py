"""Packed rows (`data.packing`): several whole pretraining instances per row of max_seq_length.

The original pads every instance to the full length; packing puts whole instances (each still
`[CLS] A [SEP] B [SEP]` with its own segment ids) one after another into a row, so that no
step computes on padding that another instance could fill. Each token carries its instance's
number (`instance_ids` 1..K, 0 at padding: attention is block-diagonal, see
`bertjax.models.attention.Mask`) and its position within the instance (`position_ids`, from 0), the
masked-LM positions are shifted to the row, and every instance keeps its own next-sentence
prediction, read from its own [CLS] (`next_sentence_positions`, `next_sentence_labels`,
`next_sentence_weights` [K], weight 0 for empty slots).

Which instances share a row is decided per epoch from the instance lengths alone: best-fit
decreasing on the length histogram (`packing_strategies`, independent of the order) gives the
same row shapes every epoch, so an epoch always has the same number of rows; the epoch's
shuffled order decides which instance of a length fills which slot, and the rows are shuffled
again. Batch k is therefore a pure function of (seed, k), as unpacked, and masks drawn
dynamically are those the instance gets unpacked (the same (seed, epoch, instance) RNG).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from bertjax.data import batch as batch_spec
from bertjax.data.pipeline import DataError, PreparedSplit


class InstanceSource(Protocol):
    """What packing needs of `loaders.BatchLoader`: the split and the instances of an epoch."""

    split: PreparedSplit
    global_batch_size: int
    local_batch_size: int
    seed: int
    shuffle: bool

    def mine(self, global_rows: np.ndarray) -> np.ndarray: ...

    def features(self, rows: np.ndarray, epoch: int) -> dict[str, np.ndarray]: ...


def predictions_per_row(
    max_seq_length: int, max_predictions_per_seq: int, masked_lm_prob: float, max_instances: int
) -> int:
    """Masked-LM slots of a packed row: the most its instances can hold. Each instance masks
    min(max_predictions, max(1, round(length * prob))) <= length * prob + 1 tokens, so K
    instances of at most max_seq_length tokens in all mask at most that many."""
    return min(
        max_instances * max_predictions_per_seq,
        int(max_seq_length * masked_lm_prob) + max_instances,
    )


def packing_strategies(
    histogram: np.ndarray, max_length: int, max_instances: int
) -> list[tuple[tuple[int, ...], int]]:
    """Best-fit decreasing on a length histogram (`histogram[n]` instances of n tokens): the
    rows as `(instance lengths, number of such rows)`. Instances are placed longest first, each
    into the open row with the least room that still fits it (a new row if none does), at most
    `max_instances` per row; equal instances and equal rows are handled as groups."""
    open_rows: dict[int, list[list[Any]]] = collections.defaultdict(list)  # room -> [rows, lengths]
    full: list[tuple[tuple[int, ...], int]] = []
    for length in range(max_length, 0, -1):
        remaining = int(histogram[length]) if length < len(histogram) else 0
        lengths: tuple[int, ...]
        while remaining:
            room = next((r for r in range(length, max_length + 1) if open_rows.get(r)), None)
            if room is None:
                available, lengths, room = remaining, (), max_length
            else:
                available, lengths = open_rows[room].pop()
            # A row stays the best fit while it has room: it takes as many as fit.
            per_row = min(room // length, max_instances - len(lengths))
            taken = min(per_row, remaining)
            rows = min(available, remaining // taken)
            if available > rows:
                open_rows[room].append([available - rows, lengths])
            remaining -= rows * taken
            lengths, room = lengths + (length,) * taken, room - taken * length
            if len(lengths) == max_instances or room == 0:
                full.append((lengths, rows))
            else:
                open_rows[room].append([rows, lengths])
    return full + [(lengths, rows) for groups in open_rows.values() for rows, lengths in groups]


def plan_rows(
    lengths: np.ndarray, order: np.ndarray, max_length: int, max_instances: int
) -> np.ndarray:
    """The instances of each row `[R, K]` (-1 = empty slot): `packing_strategies` on the
    histogram of `lengths`, slots of each length filled in `order`."""
    histogram = np.bincount(lengths, minlength=max_length + 1)
    strategies = packing_strategies(histogram, max_length, max_instances)
    by_length = order[np.argsort(lengths[order], kind="stable")]
    next_of_length = np.concatenate([[0], np.cumsum(histogram)])  # start of each length
    rows = np.full((sum(count for _, count in strategies), max_instances), -1, np.int64)
    start = 0
    for lengths_of_row, count in strategies:
        for slot, length in enumerate(lengths_of_row):
            first = next_of_length[length]
            rows[start : start + count, slot] = by_length[first : first + count]
            next_of_length[length] += count
        start += count
    return rows


@dataclasses.dataclass(frozen=True)
class PackingStats:
    """How full the rows are, unpacked and packed (padding: share of token slots)."""

    instances: int
    rows: int
    real_tokens: int
    max_seq_length: int

    @property
    def instances_per_row(self) -> float:
        return self.instances / max(self.rows, 1)

    @property
    def padding_unpacked(self) -> float:
        return 1.0 - self.real_tokens / max(self.instances * self.max_seq_length, 1)

    @property
    def padding_packed(self) -> float:
        return 1.0 - self.real_tokens / max(self.rows * self.max_seq_length, 1)

    def summary(self) -> str:
        return (
            f"{self.instances:,} instances in {self.rows:,} rows of {self.max_seq_length} "
            f"tokens: {self.instances_per_row:.2f} instances per row, padding "
            f"{self.padding_unpacked:.1%} unpacked -> {self.padding_packed:.1%} packed"
        )


def instance_lengths(split: PreparedSplit) -> np.ndarray:
    """Real tokens of every instance of `split`, read shard by shard."""
    return split.lengths()


class PackedLoader:
    """Deterministic, resumable batches of packed rows over `source`'s instances (the same
    interface as `loaders.BatchLoader`: `batch(k)`, `batches_per_epoch`, iteration); `stats`
    says how full the rows are. Rows of `max_seq_length` hold at most `max_instances`
    instances and `max_predictions` masked positions (`predictions_per_row`)."""

    def __init__(
        self,
        source: InstanceSource,
        max_seq_length: int,
        max_instances: int,
        max_predictions: int,
        pad_id: int,
    ) -> None:
        if max_instances < 1:
            raise DataError(f"data.packing_max_instances={max_instances} must be at least 1")
        self.source, self.max_seq_length, self.pad_id = source, max_seq_length, pad_id
        self.max_instances, self.max_predictions = max_instances, max_predictions
        self.lengths = instance_lengths(source.split)
        self.global_batch_size = source.global_batch_size
        self.local_batch_size = source.local_batch_size
        self._epoch, self._rows = 0, self._plan(0)
        self.stats = PackingStats(
            len(self.lengths), len(self._rows), int(self.lengths.sum()), max_seq_length
        )
        self.batches_per_epoch = len(self._rows) // self.global_batch_size

    def _plan(self, epoch: int) -> np.ndarray:
        """The rows of `epoch`, in training order."""
        seed, count = self.source.seed, len(self.lengths)
        shuffle = self.source.shuffle
        order = (
            np.random.default_rng([seed, epoch]).permutation(count) if shuffle else np.arange(count)
        )
        rows = plan_rows(self.lengths, order, self.max_seq_length, self.max_instances)
        return np.random.default_rng([seed, epoch, 1]).permutation(rows) if shuffle else rows

    def rows_of(self, index: int) -> tuple[int, np.ndarray]:
        """The epoch of batch `index` and the instances of this process's rows of it
        `[local batch, K]` (-1: empty)."""
        epoch, within = divmod(index, self.batches_per_epoch)
        if epoch != self._epoch:
            self._epoch, self._rows = epoch, self._plan(epoch)
        size = self.global_batch_size
        return epoch, self.source.mine(self._rows[within * size : (within + 1) * size])

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """The `index`-th batch of packed rows (0-based, counting across epochs)."""
        epoch, plan = self.rows_of(index)
        instances = self.source.features(plan[plan >= 0], epoch)
        return pack(instances, plan, self.max_predictions, self.pad_id)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1


def pack(
    instances: dict[str, np.ndarray], plan: np.ndarray, max_predictions: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Packs unpacked instance features (the rows `plan[plan >= 0]`, in that order) into the
    rows of `plan` `[R, K]`: tokens one instance after another, MLM positions shifted."""
    num_rows, max_instances = plan.shape
    length = instances["input_ids"].shape[1]
    out = batch_spec.zeros(num_rows, length, max_predictions, max_instances)
    out["input_ids"][:] = pad_id
    real = instances["input_mask"].sum(axis=1)
    member = 0
    for row, slots in enumerate(plan):
        offset = predicted = 0
        for slot in np.flatnonzero(slots >= 0):
            size, span = int(real[member]), slice(offset, offset + int(real[member]))
            if offset + size > length:
                raise DataError(
                    f"packed row {row} needs {offset + size} tokens, more than {length}"
                )
            for name in ("input_ids", "input_mask", "segment_ids"):
                out[name][row, span] = instances[name][member, :size]
            out["position_ids"][row, span] = np.arange(size)
            out["instance_ids"][row, span] = slot + 1
            count = int(np.count_nonzero(instances["masked_lm_weights"][member]))
            if predicted + count > max_predictions:
                raise DataError(
                    f"a packed row needs {predicted + count} masked-LM slots, more "
                    f"than its {max_predictions}"
                )
            targets = slice(predicted, predicted + count)
            out["masked_lm_positions"][row, targets] = (
                instances["masked_lm_positions"][member, :count] + offset
            )
            out["masked_lm_ids"][row, targets] = instances["masked_lm_ids"][member, :count]
            out["masked_lm_weights"][row, targets] = 1.0
            out["next_sentence_positions"][row, slot] = offset
            out["next_sentence_labels"][row, slot] = instances["next_sentence_labels"][member]
            out["next_sentence_weights"][row, slot] = 1.0
            offset, predicted, member = offset + size, predicted + count, member + 1
    return out
