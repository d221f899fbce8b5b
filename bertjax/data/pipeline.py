"""From a data config to batches: corpus -> tokens -> prepared instances -> resumable batches.

Each process reads its own shard of the documents (document i goes to process i mod P),
prepares pretraining instances from it once (cached on local disk as .npy files, written
atomically), and serves fixed-shape batches of `global_batch_size / P` rows. Batch k is a
pure function of (seed, k): the epoch's permutation comes from (seed, epoch) and dynamic
masks from (seed, epoch, row). The data position saved in a checkpoint is therefore just
the next batch index, and a resumed run sees exactly the batches an uninterrupted run
would have seen.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from absl import logging

from bertjax import tokenization
from bertjax.data import corpus, instances

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")
FORMAT_VERSION = 1  # bump when the prepared layout or instance semantics change


class DataError(ValueError):
    """Input data that cannot be used, with a message saying what to change."""


@dataclasses.dataclass(frozen=True)
class Phase:
    """A contiguous range of steps trained at one sequence length."""

    name: str
    max_seq_length: int
    max_predictions_per_seq: int
    global_batch_size: int
    start_step: int
    end_step: int


def phases_from_config(config: Any) -> list[Phase]:
    """The paper's schedule: `1 - long_phase.fraction` of the steps at data.max_seq_length,
    the rest at long_phase.max_seq_length (one optimizer and learning-rate schedule)."""
    total = config.train.total_steps
    long_steps = int(round(total * config.long_phase.fraction))
    short = Phase("short", config.data.max_seq_length, config.data.max_predictions_per_seq,
                  config.train.global_batch_size, 0, total - long_steps)
    phases = [short] if short.end_step > 0 else []
    if long_steps:
        phases.append(Phase("long", config.long_phase.max_seq_length,
                            config.long_phase.max_predictions_per_seq,
                            config.long_phase.global_batch_size or config.train.global_batch_size,
                            total - long_steps, total))
    return phases


def phase_at(phases: Sequence[Phase], step: int) -> Phase:
    """The phase that trains `step` (the last phase for steps past the end)."""
    for phase in phases:
        if step < phase.end_step:
            return phase
    return phases[-1]


# ----------------------------------------------------------------------------- corpus


def read_documents(data_cfg: Any, process_index: int, process_count: int,
                   stats: corpus.CorpusStats) -> Iterator[list[str]]:
    """Documents of this process's shard, from the configured source."""
    if data_cfg.source == "tfds":
        if not data_cfg.tfds_name:
            raise DataError("data.source=tfds needs --config.data.tfds_name=NAME")
        return corpus.read_tfds(data_cfg.tfds_name, data_cfg.tfds_split,
                                data_cfg.tfds_data_dir or None, data_cfg.tfds_text_key,
                                process_index, process_count, stats)
    if data_cfg.source == "text":
        if not data_cfg.input_files:
            raise DataError("data.source=text needs --config.data.input_files=PATH[,PATH...]")
        documents = corpus.read_text_files(data_cfg.input_files.split(","),
                                           data_cfg.text_format, stats)
    elif data_cfg.source == "default":
        documents = corpus.default_corpus(stats)
    else:
        raise DataError(f"data.source={data_cfg.source!r}; choose 'default', 'text' or 'tfds'")
    return (doc for i, doc in enumerate(documents) if i % process_count == process_index)


def _source_fingerprint(data_cfg: Any) -> dict[str, Any]:
    """What identifies the raw corpus, for the prepared-data cache key."""
    if data_cfg.source == "text":
        if not data_cfg.input_files:
            raise DataError("data.source=text needs --config.data.input_files=PATH[,PATH...]")
        files = corpus.expand_paths(data_cfg.input_files.split(","))
        return {"files": [(f, os.path.getsize(f), int(os.path.getmtime(f))) for f in files],
                "format": data_cfg.text_format}
    if data_cfg.source == "tfds":
        return {"tfds": [data_cfg.tfds_name, data_cfg.tfds_split, data_cfg.tfds_data_dir,
                         data_cfg.tfds_text_key]}
    return {"default": sys.version}


