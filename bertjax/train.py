"""`python -m bertjax.train --config=configs/large.py --workdir=DIR`: BERT pretraining.

Any config field can be overridden on the command line, e.g. `--config.train.total_steps=100`.
Running the same command again resumes from the latest checkpoint in DIR.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging as std_logging
import os
import sys
import tempfile
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app, flags, logging
from etils import epath
from jax.experimental import multihost_utils
from ml_collections import config_flags
from tensorboardX import SummaryWriter

from bertjax import (checkpoint, distributed, flops, guards, memory, objectives, optim,
                     pretrained, schedule, sharding, steps)
from bertjax import model as bert_model
from bertjax.interop.tree import ConversionError
from bertjax.data import pipeline
from bertjax.model import BertConfig, BertForPreTraining
from bertjax.state import count_params, create_train_state, pretraining_example_inputs


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps); the message says why."""


class ConfigError(ValueError):
    """A config that cannot run on these devices (mesh, batch sizes, lengths)."""


def validate(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh) -> None:
    """Checks batch sizes against the mesh, accumulation and process count up front."""
    dp = sharding.data_parallel_size(mesh)
    accum = config.train.grad_accum_steps
    for phase in schedule.phases(config.train, config.data, config.long_phase):
        size = phase.global_batch_size
        if size % jax.process_count() or size % accum or (size // accum) % dp:
            raise ValueError(
                f"global batch {size} (phase {phase.name}) must be divisible by the process count "
                f"({jax.process_count()}), and batch / grad_accum_steps ({accum}) by the "
                f"data-parallel size data*fsdp={dp}")
        if phase.max_seq_length > config.model.max_position_embeddings:
            raise ValueError(f"phase {phase.name}: max_seq_length {phase.max_seq_length} > "
                             f"model.max_position_embeddings {config.model.max_position_embeddings}")


def model_and_optimizer(config: ml_collections.ConfigDict):
    """`(model, optimizer, example model inputs for initialisation)` from the config."""
    model = BertForPreTraining(BertConfig.from_dict(config.model.to_dict()))
    return model, optim.make_optimizer(optimizer_config(config)), pretraining_example_inputs()


def _chief_print(line: str) -> None:
    """Progress lines come from process 0 only (every process computes the same values)."""
    if jax.process_index() == 0:
        print(line, flush=True)


def _write_text(path: str, text: str, append: bool = False) -> None:
    """Writes a small text file so that a kill -9 never loses what it held. Locally, an append
    is one O_APPEND write (earlier lines are never rewritten) and a rewrite goes through a
    renamed temporary file. Object stores (gs://) cannot append; there an append rewrites
    the object, which each upload replaces whole."""
    if "://" not in path:
        if append:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, text.encode("utf-8"))
            finally:
                os.close(fd)
        else:
            temporary = f"{path}.tmp{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temporary, path)
        return
    target = epath.Path(path)
    if append and target.exists():
        text = target.read_text() + text
    target.write_text(text)


def optimizer_config(config: ml_collections.ConfigDict) -> optim.OptimizerConfig:
    return optim.optimizer_config(config.optimizer, config.train.total_steps)


