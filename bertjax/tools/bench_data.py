"""`python -m bertjax.tools.bench_data --config=configs/tiny.py`: input-pipeline throughput per core.

Measures, on one CPU core (one process, no tokenizing workers), with the config's corpus and
tokenizer and dynamic masking:
  prepare - raw text -> tokenized sentences -> pretraining instances -> shards on disk;
  load    - `BatchLoader` batches from the prepared shards (rows checked as read), masks drawn per
            row as the training loop draws them.
Tokenizer training (SentencePiece on the corpus, when no vocab_file) is timed separately.
Per-core rates divide by this process's CPU time (`time.process_time`), so they hold on a
shared machine; wall-clock seconds are recorded beside them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import ml_collections
from absl import flags

from bertjax import cli
from bertjax.data import corpus_source, loaders, pipeline
from bertjax.runtime import console
from bertjax.tools.records import machine, versions, write_record
from bertjax.training.settings import PretrainingSettings, plan_phases

FLAGS = flags.FLAGS


def run(config: ml_collections.ConfigDict, batches: int, cache_dir: str) -> dict[str, Any]:
    """Times preparation and dynamic-masking loading of the config's first phase."""
    settings = PretrainingSettings.of(config)
    data = dataclasses.replace(settings.data, masking="dynamic", num_workers=1)
    phase = plan_phases(settings.train, data, settings.long_phase)[0]
    tokenizer, tokenizer_seconds = _timed(
        lambda: corpus_source.load_or_train_tokenizer(data, cache_dir)
    )
    splits, prepare_seconds = _timed(lambda: pipeline.prepare(data, phase, tokenizer, cache_dir))
    prepared = len(splits["train"]) + len(splits["eval"])
    masking = (
        corpus_source.specials_of(tokenizer, data.whole_word_mask),
        data.masked_lm_prob,
        phase.max_predictions_per_seq,
        data.whole_word_mask,
    )
    loader = loaders.BatchLoader(
        splits["train"], phase.global_batch_size, data.seed, masking=masking
    )
    loader.batch(0)  # the epoch's permutation
    _, load_seconds = _timed(lambda: [loader.batch(i) for i in range(1, batches + 1)])
    loaded = batches * phase.global_batch_size
    return {
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "bertjax.tools.bench_data", *sys.argv[1:]]
        ),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "machine": machine(),
        "max_seq_length": phase.max_seq_length,
        "batch": phase.global_batch_size,
        "tokenizer": type(tokenizer).__name__,
        "tokenizer_seconds": tokenizer_seconds,
        "prepare": _rates(prepared, prepare_seconds),
        "load_dynamic_masking": _rates(loaded, load_seconds),
    }


def _timed(fn: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """`fn()` and its wall-clock and CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def _rates(sequences: int, seconds: dict[str, float]) -> dict[str, float]:
    return {
        "sequences": sequences,
        "wall_seconds": seconds["wall"],
        "cpu_seconds": seconds["cpu"],
        "sequences_per_second_per_core": sequences / max(seconds["cpu"], 1e-9),
    }


def define_flags() -> None:
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file, e.g. configs/tiny.py.", lock_config=True
    )
    flags.DEFINE_integer("batches", 200, "Batches to load (after the first).")
    flags.DEFINE_string(
        "cache_dir",
        "",
        "Prepared-data directory; default: a fresh temporary "
        "one, so preparation is measured, not a cache hit.",
    )
    flags.DEFINE_string("out", "", "Write the result record as JSON here.")
    flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    del argv
    with tempfile.TemporaryDirectory() as tmp:
        try:
            result = run(FLAGS.config, FLAGS.batches, FLAGS.cache_dir or tmp)
        except pipeline.DataError as e:
            console.error(str(e))
            sys.exit(1)
    prep, load = result["prepare"], result["load_dynamic_masking"]
    print(
        f"{result['machine']['cpu']}, load {result['machine']['load_average'][0]:.2f}; "
        f"length {result['max_seq_length']}, tokenizer {result['tokenizer']} "
        f"(ready in {result['tokenizer_seconds']['wall']:.1f} s)"
    )
    for what, rates in (("prepare from raw text", prep), ("load with dynamic masking", load)):
        print(
            f"{what}: {rates['sequences']:,} sequences in {rates['cpu_seconds']:.2f} CPU s "
            f"({rates['wall_seconds']:.2f} s wall) = "
            f"{rates['sequences_per_second_per_core']:,.0f} seq/s/core"
        )
    if FLAGS.out:
        write_record(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
