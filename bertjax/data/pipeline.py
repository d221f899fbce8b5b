"""From a data config to prepared instances: corpus -> tokens -> instances -> shards on disk
(batches from them: `data.loaders`).

Each process reads its own shard of the documents (document i goes to process i mod P),
prepares pretraining instances from it once (cached on local disk as .npy files, written
atomically), and serves fixed-shape batches of `global_batch_size / P` rows. Batch k is a
pure function of (seed, k): the epoch's permutation comes from (seed, epoch) and dynamic
masks from (seed, epoch, row). The data position saved in a checkpoint is therefore just
the next batch index, and a resumed run sees exactly the batches an uninterrupted run
would have seen.
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import time
from typing import Any, Iterable, Iterator

import numpy as np
from absl import logging

from bertjax import files, locks
from bertjax.data import tokenization
from bertjax.data import corpus, default_corpus, instances, tfds_source, tokenize_corpus
from bertjax.schedule import Phase

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids",
            "masked_lm_weights", "next_sentence_labels")
FORMAT_VERSION = 3  # bump when the prepared layout or instance semantics change


class DataError(ValueError):
    """Input data that cannot be used, with a message saying what to change."""


# ----------------------------------------------------------------------------- corpus


def read_documents(data_cfg: Any, process_index: int, process_count: int,
                   stats: corpus.CorpusStats) -> Iterator[list[str]]:
    """Documents of this process's shard, from the configured source."""
    if data_cfg.source == "tfds":
        if not data_cfg.tfds_name:
            raise DataError("data.source=tfds needs --config.data.tfds_name=NAME")
        return tfds_source.read_tfds(data_cfg.tfds_name, data_cfg.tfds_split,
                                data_cfg.tfds_data_dir or None, data_cfg.tfds_text_key,
                                process_index, process_count, stats)
    if data_cfg.source == "text":
        if not data_cfg.input_files:
            raise DataError("data.source=text needs --config.data.input_files=PATH[,PATH...]")
        documents = corpus.read_text_files(data_cfg.input_files.split(","),
                                           data_cfg.text_format, stats)
    elif data_cfg.source == "default":
        documents = default_corpus.default_corpus(stats)
    else:
        raise DataError(f"data.source={data_cfg.source!r}; choose 'default', 'text' or 'tfds'")
    return (doc for i, doc in enumerate(documents) if i % process_count == process_index)


def source_identity(data_cfg: Any) -> dict[str, Any]:
    """What identifies the raw corpus: files with their sizes, or the dataset's name."""
    if data_cfg.source == "text":
        if not data_cfg.input_files:
            raise DataError("data.source=text needs --config.data.input_files=PATH[,PATH...]")
        paths = corpus.expand_paths(data_cfg.input_files.split(","))
        return {"files": [(files.abspath(f), files.getsize(f)) for f in paths],
                "format": data_cfg.text_format}
    if data_cfg.source == "tfds":
        return {"tfds": [data_cfg.tfds_name, data_cfg.tfds_split, data_cfg.tfds_data_dir,
                         data_cfg.tfds_text_key]}
    return {"default": sys.version}


def _source_fingerprint(data_cfg: Any) -> dict[str, Any]:
    """The prepared-data cache key's view of the corpus: its identity plus file times."""
    identity = source_identity(data_cfg)
    if "files" in identity:
        identity["mtimes"] = [int(files.getmtime(f)) for f, _ in identity["files"]]
    return identity


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
        if not files.exists(data_cfg.vocab_file):
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

    def train() -> None:
        logging.info("Training a SentencePiece model (%d tokens) on the corpus -> %s.model",
                     data_cfg.sentencepiece_vocab_size, prefix)
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
    locks.build_once(prefix + ".model", prefix + ".model", train)
    try:
        return tokenization.SentencePieceTokenizer(prefix + ".model")
    except ValueError as e:  # truncated or replaced in the cache
        raise DataError(f"the cached SentencePiece model {prefix}.model is damaged ({e}); "
                        f"delete it and {prefix}.vocab to train it again") from e


# ----------------------------------------------------------------------------- preparation