class Progress:
    """Accumulates metric sums on the host and prints/writes them every `log_every` steps."""

    def __init__(self, config: ml_collections.ConfigDict, writer: SummaryWriter | None,
                 start_step: int, jsonl_path: str | None):
        self.config, self.writer, self.jsonl_path = config, writer, jsonl_path
        self.sums: dict[str, float] = {}
        self.tokens = 0
        self.window_start, self.window_start_step = time.time(), start_step
        self.nonfinite_in_a_row = self.nonfinite_total = 0
        self.model_config = BertConfig.from_dict(config.model.to_dict())
        self.peak_tflops = flops.peak_tflops(jax.devices()[0].device_kind)

    def add(self, step: int, metrics: dict[str, Any], tokens: int, batch: str = "") -> None:
        """Adds one step's metrics (already on the host); stops on repeated non-finite steps.
        `batch` names the step's batch in messages."""
        if metrics["nonfinite"] > 0:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            logging.warning("step %d (%s): non-finite loss or gradient; update skipped "
                            "(%d in a row, %d in this run)", step, batch,
                            self.nonfinite_in_a_row, self.nonfinite_total)
            if self.nonfinite_in_a_row >= self.config.train.max_nonfinite_steps:
                raise TrainingError(
                    f"{self.nonfinite_in_a_row} consecutive non-finite steps ending at step {step} "
                    f"({batch}); the last checkpoint is intact. Lower "
                    "optimizer.peak_learning_rate or check the data, then rerun to resume.")
            return
        self.nonfinite_in_a_row = 0
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.sums["steps"] = self.sums.get("steps", 0.0) + 1
        self.tokens += tokens

    def report(self, step: int, phase: schedule.Phase) -> dict[str, float]:
        """Prints a progress line for the steps since the last report and resets the window."""
        if not self.sums:
            return {}
        now = time.time()
        seconds_per_step = (now - self.window_start) / max(step - self.window_start_step, 1)
        means = objectives.summarize(self.sums)
        means["grad_norm"] = self.sums["grad_norm"] / self.sums["steps"]
        means["learning_rate"] = optim.learning_rate_at(optimizer_config(self.config), step - 1)
        means["nonfinite_steps"] = self.nonfinite_total
        means["tokens_per_second"] = self.tokens / max(now - self.window_start, 1e-9)
        flops_per_token = flops.train_flops_per_sequence(
            self.model_config, phase.max_seq_length, phase.max_predictions_per_seq,
        ) / phase.max_seq_length
        means["model_tflops_per_second"] = means["tokens_per_second"] * flops_per_token / 1e12
        mfu = flops.mfu(means["model_tflops_per_second"] * 1e12, jax.device_count(),
                        self.peak_tflops)
        if mfu is not None:
            means["mfu"] = mfu
        eta = seconds_per_step * (self.config.train.total_steps - step)
        _chief_print(f"step {step}/{self.config.train.total_steps} "
                     f"[{phase.name} L={phase.max_seq_length}] "
                     f"loss {means['loss']:.4f} mlm_acc {means['mlm_accuracy']:.4f} "
                     f"nsp_acc {means['nsp_accuracy']:.4f} lr {means['learning_rate']:.3e} "
                     f"tok/s {means['tokens_per_second']:,.0f} "
                     f"TFLOP/s {means['model_tflops_per_second']:.3g} "
                     + (f"MFU {mfu:.1%} " if mfu is not None else "") + f"eta {_duration(eta)}")
        if self.writer:
            for key, value in means.items():
                self.writer.add_scalar(f"train/{key}", value, step)
            self.writer.flush()
        if self.jsonl_path:
            _write_text(self.jsonl_path, json.dumps({"step": step, "phase": phase.name, **means})
                        + "\n", append=True)
        self.sums, self.tokens = {}, 0
        self.window_start, self.window_start_step = now, step
        return means


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def _fewest_over_processes(count: int) -> int:
    """The smallest of every process's `count`: each process holds its own share of the data,
    but all must run the same number of (collective) steps."""
    if jax.process_count() == 1:
        return count
    return int(np.min(multihost_utils.process_allgather(np.int64(count))))


def evaluate(eval_step, params, loader: pipeline.BatchLoader | None, num_batches: int,
             mesh: jax.sharding.Mesh) -> dict[str, float]:
    """Mean MLM/NSP loss and accuracy over the first `num_batches` held-out batches."""
    if loader is None:
        return {}
    sums: dict[str, float] = {}
    for index in range(_fewest_over_processes(min(num_batches, loader.batches_per_epoch))):
        batch = sharding.global_batch_from_host(loader.batch(index), mesh)
        for key, value in jax.device_get(eval_step(params, batch)).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return objectives.summarize(sums)


@dataclasses.dataclass
class PhaseData:
    phase: schedule.Phase
    train: pipeline.BatchLoader
    eval: pipeline.BatchLoader | None