def strip_accents_option(data_cfg: Any) -> bool | None:
    """`data.strip_accents`: "auto" follows do_lower_case (the original), else true/false."""
    value = str(data_cfg.strip_accents).lower()
    if value not in ("auto", "true", "false"):
        raise DataError(f"data.strip_accents={data_cfg.strip_accents!r}; use auto, true or false")
    return None if value == "auto" else value == "true"


def load_or_train_tokenizer(data_cfg: Any, cache_dir: str, process_index: int = 0,
                            process_count: int = 1) -> tokenization.Tokenizer:
    """The configured tokenizer; with sentencepiece and no vocab_file, one is trained on the
    corpus (once, cached) so the default run needs no download. Every process trains on the
    whole corpus, not its shard, so that all processes get the same vocabulary."""
    if data_cfg.vocab_file:
        if not os.path.exists(data_cfg.vocab_file):
            raise DataError(f"data.vocab_file={data_cfg.vocab_file!r} does not exist; pass a "
                            "Google vocab.txt (wordpiece) or a SentencePiece .model")
        return tokenization.load_tokenizer(data_cfg.tokenizer, data_cfg.vocab_file,
                                           data_cfg.do_lower_case, strip_accents_option(data_cfg))
    if data_cfg.tokenizer != "sentencepiece":
        raise DataError("data.tokenizer=wordpiece needs --config.data.vocab_file=vocab.txt "
                        "(or use data.tokenizer=sentencepiece to train one on the corpus)")
    key = _hash({"source": _source_fingerprint(data_cfg), "size": data_cfg.sentencepiece_vocab_size,
                 "lower": data_cfg.do_lower_case})
    prefix = os.path.join(cache_dir, f"sentencepiece_{key}")
    if not os.path.exists(prefix + ".model"):
        logging.info("Training a SentencePiece model (%d tokens) on the corpus -> %s.model",
                     data_cfg.sentencepiece_vocab_size, prefix)
        os.makedirs(cache_dir, exist_ok=True)
        sentences = (s for doc in read_documents(data_cfg, 0, 1, corpus.CorpusStats())
                     for s in doc)
        tmp_prefix = f"{prefix}.tmp{os.getpid()}"
        try:
            tokenization.train_sentencepiece(sentences, tmp_prefix,
                                             data_cfg.sentencepiece_vocab_size,
                                             do_lower_case=data_cfg.do_lower_case)
        except ValueError as e:
            raise DataError(f"could not train a SentencePiece model on the corpus: {e}") from e
        for ext in (".model", ".vocab"):
            os.replace(tmp_prefix + ext, prefix + ext)
    return tokenization.SentencePieceTokenizer(prefix + ".model")


# ----------------------------------------------------------------------------- preparation


@dataclasses.dataclass
class PreparedSplit:
    """Fixed-shape features of one split (memory-mapped), and whether masks are stored."""

    features: dict[str, np.ndarray]
    masked: bool

    def __len__(self) -> int:
        return len(self.features["input_ids"])


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def specials_of(tokenizer: tokenization.Tokenizer, whole_word_mask: bool) -> instances.SpecialTokens:
    return instances.SpecialTokens(
        cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, mask_id=tokenizer.mask_id,
        pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
        never_mask=tokenizer.special_ids(),
        continuation=tokenizer.continuation_mask() if whole_word_mask else None)


def tokenize_documents(documents: Iterable[list[str]], tokenizer: tokenization.Tokenizer,
                       ) -> tuple[list[list[list[int]]], dict[str, int]]:
    """Token ids per sentence; empty sentences and documents are dropped and counted."""
    tokenized, counts = [], {"empty_sentences": 0, "empty_documents": 0, "tokens": 0}
    for document in documents:
        sentences = []
        for sentence in document:
            ids = tokenizer.encode(sentence)
            if ids:
                sentences.append(ids)
                counts["tokens"] += len(ids)
            else:
                counts["empty_sentences"] += 1
        if sentences:
            tokenized.append(sentences)
        else:
            counts["empty_documents"] += 1
    return tokenized, counts