@dataclasses.dataclass
class PreparedSplit:
    """Fixed-shape features of one split, as shards of memory-mapped arrays, and whether
    masks are stored (static masking) or drawn by the loader (dynamic)."""

    shards: list[dict[str, np.ndarray]]
    masked: bool

    def __post_init__(self):
        self._offsets = np.cumsum([0] + [len(shard["input_ids"]) for shard in self.shards])

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def features(self) -> dict[str, np.ndarray]:
        """All rows as one array per feature (copies unless there is a single shard)."""
        if len(self.shards) == 1:
            return self.shards[0]
        return {name: np.concatenate([shard[name] for shard in self.shards])
                for name in self.shards[0]}

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `rows` (global indices) of every feature, gathered across shards."""
        rows = np.asarray(rows)
        shard_of_row = np.searchsorted(self._offsets, rows, side="right") - 1
        out = {name: np.empty((len(rows),) + array.shape[1:], array.dtype)
               for name, array in self.shards[0].items()}
        for shard_index in np.unique(shard_of_row):
            selected = shard_of_row == shard_index
            local_rows = rows[selected] - self._offsets[shard_index]
            for name, array in self.shards[shard_index].items():
                out[name][selected] = array[local_rows]
        return out


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def specials_of(tokenizer: tokenization.Tokenizer, whole_word_mask: bool) -> instances.SpecialTokens:
    return instances.SpecialTokens(
        cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, mask_id=tokenizer.mask_id,
        pad_id=tokenizer.pad_id, vocab_size=tokenizer.vocab_size,
        never_mask=tokenizer.special_ids(),
        continuation=tokenizer.continuation_mask() if whole_word_mask else None)


def split_eval_documents(documents: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """Holds out a seeded random `eval_fraction` of documents (at least one if any)."""
    if eval_fraction <= 0 or len(documents) < 2:
        return documents, []
    order = np.random.default_rng([seed, 1]).permutation(len(documents))
    num_eval = max(1, int(round(len(documents) * eval_fraction)))
    eval_ids = set(order[:num_eval].tolist())
    train = [d for i, d in enumerate(documents) if i not in eval_ids]
    return train, [d for i, d in enumerate(documents) if i in eval_ids]


def mask_mix(data_cfg: Any) -> tuple[float, float]:
    """`(data.mask_token_prob, data.random_token_prob)`; DataError if not a valid mix."""
    mix = (data_cfg.mask_token_prob, data_cfg.random_token_prob)
    try:
        instances.check_mask_mix(*mix)
    except ValueError as e:
        raise DataError(f"data.{e}") from e
    return mix


def make_features(documents: list[list[np.ndarray]], phase: Phase, data_cfg: Any,
                  specials: instances.SpecialTokens, dupe_factor: int, mask: bool,
                  seed: int, next_sentence_prediction: bool = True) -> dict[str, np.ndarray]:
    """Instances with the original semantics, masked now (static) or left for the loader."""
    rng = random.Random(seed)
    created = instances.create_instances(documents, phase.max_seq_length, data_cfg.short_seq_prob,
                                         dupe_factor, rng, specials, next_sentence_prediction)
    rows = []
    for instance in created:
        if mask:
            tokens, positions, labels = instances.mask_tokens(
                instance.tokens, rng, data_cfg.masked_lm_prob, phase.max_predictions_per_seq,
                specials, data_cfg.whole_word_mask, mask_mix(data_cfg))
        else:
            tokens, positions, labels = instance.tokens, np.zeros(0, np.int32), np.zeros(0, np.int32)
        rows.append(instances.to_features(tokens, instance.segment_ids, instance.is_random_next,
                                          positions, labels, phase.max_seq_length,
                                          phase.max_predictions_per_seq, specials.pad_id))
    if not rows:
        return {}
    return {name: np.stack([row[name] for row in rows]) for name in FEATURES}


def _save_shard(directory: str, features: dict[str, np.ndarray]) -> None:
    os.makedirs(directory, exist_ok=True)
    for name, array in features.items():
        np.save(os.path.join(directory, name + ".npy"), array)


def _file_record(path: str) -> dict[str, Any]:
    """Size and SHA-256 of a prepared file, as recorded in meta.json and checked on load."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def _shard_records(directory: str) -> dict[str, dict[str, Any]]:
    """{"train/shard_00000/input_ids.npy": {rows, bytes, sha256}, ...} for every prepared file."""
    records = {}
    for split in ("train", "eval"):
        for shard in sorted(os.listdir(os.path.join(directory, split))):
            for name in FEATURES:
                relative = f"{split}/{shard}/{name}.npy"
                path = os.path.join(directory, relative)
                rows = len(np.load(path, mmap_mode="r"))
                records[relative] = {"rows": rows, **_file_record(path)}
    return records


