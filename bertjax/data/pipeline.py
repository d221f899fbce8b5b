"""From a data config to prepared instances: corpus -> tokens -> instances -> shards on disk
(the corpus and the tokenizer: `data.corpus_source`; batches from them: `data.loaders`).

Every process prepares the whole corpus once (the same instances whatever the number of
processes), in shards of `data.shard_bytes` (compact .npy files, written atomically;
docs/data-preparation.md), or reads `data.prepared_dir`. Global batch k is a pure function of
(seed, k), and each process reads its rows of it (`loaders.BatchLoader`), so the data position
saved in a checkpoint is just the next batch index, and a resume, on any number of processes,
sees exactly the uninterrupted batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from absl import logging

from bertjax.data import (
    corpus,
    corpus_source,
    instances,
    masking,
    prepared_files,
    shard_format,
    shard_job,
    shard_reader,
    shard_sources,
    token_cache,
    tokenization,
)
from bertjax.data.batch import PhaseShape
from bertjax.data.errors import DataError
from bertjax.data.settings import DataSettings
from bertjax.data.shard_format import FEATURES, PreparedSplit  # noqa: F401 (the public names)
from bertjax.data.shard_job import split_eval_documents  # noqa: F401
from bertjax.runtime import failures, files, locks

FORMAT_VERSION = 5  # bump when the prepared bytes change (pinned: tests/test_prepared_bytes.py)


def shard_job_of(
    data: DataSettings,
    phase: PhaseShape,
    specials: instances.SpecialTokens,
    tokenizer: tokenization.Tokenizer | None = None,
    output: str = "",
    next_sentence_prediction: bool = True,
) -> shard_job.ShardJob:
    """Every shard's preparation settings, from config.data and the phase."""
    return shard_job.ShardJob(
        tokenizer=tokenizer,
        specials=specials,
        max_seq_length=phase.max_seq_length,
        max_predictions=phase.max_predictions_per_seq,
        masked_lm_prob=data.masked_lm_prob,
        short_seq_prob=data.short_seq_prob,
        dupe_factor=data.dupe_factor,
        whole_word_mask=data.whole_word_mask,
        mask_mix=data.mask_mix,
        eval_fraction=data.eval_fraction,
        seed=data.seed,
        shard_seed=(data.seed, 0),  # (0: the whole corpus's, as one process prepared it)
        dynamic=data.dynamic,
        next_sentence_prediction=next_sentence_prediction,
        output=output,
    )


def make_features(
    documents: list[list[np.ndarray]],
    phase: PhaseShape,
    data: DataSettings,
    specials: instances.SpecialTokens,
    dupe_factor: int,
    mask: bool,
    seed: int,
    next_sentence_prediction: bool = True,
) -> dict[str, np.ndarray]:
    """Stored rows of tokenized `documents` in memory (for a few documents), masked now
    (static) or left for the loader, exactly as a prepared shard holds them."""
    job = dataclasses.replace(
        shard_job_of(data, phase, specials, next_sentence_prediction=next_sentence_prediction),
        dupe_factor=dupe_factor,
    )
    created = instances.create_instances(
        documents,
        phase.max_seq_length,
        data.short_seq_prob,
        dupe_factor,
        random.Random(seed),
        specials,
        next_sentence_prediction,
    )
    chunks = list(shard_job.stored_chunks(created, job, shard_job.mask_key(seed) if mask else None))
    return {name: np.concatenate([chunk[name] for chunk in chunks]) for name in shard_format.STORED}


def settings(
    data: DataSettings,
    phase: PhaseShape,
    tokenizer: tokenization.Tokenizer,
    next_sentence_prediction: bool = True,
) -> dict[str, Any]:
    """What prepared data depends on besides the corpus (recorded in its meta.json)."""
    key_data = {
        k: getattr(data, k)
        for k in (
            "masked_lm_prob",
            "short_seq_prob",
            "dupe_factor",
            "masking",
            "whole_word_mask",
            "eval_fraction",
            "seed",
            "shard_bytes",
        )
    }
    if data.mask_mix != masking.PAPER_MASK_MIX:  # ablation switches join the key only
        key_data["mask_mix"] = list(data.mask_mix)  # when off the paper's
    if not next_sentence_prediction:
        key_data["next_sentence_prediction"] = False
    return json.loads(
        json.dumps(
            {
                "version": FORMAT_VERSION,
                "tokenizer": tokenizer.fingerprint(),
                "phase": [phase.max_seq_length, phase.max_predictions_per_seq],
                "data": key_data,
            },
            default=str,
        )
    )