def prepare_data(config, tokenizer, cache_dir: str, process_index: int | None = None,
                 process_count: int | None = None) -> list[PhaseData]:
    """Prepares (or loads from cache) every phase's splits of this process's share of the
    documents (default: this process's index and count) and checks their token ids."""
    if process_index is None:
        process_index, process_count = jax.process_index(), jax.process_count()
    specials = pipeline.specials_of(tokenizer, config.data.whole_word_mask)
    result = []
    for phase in schedule.phases(config.train, config.data, config.long_phase):
        splits = pipeline.prepare(config.data, phase, tokenizer, cache_dir, process_index, process_count)
        for name, split in splits.items():
            pipeline.check_token_ids(split, config.model.vocab_size, f"{name} data ({phase.name})")
        local_batch = phase.global_batch_size // process_count
        masking = (specials, config.data.masked_lm_prob, phase.max_predictions_per_seq,
                   config.data.whole_word_mask)
        train_loader = pipeline.BatchLoader(splits["train"], local_batch, config.data.seed,
                                            masking=masking, name=f"{phase.name} train")
        eval_loader = None
        if _fewest_over_processes(len(splits["eval"])) >= local_batch:
            eval_loader = pipeline.BatchLoader(splits["eval"], local_batch, config.data.seed,
                                               shuffle=False, name=f"{phase.name} eval")
        else:
            logging.warning("phase %s: %d held-out sequences, fewer than one batch of %d: "
                            "evaluation skipped (raise data.eval_fraction)", phase.name,
                            len(splits["eval"]), local_batch)
        result.append(PhaseData(phase, train_loader, eval_loader))
    return result


def _consistent_position(position: dict, step: int, phase_data: list[PhaseData]) -> dict:
    """The saved data position, unless the phase schedule changed (e.g. a new total_steps):
    then the position the new schedule implies for `step`."""
    phase = schedule.phase_at([pd.phase for pd in phase_data], step)
    if position["phase"] == phase.name:
        return position
    implied = {"phase": phase.name, "batch_index": step - phase.start_step}
    logging.warning("checkpoint data position %s does not match this run's phase schedule at "
                    "step %d; continuing at %s", position, step, implied)
    return implied