def _load_split(directory: str, split: str, records: dict[str, dict[str, Any]],
                masked: bool) -> PreparedSplit:
    """Memory-maps the shards listed in meta.json after checking each file's size, checksum
    and row count, so a truncated or corrupted shard is named instead of trained on."""
    shards: dict[str, dict[str, np.ndarray]] = {}
    for relative, record in records.items():
        if not relative.startswith(split + "/"):
            continue
        path = os.path.join(directory, relative)
        problem = "missing" if not os.path.exists(path) else None
        if problem is None and _file_record(path) != {k: record[k] for k in ("bytes", "sha256")}:
            problem = f"changed since preparation ({record['bytes']} bytes, sha256 {record['sha256'][:12]}...)"
        if problem is None:
            try:
                array = np.load(path, mmap_mode="r")
            except ValueError as e:
                problem = f"unreadable ({e})"
            else:
                if len(array) != record["rows"]:
                    problem = f"holds {len(array)} rows, not {record['rows']}"
        if problem:
            raise DataError(f"prepared data file {path} is {problem}; delete {directory} to "
                            "prepare the data again")
        _, shard, name = relative.split("/")
        shards.setdefault(shard, {})[name[:-len(".npy")]] = array
    return PreparedSplit([shards[name] for name in sorted(shards)], masked)


def empty_features(phase: Phase) -> dict[str, np.ndarray]:
    """Zero rows of every feature, with the phase's shapes and dtypes."""
    row = instances.to_features(np.zeros(0, np.int32), np.zeros(0, np.int32), False,
                                np.zeros(0, np.int32), np.zeros(0, np.int32),
                                phase.max_seq_length, phase.max_predictions_per_seq, 0)
    return {name: np.zeros((0,) + value.shape, value.dtype) for name, value in row.items()}


def prepare(data_cfg: Any, phase: Phase, tokenizer: tokenization.Tokenizer, cache_dir: str,
            process_index: int = 0, process_count: int = 1,
            next_sentence_prediction: bool = True) -> dict[str, PreparedSplit]:
    """Prepared `train` and `eval` splits for `phase` (`data_cfg`: config.data), built once
    and cached under cache_dir; `next_sentence_prediction=False` makes no random-B pairs."""
    dynamic = _masking_is_dynamic(data_cfg)
    key_data = {k: data_cfg[k] for k in ("masked_lm_prob", "short_seq_prob", "dupe_factor", "masking",
                "whole_word_mask", "eval_fraction", "seed", "documents_per_shard")}
    if mask_mix(data_cfg) != instances.PAPER_MASK_MIX:  # ablation switches join the key only
        key_data["mask_mix"] = mask_mix(data_cfg)  # when off the paper's: old caches keep theirs
    if not next_sentence_prediction:
        key_data["next_sentence_prediction"] = False
    key = _hash({"version": FORMAT_VERSION, "source": _source_fingerprint(data_cfg),
                 "tokenizer": tokenizer.fingerprint(), "phase": [phase.max_seq_length,
                                                                 phase.max_predictions_per_seq],
                 "data": key_data, "shard": [process_index, process_count]})
    directory = os.path.join(cache_dir, f"{phase.name}_{phase.max_seq_length}_{key}")
    locks.build_once(directory, os.path.join(directory, "meta.json"), lambda: _build(
        directory, data_cfg, phase, tokenizer, dynamic, process_index, process_count,
        next_sentence_prediction))
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        records = meta.pop("files")
    except (ValueError, KeyError, AttributeError) as e:
        raise DataError(f"prepared data file {directory}/meta.json is damaged ({e!r}); delete "
                        f"{directory} to prepare the data again") from e
    logging.info("Prepared data for phase %s (%d tokens): %s training, %s held-out sequences "
                 "in %s", phase.name, phase.max_seq_length, f"{meta.get('train_instances', 0):,}",
                 f"{meta.get('eval_instances', 0):,}", directory)
    splits = {"train": _load_split(directory, "train", records, masked=not dynamic),
              "eval": _load_split(directory, "eval", records, masked=True)}
    for name, split in splits.items():  # every shard made is there
        if len(split) != meta.get(f"{name}_instances", 0):
            raise DataError(f"prepared data {directory} holds {len(split)} {name} rows, its meta."
                            f"json {meta.get(f'{name}_instances', 0)}; delete it to prepare again")
    return splits