def prepare(
    data: DataSettings,
    phase: PhaseShape,
    tokenizer: tokenization.Tokenizer,
    cache_dir: str,
    next_sentence_prediction: bool = True,
    derived: corpus_source.Derived | None = None,
) -> dict[str, PreparedSplit]:
    """Prepared `train` and `eval` splits for `phase`, all of them: read from
    `data.prepared_dir`, or built once and cached under cache_dir; `next_sentence_prediction=False` makes no random-B pairs. `derived`: the
    phases' `corpus_source.Derived(data, tokenizer)`, where the caller prepares several."""
    shard_job.check_not_in_spawned_import()
    wanted = settings(data, phase, tokenizer, next_sentence_prediction)
    if data.prepared_dir:
        directory = os.path.join(data.prepared_dir, phase_directory(phase))
        meta, records = prepared_files.read_meta(directory)
        check_settings(meta.get("settings", {}), wanted, directory)
        fix = f"prepare it again (python -m bertjax.prepare --output={data.prepared_dir})"
        if files.is_remote(directory):  # training reads a local copy
            remote, directory = directory, prepared_files.local_copy(directory, records, cache_dir)
            fix = f"delete {directory} (the local copy of {remote}) to download it again"
        verb = "Reading prepared data"
    else:
        derived = derived or corpus_source.Derived(data, tokenizer)
        key = prepared_files.cache_key(
            {
                **wanted,
                "source": derived.source_fingerprint,
                "shard": [0, 1],  # (the key's share of the corpus: all of it)
            }
        )
        directory = os.path.join(cache_dir, f"{phase.name}_{phase.max_seq_length}_{key}")
        try:
            built = locks.build_once(
                directory,
                os.path.join(directory, "meta.json"),
                functools.partial(
                    build,
                    directory,
                    data,
                    phase,
                    tokenizer,
                    next_sentence_prediction,
                    wanted=wanted,
                    derived=derived,
                ),
            )
        except OSError as e:  # e.g. a full disk: one line, and no half-written data left
            shutil.rmtree(_unfinished(directory), ignore_errors=True)
            raise DataError(
                f"{failures.os_error_line(e)}; preparing the data of phase "
                f"{phase.name} stopped and its unfinished files were removed; kept: "
                f"the tokenizer and the data prepared before (in {cache_dir})"
            ) from e
        meta, records = prepared_files.read_meta(directory)
        fix = f"delete {directory} to prepare it again"
        verb = "Prepared data" if built else "Reusing prepared data"
        if built:
            _note_older_formats(cache_dir, phase)
    logging.info(
        "%s for phase %s (%d tokens): %s training, %s held-out sequences (%s) in %s",
        verb,
        phase.name,
        phase.max_seq_length,
        f"{meta.get('train_instances', 0):,}",
        f"{meta.get('eval_instances', 0):,}",
        held_out_route(meta),
        directory,
    )
    expected = (phase.max_seq_length, phase.max_predictions_per_seq, tokenizer.vocab_size)
    splits = {
        name: shard_reader.load_split(
            directory, name, records, masked, expected, fix + ", then rerun (it resumes)"
        )
        for name, masked in (("train", not data.dynamic), ("eval", True))
    }
    for name in splits:  # every shard made is there
        rows = sum(
            r["rows"]
            for k, r in records.items()
            if k.startswith(f"{name}/") and k.endswith("/lengths.npy")
        )
        if rows != meta.get(f"{name}_instances", 0):
            raise DataError(
                f"prepared data {directory} holds {rows} {name} rows, its meta.json "
                f"says {meta.get(f'{name}_instances', 0)}; {fix}"
            )
    return splits


def _note_older_formats(cache_dir: str, phase: PhaseShape) -> None:
    """Names prepared data of an older format beside a new build (never read again)."""
    pattern = os.path.join(glob.escape(cache_dir), f"{phase.name}_{phase.max_seq_length}_*")
    for old in sorted(glob.glob(os.path.join(pattern, "meta.json"))):
        if ".tmp" in os.path.basename(os.path.dirname(old)):
            continue  # another process's unfinished build (its meta.json perhaps half written)
        try:
            with open(old) as f:
                older = json.load(f).get("settings", {}).get("version") != FORMAT_VERSION
        except (OSError, ValueError):
            continue
        if older:
            logging.info(
                "%s holds prepared data of an older format (prepared again above); "
                "delete it to free its space",
                os.path.dirname(old),
            )


def phase_directory(phase: PhaseShape) -> str:
    """A phase's directory under `data.prepared_dir`."""
    return f"{phase.name}_{phase.max_seq_length}"


def held_out_route(meta: dict[str, Any]) -> str:
    """How the held-out split was made, for the printed split sizes."""
    by_instances, shards = meta.get("eval_instance_route_shards", 0), meta.get("shards", 0)
    if not by_instances:
        return f"held out by whole documents: {meta.get('eval_documents', 0):,}"
    return (
        f"held out by instances in {by_instances} of {shards} shards, where whole documents "
        f"would have held over {shard_job.INSTANCE_ROUTE_FACTOR}x data.eval_fraction of the "
        "tokens"
    )