def _run_metadata(config, tokenizer, phases) -> dict[str, Any]:
    """What a checkpoint records about its run; `model` and `tokenizer` must match to resume,
    `data` within a phase (guards.check_data_compatible)."""
    fields = bert_model.ARCHITECTURE_FIELDS + bert_model.STORAGE_FIELDS
    return {"model": {name: config.model[name] for name in fields},
            "tokenizer": tokenizer.fingerprint(), "config": config.to_json(),
            "data": guards.data_identity(config.data, phases)}


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       devices: list[jax.Device] | None = None) -> dict[str, float]:
    """Pretrains (or resumes) in `workdir`; returns the final evaluation metrics.

    `devices` defaults to all devices; the mesh in `config.mesh` must cover them exactly.
    """
    epath.Path(workdir).mkdir(parents=True, exist_ok=True)
    is_chief = jax.process_index() == 0
    try:
        mesh = sharding.make_mesh(config.mesh.to_dict(), devices)
        validate(config, mesh)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    cache_dir = config.data.cache_dir or (  # prepared data needs a local disk
        os.path.join(tempfile.gettempdir(), "bertjax_data") if "://" in workdir
        else os.path.join(workdir, "data"))
    tokenizer = pipeline.load_or_train_tokenizer(config.data, cache_dir, jax.process_index(),
                                                 jax.process_count())
    if tokenizer.vocab_size > config.model.vocab_size:
        raise pipeline.DataError(f"the tokenizer has {tokenizer.vocab_size} tokens but "
                                 f"model.vocab_size={config.model.vocab_size}; raise the latter")
    phase_data = prepare_data(config, tokenizer, cache_dir)

    model, tx, example = model_and_optimizer(config)
    checkpointer = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), config.train.checkpoint_every,
        config.train.keep_checkpoints, config.train.keep_every)
    phases = [pd.phase for pd in phase_data]
    meta = _run_metadata(config, tokenizer, phases)
    latest = checkpointer.latest_step()
    rng = jax.random.PRNGKey(config.train.seed)
    _, abstract_state, state_shardings = create_train_state(model, tx, rng, example, mesh,
                                                            materialize=False)
    try:
        memory.check_shardable(model.config, abstract_state.params, mesh)
    except memory.MeshMismatch as e:
        raise ConfigError(str(e)) from e
    if is_chief:
        print(memory.report(model, abstract_state, mesh, [pd.phase for pd in phase_data]),
              flush=True)
    if latest is not None:
        found_meta, found_position = checkpointer.metadata(latest)
        guards.check_data_compatible(found_meta.get("data"), meta["data"], found_position,
                                     schedule.phase_at(phases, latest).name,
                                     f"{checkpointer.directory}/{latest}")
        state, position, _ = checkpointer.restore(latest, abstract_state, meta)
        _chief_print(f"Resuming from {checkpointer.directory} at step {latest} "
                     f"(phase {position['phase']}, next batch {position['batch_index']})")
    else:
        state, _, _ = create_train_state(model, tx, rng, example, mesh)
        position = {"phase": phase_data[0].phase.name, "batch_index": 0}
        if config.train.init_checkpoint:  # Google TF, Hugging Face or bertjax
            pretrained.check_run_tokenizer(config.train.init_checkpoint, config.data,
                                           tokenizer.vocab_size, config.model.vocab_size)
            state = state.replace(params=pretrained.load_pretrained(
                config.train.init_checkpoint, abstract_state.params, model.config))
    start_step = int(jax.device_get(state.step))
    position = _consistent_position(position, start_step, phase_data)
    if start_step >= config.train.total_steps:
        _chief_print(f"Training already finished ({start_step} steps); evaluating only")
    if is_chief:
        print(f"Model: {count_params(state.params):,} parameters; mesh {dict(mesh.shape)}; "
              f"{len(jax.devices())} devices, {jax.process_count()} processes", flush=True)

    writer = SummaryWriter(os.path.join(workdir, "tensorboard")) if is_chief else None
    train_step = steps.jit_train_step(
        steps.make_train_step(model, tx, config.train.grad_accum_steps), state_shardings, mesh)
    eval_step = steps.jit_eval_step(steps.make_eval_step(model), state_shardings.params, mesh)
    progress = Progress(config, writer, start_step,
                        os.path.join(workdir, "metrics.jsonl") if is_chief else None)
    try:
        with sharding.activate(mesh), concurrent.futures.ThreadPoolExecutor(1) as prefetcher:
            state, position, final_eval = _train_loop(
                config, state, position, start_step, phase_data, train_step, eval_step, mesh,
                checkpointer, meta, progress, prefetcher, writer)
    finally:
        checkpointer.close()
        if writer:
            writer.close()
    final_step = int(jax.device_get(state.step))
    if is_chief and final_step >= config.train.total_steps:  # also marks the run as finished
        _write_text(os.path.join(workdir, "final_metrics.json"),
                    json.dumps({"step": final_step, **final_eval}, indent=1))
    return final_eval


