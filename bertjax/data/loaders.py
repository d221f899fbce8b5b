"""Deterministic, resumable batches from prepared splits: `BatchLoader` (one split, dynamic
masking per row) and `prepare_data` (every phase's train/eval loaders for this process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax
import numpy as np
from absl import logging

from bertjax.data import (
    corpus_source,
    instances,
    masking as mask_rules,
    packing,
    pipeline,
    shard_job,
    tokenization,
)
from bertjax.data.batch import PhaseShape
from bertjax.data.pipeline import DataError, PreparedSplit
from bertjax.data.settings import DataSettings
from bertjax.runtime import console


class BatchLoader:
    """Deterministic, resumable batches: this process's rows of every global batch.

    Global batch k holds the same instances whatever the number of processes: `batch(k)`
    depends only on (seed, k); epochs reshuffle the whole split with a permutation seeded by
    (seed, epoch), and the remainder of an epoch that does not fill a global batch is
    dropped. Process i of P (`share` = (i, P)) reads rows [i*B/P, (i+1)*B/P) of each global
    batch of B rows; a row's dynamic mask depends on its instance and epoch, not on the
    process.
    """

    def __init__(
        self,
        split: PreparedSplit,
        global_batch_size: int,
        seed: int,
        shuffle: bool = True,
        masking: tuple[instances.SpecialTokens, float, int, bool] | None = None,
        name: str = "train",
        mask_mix: tuple[float, float] = mask_rules.PAPER_MASK_MIX,
        share: tuple[int, int] = (0, 1),
    ) -> None:
        if len(split) < global_batch_size:
            raise DataError(
                f"the {name} split has {len(split)} sequences, fewer than one batch of "
                f"{global_batch_size}: use a larger corpus, a higher dupe_factor, or a "
                "smaller train.global_batch_size"
            )
        if not split.masked and masking is None:
            raise ValueError("an unmasked split needs masking parameters (dynamic masking)")
        self.split, self.global_batch_size, self.seed = split, global_batch_size, seed
        self.shuffle, self.share = shuffle, share
        self.local_batch_size = global_batch_size // share[1]
        self.rule = None if masking is None else mask_rules.MaskingRule(*masking, mask_mix)
        self.batches_per_epoch = len(split) // global_batch_size
        self._order_epoch, self._order = -1, np.arange(len(split))

    def mine(self, global_rows: np.ndarray) -> np.ndarray:
        """This process's rows of a global batch's `global_rows`."""
        start = self.share[0] * self.local_batch_size
        return global_rows[start : start + self.local_batch_size]

    def _rows(self, index: int) -> tuple[int, np.ndarray]:
        epoch, within = divmod(index, self.batches_per_epoch)
        if self.shuffle and epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.split))
            self._order_epoch = epoch
        start = within * self.global_batch_size
        return epoch, self.mine(self._order[start : start + self.global_batch_size])

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """The `index`-th batch (0-based, counting across epochs)."""
        epoch, rows = self._rows(index)
        return self.features(rows, epoch)

    def features(self, rows: np.ndarray, epoch: int) -> dict[str, np.ndarray]:
        """Rows `rows` of the split as trained in `epoch` (masked dynamically if so configured)."""
        batch = self.split.take(rows)
        if not self.split.masked:
            self._mask_dynamically(batch, rows, epoch)
        return batch

    def _mask_dynamically(self, batch: dict[str, np.ndarray], rows: np.ndarray, epoch: int) -> None:
        """Masks `batch` in place: row r of epoch e draws from the stream (seed, e) at r."""
        assert self.rule is not None, "an unmasked split's loader is given its masking"
        ids, positions, labels, counts = self.rule.apply(
            batch["input_ids"],
            batch["input_mask"].sum(axis=1),
            shard_job.hash_seed(self.seed, epoch),
            rows,
        )
        batch["input_ids"] = ids
        batch["masked_lm_positions"], batch["masked_lm_ids"] = positions, labels
        slots = np.arange(positions.shape[1])[None]
        batch["masked_lm_weights"] = (slots < counts[:, None]).astype(np.float32)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1


Loader = BatchLoader | packing.PackedLoader


@dataclasses.dataclass
class PhaseData:
    phase: PhaseShape
    train: Loader
    eval: Loader | None


def packed_loaders(
    train: BatchLoader,
    held_out: BatchLoader | None,
    data: DataSettings,
    phase: PhaseShape,
    pad_id: int,
) -> tuple[Loader, Loader | None]:
    """The train and eval loaders' instances packed into rows (`data.packing`), with how full
    the rows are printed; the eval loader is dropped if it packs into less than one batch."""
    max_instances = data.packing_max_instances
    predictions = packing.predictions_per_row(
        phase.max_seq_length, phase.max_predictions_per_seq, data.masked_lm_prob, max_instances
    )
    loaders: list[packing.PackedLoader | None] = []
    for name, loader in (("train", train), ("eval", held_out)):
        if loader is None:
            loaders.append(None)
            continue
        packed = packing.PackedLoader(
            loader, phase.max_seq_length, max_instances, predictions, pad_id
        )
        # (a printed line reaches the run's log file too)
        console.chief_print(f"Packing {phase.name} {name}: {packed.stats.summary()}")
        loaders.append(packed)
    packed_train, packed_eval = loaders
    assert packed_train is not None
    if not packed_train.batches_per_epoch:
        raise DataError(
            f"the {phase.name} train split packs into {packed_train.stats.rows} "
            f"rows, fewer than one batch of {packed_train.global_batch_size}: use a larger corpus, a higher dupe_factor, or a smaller "
            "train.global_batch_size"
        )
    if packed_eval is not None and not packed_eval.batches_per_epoch:
        packed_eval = None
    return packed_train, packed_eval


def prepare_data(
    data: DataSettings,
    phases: Sequence[PhaseShape],
    vocab_size: int,
    tokenizer: tokenization.Tokenizer,
    cache_dir: str,
    process_index: int | None = None,
    process_count: int | None = None,
    next_sentence_prediction: bool = True,
) -> list[PhaseData]:
    """Prepares (or loads from cache) every phase's splits, the same on every process, checks
    their token ids against the model's `vocab_size`, and gives each phase's loaders of this
    process's rows of every global batch (process `process_index` of `process_count`, default
    this one's). `next_sentence_prediction=False`: instances without random-B pairs
    (pipeline.prepare)."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    share = (process_index, process_count)
    derived = corpus_source.Derived(data, tokenizer)  # (once for every phase)
    specials = derived.specials
    result = []
    for phase in phases:
        splits = pipeline.prepare(
            data, phase, tokenizer, cache_dir, next_sentence_prediction, derived
        )
        for name, split in splits.items():
            pipeline.check_token_ids(split, vocab_size, f"{name} data ({phase.name})")
        batch = phase.global_batch_size
        masking = (
            specials,
            data.masked_lm_prob,
            phase.max_predictions_per_seq,
            data.whole_word_mask,
        )
        train_loader = BatchLoader(
            splits["train"],
            batch,
            data.seed,
            masking=masking,
            name=f"{phase.name} train",
            mask_mix=data.mask_mix,
            share=share,
        )
        eval_loader = None
        if len(splits["eval"]) >= batch:
            eval_loader = BatchLoader(
                splits["eval"],
                batch,
                data.seed,
                shuffle=False,
                name=f"{phase.name} eval",
                share=share,
            )
        loaders: tuple[Loader, Loader | None] = (train_loader, eval_loader)
        if data.packing:
            loaders = packed_loaders(train_loader, eval_loader, data, phase, specials.pad_id)
        if loaders[1] is None:
            logging.warning(
                "phase %s: %d held-out sequences, fewer than one batch of %d: "
                "evaluation skipped (raise data.eval_fraction)",
                phase.name,
                len(splits["eval"]),
                batch,
            )
        result.append(PhaseData(phase, *loaders))
    return result