def split_eval_documents(documents: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Holds out a seeded random `eval_fraction` of documents (at least one if any)."""
    if eval_fraction <= 0 or len(documents) < 2:
        return documents, []
    order = np.random.default_rng([seed, 1]).permutation(len(documents))
    num_eval = max(1, int(round(len(documents) * eval_fraction)))
    eval_ids = set(order[:num_eval].tolist())
    train = [d for i, d in enumerate(documents) if i not in eval_ids]
    return train, [d for i, d in enumerate(documents) if i in eval_ids]


def make_features(documents: list[list[list[int]]], phase: Phase, data_cfg: Any,
                  specials: instances.SpecialTokens, dupe_factor: int, mask: bool,
                  seed: int) -> dict[str, np.ndarray]:
    """Instances with the original semantics, masked now (static) or left for the loader."""
    rng = random.Random(seed)
    created = instances.create_instances(documents, phase.max_seq_length, data_cfg.short_seq_prob,
                                         dupe_factor, rng, specials)
    rows = []
    for instance in created:
        if mask:
            tokens, positions, labels = instances.mask_tokens(
                instance.tokens, rng, data_cfg.masked_lm_prob, phase.max_predictions_per_seq,
                specials, data_cfg.whole_word_mask)
        else:
            tokens, positions, labels = instance.tokens, np.zeros(0, np.int32), np.zeros(0, np.int32)
        rows.append(instances.to_features(tokens, instance.segment_ids, instance.is_random_next,
                                          positions, labels, phase.max_seq_length,
                                          phase.max_predictions_per_seq, specials.pad_id))
    if not rows:
        return {}
    return {name: np.stack([row[name] for row in rows]) for name in FEATURES}


def _save_split(directory: str, features: dict[str, np.ndarray]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, array in features.items():
        np.save(os.path.join(directory, name + ".npy"), array)


def _load_split(directory: str, masked: bool) -> PreparedSplit:
    features = {name: np.load(os.path.join(directory, name + ".npy"), mmap_mode="r")
                for name in FEATURES}
    return PreparedSplit(features, masked)


def prepare(config: Any, phase: Phase, tokenizer: tokenization.Tokenizer, cache_dir: str,
            process_index: int = 0, process_count: int = 1) -> dict[str, PreparedSplit]:
    """Prepared `train` and `eval` splits for `phase`, built once and cached under cache_dir."""
    data_cfg = config.data
    dynamic = _masking_is_dynamic(data_cfg)
    key = _hash({"version": FORMAT_VERSION, "source": _source_fingerprint(data_cfg),
                 "tokenizer": tokenizer.fingerprint(), "phase": [phase.max_seq_length,
                                                                 phase.max_predictions_per_seq],
                 "data": {k: data_cfg[k] for k in ("masked_lm_prob", "short_seq_prob", "dupe_factor",
                                                   "masking", "whole_word_mask", "eval_fraction",
                                                   "seed")},
                 "shard": [process_index, process_count]})
    directory = os.path.join(cache_dir, f"{phase.name}_{phase.max_seq_length}_{key}")
    if not os.path.exists(os.path.join(directory, "meta.json")):
        _build(directory, config, phase, tokenizer, dynamic, process_index, process_count)
    with open(os.path.join(directory, "meta.json")) as f:
        logging.info("Prepared data %s: %s", directory, json.load(f))
    return {"train": _load_split(os.path.join(directory, "train"), masked=not dynamic),
            "eval": _load_split(os.path.join(directory, "eval"), masked=True)}


def _masking_is_dynamic(data_cfg: Any) -> bool:
    if data_cfg.masking not in ("static", "dynamic"):
        raise DataError(f"data.masking={data_cfg.masking!r}; choose 'static' or 'dynamic'")
    return data_cfg.masking == "dynamic"


def _build(directory: str, config: Any, phase: Phase, tokenizer: tokenization.Tokenizer,
           dynamic: bool, process_index: int, process_count: int) -> None:
    """Reads, tokenizes, splits and instantiates the corpus; writes it atomically."""
    data_cfg, start = config.data, time.time()
    stats = corpus.CorpusStats()
    documents, counts = tokenize_documents(
        read_documents(data_cfg, process_index, process_count, stats), tokenizer)
    logging.info("Corpus: %s; tokenized: %s", stats.summary(), counts)
    if not documents:
        raise DataError(f"the corpus ({data_cfg.source}) has no usable documents after reading "
                        f"and tokenizing ({stats.summary()}); check data.input_files / tfds_name")
    train_docs, eval_docs = split_eval_documents(documents, data_cfg.eval_fraction, data_cfg.seed)
    specials = specials_of(tokenizer, data_cfg.whole_word_mask)
    seed = data_cfg.seed + 1000 * process_index + phase.max_seq_length
    train = make_features(train_docs, phase, data_cfg, specials, data_cfg.dupe_factor,
                          mask=not dynamic, seed=seed)
    evaluation = make_features(eval_docs, phase, data_cfg, specials, 1, mask=True, seed=seed + 1)
    if not train:
        raise DataError(f"the corpus gave no training instances at length {phase.max_seq_length}")
    tmp = f"{directory}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    _save_split(os.path.join(tmp, "train"), train)
    _save_split(os.path.join(tmp, "eval"), evaluation or {k: v[:0] for k, v in train.items()})
    meta = {"train_instances": len(train["input_ids"]),
            "eval_instances": len(evaluation.get("input_ids", [])),
            "documents": len(documents), "eval_documents": len(eval_docs), **counts,
            "masking": data_cfg.masking, "seconds": round(time.time() - start, 1)}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


# ----------------------------------------------------------------------------- loading


class BatchLoader:
    """Deterministic, resumable batches of this process's rows.

    `batch(k)` depends only on (seed, k); epochs reshuffle with a permutation seeded by
    (seed, epoch); the remainder of an epoch that does not fill a batch is dropped.
    """

    def __init__(self, split: PreparedSplit, local_batch_size: int, seed: int, shuffle: bool = True,
                 masking: tuple[instances.SpecialTokens, float, int, bool] | None = None,
                 name: str = "train"):
        if len(split) < local_batch_size:
            raise DataError(
                f"the {name} split has {len(split)} sequences, fewer than one batch of "
                f"{local_batch_size} per process: use a larger corpus, a higher dupe_factor, or a "
                "smaller train.global_batch_size")
        if not split.masked and masking is None:
            raise ValueError("an unmasked split needs masking parameters (dynamic masking)")
        self.split, self.local_batch_size, self.seed = split, local_batch_size, seed
        self.shuffle, self.masking = shuffle, masking
        self.batches_per_epoch = len(split) // local_batch_size
        self._order_epoch, self._order = -1, np.arange(len(split))

    def _rows(self, index: int) -> tuple[int, np.ndarray]:
        epoch, within = divmod(index, self.batches_per_epoch)
        if self.shuffle and epoch != self._order_epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.split))
            self._order_epoch = epoch
        start = within * self.local_batch_size
        return epoch, self._order[start:start + self.local_batch_size]

    def batch(self, index: int) -> dict[str, np.ndarray]:
        """The `index`-th batch (0-based, counting across epochs)."""
        epoch, rows = self._rows(index)
        batch = {name: np.asarray(array[rows]) for name, array in self.split.features.items()}
        if not self.split.masked:
            self._mask_dynamically(batch, rows, epoch)
        return batch

    def _mask_dynamically(self, batch: dict[str, np.ndarray], rows: np.ndarray, epoch: int) -> None:
        specials, prob, max_predictions, whole_word = self.masking
        for i, row in enumerate(rows):
            length = int(batch["input_mask"][i].sum())
            tokens, positions, labels = instances.mask_tokens(
                batch["input_ids"][i, :length], instances.instance_rng(self.seed, epoch, int(row)),
                prob, max_predictions, specials, whole_word)
            batch["input_ids"][i, :length] = tokens
            count = len(positions)
            for name, values in (("masked_lm_positions", positions), ("masked_lm_ids", labels)):
                batch[name][i] = 0
                batch[name][i, :count] = values
            batch["masked_lm_weights"][i] = 0.0
            batch["masked_lm_weights"][i, :count] = 1.0

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        index = 0
        while True:
            yield self.batch(index)
            index += 1


def check_token_ids(split: PreparedSplit, vocab_size: int, what: str) -> None:
    """Fails before training if any token id is outside the model's vocabulary (it would
    silently produce NaNs in the embedding lookup)."""
    for name in ("input_ids", "masked_lm_ids"):
        array = split.features[name]
        if len(array) and int(array.max()) >= vocab_size:
            raise DataError(f"{what}: {name} holds id {int(array.max())} >= model.vocab_size="
                            f"{vocab_size}; set --config.model.vocab_size to the tokenizer's size")