def _train_loop(config, state, position, start_step, phase_data, train_step, eval_step, mesh,
                checkpointer, meta, progress, prefetcher, writer):
    """The step loop: prefetch, step, one-step-late metrics, eval, checkpoint."""
    total = config.train.total_steps
    phases = [pd.phase for pd in phase_data]
    by_name = {pd.phase.name: pd for pd in phase_data}
    current = by_name.get(position["phase"]) or phase_data[0]
    batch_index = position["batch_index"]  # the next batch of `current` to train on
    next_batch = prefetcher.submit(current.train.batch, batch_index)
    pending = None  # (step, device metrics, tokens, batch name): fetched one step late
    nan_steps = set(config.train.debug_nan_steps)

    def flush_pending() -> None:
        nonlocal pending
        if pending is not None:
            progress.add(pending[0], jax.device_get(pending[1]), pending[2], pending[3])
            pending = None

    def save(step: int, force: bool = False) -> None:
        guards.check_finite(state, step)
        checkpointer.save(step, state, position, meta, force=force)

    def eval_and_log(step: int, pd: PhaseData) -> dict[str, float]:
        means = evaluate(eval_step, state.params, pd.eval, config.train.eval_batches, mesh)
        if means:
            _chief_print(f"eval step {step} [{pd.phase.name}]: " + " ".join(
                f"{k} {v:.4f}" for k, v in sorted(means.items())))
            if writer:
                for key, value in means.items():
                    writer.add_scalar(f"eval/{key}", value, step)
        return means

    stop_at = min(total, start_step + config.train.stop_after_steps) \
        if config.train.stop_after_steps else total
    for step in range(start_step, stop_at):
        trained, trained_batch = current, f"batch {batch_index} of phase {current.phase.name}"
        host_batch = next_batch.result()
        if step + 1 in nan_steps:  # test-only fault injection
            host_batch = guards.poison_batch(host_batch)
        upcoming = schedule.phase_at(phases, step + 1)
        if upcoming.name != current.phase.name:
            current, batch_index = by_name[upcoming.name], -1
        batch_index += 1
        if step + 1 < stop_at:
            next_batch = prefetcher.submit(current.train.batch, batch_index)
        state, metrics = train_step(state, sharding.global_batch_from_host(host_batch, mesh))
        flush_pending()  # the previous step's metrics: ready by now, so this does not stall
        done = step + 1
        pending = (done, metrics, host_batch["input_ids"].size * jax.process_count(), trained_batch)
        position = {"phase": current.phase.name, "batch_index": batch_index}
        if done % config.train.log_every == 0 or done == stop_at:
            flush_pending()
            progress.report(done, trained.phase)
        if config.train.eval_every and done % config.train.eval_every == 0 and done != total:
            eval_and_log(done, trained)
        if checkpointer.reached_preemption(done):
            flush_pending()
            progress.report(done, trained.phase)
            print(f"Preemption notice: saving a checkpoint at step {done} and exiting", flush=True)
            break
        if checkpointer.should_save(done) and done != stop_at:
            save(done)
    flush_pending()
    final_step = int(jax.device_get(state.step))
    final_eval = eval_and_log(final_step, current) if final_step == total else {}
    if checkpointer.latest_step() != final_step:
        save(final_step, force=True)
    checkpointer.wait()
    return state, position, final_eval


FLAGS = flags.FLAGS


def define_flags() -> None:
    """Command-line flags; defined only when run as a program, so importing is side-effect free."""
    config_flags.DEFINE_config_file("config", None, "Config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard and data cache.")
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-process "
                        "runs off TPU VMs); default: $JAX_COORDINATOR_ADDRESS or auto-detection.")
    flags.DEFINE_integer("num_processes", None, "Processes in the job (with --coordinator_address).")
    flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
    flags.DEFINE_integer("heartbeat_timeout_seconds", None, "Seconds without a heartbeat after "
                         "which the processes of a multi-process job give up on a lost peer and "
                         "exit; default: JAX's (100).")
    flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraryInfo(std_logging.Filter):
    """Drops INFO chatter from Orbax (tens of lines per save); warnings still show."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def main(argv: list[str]) -> None:
    del argv
    logging.get_absl_handler().addFilter(_QuietLibraryInfo())
    try:
        distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id,
                               FLAGS.heartbeat_timeout_seconds)
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except (distributed.DistributedSetupError, ConfigError, pipeline.DataError, checkpoint.CheckpointMismatch,
            checkpoint.CheckpointWriteError, TrainingError, guards.NonFiniteState,
            FileNotFoundError, ConversionError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if isinstance(e, checkpoint.CheckpointWriteError):
            # Orbax's writer threads of the failed save wait (for minutes) for signals that
            # will never come, and a normal exit joins them: leave without waiting.
            sys.stdout.flush()
            os._exit(1)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