def _masking_is_dynamic(data_cfg: Any) -> bool:
    if data_cfg.masking not in ("static", "dynamic"):
        raise DataError(f"data.masking={data_cfg.masking!r}; choose 'static' or 'dynamic'")
    return data_cfg.masking == "dynamic"


def _build(directory: str, data_cfg: Any, phase: Phase, tokenizer: tokenization.Tokenizer,
           dynamic: bool, process_index: int, process_count: int, nsp: bool) -> None:
    """Reads, tokenizes and instantiates the corpus shard by shard (bounded memory: one shard
    of `data.documents_per_shard` documents at a time; NSP partners come from the same shard,
    as the original ran per input file), and writes it atomically."""
    start = time.time()
    stats = corpus.CorpusStats()
    specials = specials_of(tokenizer, data_cfg.whole_word_mask)
    for unfinished in glob.glob(glob.escape(directory) + ".tmp*"):  # left by a crashed run
        if not locks.pid_alive(unfinished.rsplit(".tmp", 1)[1]):
            shutil.rmtree(unfinished, ignore_errors=True)
    tmp = f"{directory}.tmp{os.getpid()}"
    meta = collections.Counter()
    documents = read_documents(data_cfg, process_index, process_count, stats)
    with tokenize_corpus.tokenizing_pool(tokenizer, data_cfg.num_workers) as pool:
        for shard, raw_documents in enumerate(_batched(documents, data_cfg.documents_per_shard)):
            tokenized, counts = tokenize_corpus.tokenize_documents(raw_documents, tokenizer, pool)
            meta.update(counts, documents=len(tokenized))
            train_docs, eval_docs = split_eval_documents(tokenized, data_cfg.eval_fraction,
                                                         data_cfg.seed + shard)
            seed = hash_seed(data_cfg.seed, process_index, shard, phase.max_seq_length)
            splits = {"train": make_features(train_docs, phase, data_cfg, specials,
                                             data_cfg.dupe_factor, not dynamic, seed, nsp),
                      "eval": make_features(eval_docs, phase, data_cfg, specials, 1, True,
                                            seed + 1, nsp)}
            meta.update(eval_documents=len(eval_docs))
            for name, features in splits.items():
                if features:
                    _save_shard(os.path.join(tmp, name, f"shard_{shard:05d}"), features)
                    meta[f"{name}_instances"] += len(features["input_ids"])
            logging.debug("Prepared shard %d (%s): %s", shard, phase.name, dict(meta))
    (logging.info if stats.repaired() else logging.debug)("Corpus: %s", stats.summary())
    if not meta["documents"]:
        raise DataError(f"the corpus ({data_cfg.source}) has no usable documents after reading "
                        f"and tokenizing ({stats.summary()}); check data.input_files / tfds_name")
    if not meta["train_instances"]:
        raise DataError(f"the corpus gave no training instances at length {phase.max_seq_length}")
    if not meta["eval_instances"]:
        _save_shard(os.path.join(tmp, "eval", "shard_00000"), empty_features(phase))
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({**meta, "corpus": dataclasses.asdict(stats), "masking": data_cfg.masking,
                   "seconds": round(time.time() - start, 1), "files": _shard_records(tmp)}, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def _batched(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch


def hash_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def check_token_ids(split: PreparedSplit, vocab_size: int, what: str) -> None:
    """Fails before training if any token id is outside the model's vocabulary (it would
    silently produce NaNs in the embedding lookup)."""
    for shard in split.shards:
        for name in ("input_ids", "masked_lm_ids"):
            array = shard[name]
            if len(array) and int(array.max()) >= vocab_size:
                raise DataError(f"{what}: {name} holds id {int(array.max())} >= model.vocab_size="
                                f"{vocab_size}; set --config.model.vocab_size to the tokenizer's "
                                "size")