def check_settings(found: dict[str, Any], wanted: dict[str, Any], directory: str) -> None:
    """DataError naming every setting in which prepared data differs from this config."""

    def flat(d: dict[str, Any]) -> dict[str, Any]:
        return {
            **{k: v for k, v in d.items() if k != "data"},
            **{f"data.{k}": v for k, v in d.get("data", {}).items()},
        }

    found, wanted = flat(found), flat(wanted)
    changes = [
        f"{k}: {found.get(k)!r} there, {wanted.get(k)!r} here"
        for k in sorted(set(found) | set(wanted))
        if found.get(k) != wanted.get(k)
    ]
    if changes:
        raise DataError(
            f"prepared data {directory} was made with other settings "
            f"({'; '.join(changes)}); prepare it again with this config (python "
            "-m bertjax.prepare) or unset data.prepared_dir"
        )


def build(
    directory: str,
    data: DataSettings,
    phase: PhaseShape,
    tokenizer: tokenization.Tokenizer,
    nsp: bool = True,
    run_shards: Callable[..., Iterable[dict[str, int]]] = shard_job.run_shards,
    wanted: dict[str, Any] | None = None,
    derived: corpus_source.Derived | None = None,
) -> None:
    """Reads the corpus, cuts it into shards of `data.shard_bytes` and
    prepares each in a worker (`data.num_workers`; NSP partners come from the same shard, as
    the original's come from the same input file), written atomically to `directory`;
    `run_shards`: local processes, or another engine's (`beam_prepare.shard_runner`);
    `wanted`: its `settings`, and `derived`: `corpus_source.Derived(data, tokenizer)`, where the
    caller has them."""
    start = time.time()
    stats = corpus.CorpusStats()
    for unfinished in glob.glob(glob.escape(directory) + ".tmp*"):  # left by a crashed run
        if not locks.pid_alive(unfinished.rsplit(".tmp", 1)[1]):
            shutil.rmtree(unfinished, ignore_errors=True)
    tmp = _unfinished(directory)
    reader = corpus_source.corpus_reader(data, 0, 1)
    derived = derived or corpus_source.Derived(data, tokenizer)
    job = dataclasses.replace(
        shard_job_of(data, phase, derived.specials, tokenizer, tmp, nsp),
        reader=reader,
        tokens=tokens_directory(directory, derived),
    )
    meta: collections.Counter[str] = collections.Counter()
    try:
        for counts in run_shards(
            job, shard_sources.cut(reader, stats, data.shard_bytes), data.num_workers
        ):
            meta.update(counts, shards=1)
            logging.debug("Prepared shard %d (%s): %s", meta["shards"] - 1, phase.name, dict(meta))
    except shard_job.WorkerError as e:
        raise DataError(str(e)) from e
    (logging.info if stats.repaired() else logging.debug)("Corpus: %s", stats.summary())
    if not meta["documents"]:
        raise DataError(
            f"the corpus ({data.source}) has no usable documents after reading "
            f"and tokenizing ({stats.summary()}); check data.input_files / tfds_name"
        )
    if not meta["train_instances"]:
        raise DataError(f"the corpus gave no training instances at length {phase.max_seq_length}")
    if not meta["eval_instances"]:
        shard_format.ShardWriter(
            os.path.join(tmp, "eval", "shard_00000"),
            0,
            phase.max_seq_length,
            phase.max_predictions_per_seq,
            tokenizer.vocab_size,
        ).close()
    prepared_files.commit(
        tmp,
        directory,
        {
            **meta,
            "corpus": dataclasses.asdict(stats),
            "masking": data.masking,
            "settings": wanted or settings(data, phase, tokenizer, nsp),
            "source": derived.source,
            "seconds": round(time.time() - start, 1),
        },
    )


def tokens_directory(directory: str, derived: corpus_source.Derived) -> str:
    """Where the shards' token ids are kept for every phase, beside `directory` (a phase's):
    named by the corpus, the tokenizer and the shard size."""
    key = prepared_files.cache_key(
        {
            "source": derived.source_fingerprint,
            "tokenizer": derived.tokenizer.fingerprint(),
            "shard_bytes": derived.settings.shard_bytes,
            "share": [0, 1],  # (the key's share of the corpus: all of it)
            "version": token_cache.VERSION,
        }
    )
    return os.path.join(os.path.dirname(directory), f"tokens_{key}")


def remove_tokens(parent: str) -> None:
    """Deletes the token ids kept beside the phases in `parent` (`tokens_directory`): for a
    job whose every phase is prepared."""
    for path in glob.glob(os.path.join(glob.escape(parent), "tokens_*")):
        shutil.rmtree(path, ignore_errors=True)


def _unfinished(directory: str) -> str:
    """Where this process builds `directory` before renaming it into place."""
    return f"{directory}.tmp{os.getpid()}"


def check_token_ids(split: PreparedSplit, vocab_size: int, what: str) -> None:
    """Fails before training if any token id is outside the model's vocabulary (it would
    silently produce NaNs in the embedding lookup)."""
    for shard in split.shards:
        for name in ("input_ids", "masked_lm_ids"):
            array = shard[name]
            if len(array) and int(array.max()) >= vocab_size:
                raise DataError(
                    f"{what}: {name} holds id {int(array.max())} >= model.vocab_size="
                    f"{vocab_size}; set --config.model.vocab_size to the tokenizer's "
                    "size"
                )
