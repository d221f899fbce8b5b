"""`python -m bertjax.prepare --config=configs/base.py --output=DIR`: pretraining data, offline.
DIR may be a URL (gs://bucket/dir): the phases are prepared locally, then uploaded, meta.json last;
one preparation at a time writes a phase there (a second one started meanwhile stops with one line).

Prepares every phase of the config's schedule into DIR/<phase>_<length>/ (the shards training
would otherwise prepare and cache itself), with `data.num_workers` local processes, one shard
of `data.shard_bytes` of text per worker. Train from it with `--config.data.prepared_dir=DIR`:
each of P training processes reads its share of every shard's rows, and a config whose data
settings differ from the prepared data's is refused with one line. Running it again into the
same DIR keeps the phases already prepared with these settings. With `--runner=beam` the shards
are prepared by an Apache Beam pipeline instead (`--beam_options`, e.g. '--runner=FlinkRunner
...'; the `beam` extra, in its own environment), writing the same files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import ml_collections
from absl import flags
from ml_collections import config_flags

from bertjax.data import (
    beam_prepare,
    corpus_source,
    pipeline,
    prepared_files,
    shard_job,
    shard_sources,
)
from bertjax.errors import ConfigError, UserError
from bertjax.runtime import console, files, locks
from bertjax.training import phase_schedule

if TYPE_CHECKING:  # (not at run time: spawned workers re-import this module, without jax)
    from bertjax.training.settings import PretrainingSettings

FLAGS = flags.FLAGS


def prepare_all(
    config: ml_collections.ConfigDict,
    output: str,
    runner: str = "local",
    beam_options: str = "--runner=DirectRunner",
) -> list[str]:
    """Prepares every phase of `config` into `output` (a directory or a URL such as
    gs://bucket/dir) with local worker processes, or with `runner="beam"` in a Beam pipeline run
    with `beam_options` (one string, split as a shell would); returns one summary line per
    phase. A URL's phases are prepared in a local temporary directory, then uploaded."""
    from bertjax.training import validate  # not at the top: spawned workers re-import this module

    settings = validate.data_preparation(config)
    if settings.data.prepared_dir:
        raise ConfigError(
            "data.prepared_dir is set: this job writes prepared data, it "
            "does not read it; unset --config.data.prepared_dir"
        )
    run_shards: Callable[
        [shard_job.ShardJob, Iterable[shard_sources.ShardSource], int], Iterator[dict[str, int]]
    ] = shard_job.run_shards
    if runner == "beam":
        run_shards = beam_prepare.shard_runner(shlex.split(beam_options))
    elif runner != "local":
        raise ConfigError(f"--runner={runner!r}; choose local or beam")
    remote = files.is_remote(output)
    local = prepared_files.scratch() if remote else output
    try:
        return _prepare_phases(settings, output, local, run_shards)
    finally:
        if remote:
            shutil.rmtree(local, ignore_errors=True)


def _prepare_phases(
    settings: PretrainingSettings,
    output: str,
    local: str,
    run_shards: Callable[..., Iterable[dict[str, int]]],
) -> list[str]:
    """Every phase into `output`, prepared in `local` (the same directory, or a temporary one
    from which a URL's phases are uploaded, meta.json last, when prepared)."""
    data = settings.data
    phases = settings.phases
    nsp = settings.train.pretraining_objective.uses_nsp
    tokenizer = corpus_source.load_or_train_tokenizer(data, os.path.join(local, "tokenizer"))
    derived = corpus_source.Derived(data, tokenizer)  # (once for every phase)
    lines = []
    for phase in phases:
        name = pipeline.phase_directory(phase)
        directory, target = os.path.join(local, name), f"{output.rstrip('/')}/{name}"
        wanted = pipeline.settings(data, phase, tokenizer, nsp)
        meta_path = os.path.join(target, "meta.json")
        if files.exists(meta_path):
            with files.open(meta_path) as f:
                pipeline.check_settings(json.load(f).get("settings", {}), wanted, target)
            lines.append(summary(target, phase, False))
            continue
        with (
            prepared_files.claimed(target)
            if target != directory
            else contextlib.nullcontext(None) as still_claimed
        ):
            built = locks.build_once(
                directory,
                os.path.join(directory, "meta.json"),
                functools.partial(
                    pipeline.build,
                    directory,
                    data,
                    phase,
                    tokenizer,
                    nsp=nsp,
                    run_shards=run_shards,
                    wanted=wanted,
                    derived=derived,
                ),
            )
            if still_claimed:
                prepared_files.upload(directory, target, still_claimed)
        lines.append(summary(target, phase, built))
    pipeline.remove_tokens(local)  # every phase read the corpus's one tokenization
    tokenizer_files = os.path.join(local, "tokenizer")
    if files.is_remote(output) and os.path.isdir(tokenizer_files):
        for name in sorted(n for n in os.listdir(tokenizer_files) if not n.startswith(".")):
            files.copy(os.path.join(tokenizer_files, name), f"{output}/tokenizer/{name}")
    return lines


def summary(directory: str, phase: phase_schedule.Phase, built: bool) -> str:
    """One line about a prepared phase: sizes, the held-out route, disk and time."""
    with files.open(f"{directory}/meta.json") as f:
        meta = json.load(f)
    disk = sum(record["bytes"] for record in meta["files"].values())
    verb = "Prepared" if built else "Already prepared (kept)"
    return (
        f"{verb} phase {phase.name} ({phase.max_seq_length} tokens): "
        f"{meta.get('train_instances', 0):,} training, {meta.get('eval_instances', 0):,} "
        f"held-out sequences ({pipeline.held_out_route(meta)}) in {meta.get('shards', 0)} "
        f"shards, {disk / 1e6:,.1f} MB, {meta.get('seconds', 0)} s -> {directory}"
    )


def define_flags() -> None:
    """Command-line flags; defined only when run as a program."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file with get_config().", lock_config=True
    )
    flags.DEFINE_string(
        "output",
        None,
        "Directory or URL (gs://bucket/dir) for the prepared "
        "data (train with --config.data.prepared_dir=DIR_OR_URL).",
    )
    flags.DEFINE_enum(
        "runner",
        "local",
        ["local", "beam"],
        "local: data.num_workers local "
        "processes; beam: an Apache Beam pipeline (pip install -e '.[beam]').",
    )
    flags.DEFINE_string(
        "beam_options",
        "--runner=DirectRunner",
        "With --runner=beam: Beam's "
        "pipeline options, one string (e.g. '--runner=DirectRunner "
        "--direct_num_workers=2 --direct_running_mode=multi_processing').",
    )
    flags.mark_flags_as_required(["config", "output"])


def main(argv: list[str]) -> None:
    del argv
    try:
        for line in prepare_all(FLAGS.config, FLAGS.output, FLAGS.runner, FLAGS.beam_options):
            print(line, flush=True)
    except (UserError, OSError) as e:
        console.error(str(e))
        sys.exit(1)


if __name__ == "__main__":
    from bertjax import cli  # (imports JAX: not at the top, which spawned workers re-import)

    define_flags()
    cli.run(main)
