"""`python -m bertjax.train --config=configs/large.py --workdir=DIR`: BERT pretraining.

Any config field can be overridden on the command line, e.g. `--config.train.total_steps=100`.
Running the same command again resumes from the latest checkpoint in DIR.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import time
from collections.abc import Collection

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from bertjax import cli
from bertjax.data import loaders, pipeline
from bertjax.errors import ConfigError, UserError
from bertjax.interop import pretrained
from bertjax.models import families
from bertjax.runtime import agreement, console, distributed, failures, files, locks, peers, stopping
from bertjax.training import (
    checkpoint,
    checkpoint_checks,
    guards,
    init_architecture,
    memory,
    metrics_writer,
    nonfinite,
    phase_schedule,
    pretrain_loop,
    reporting,
    resume,
    run_schedule,
    sharded_run,
    validate,
)
from bertjax.training.phase_schedule import DataPosition
from bertjax.training.pretrain_loop import PretrainingLoop
from bertjax.training.run_record import RunRecord
from bertjax.training.settings import PretrainingSettings
from bertjax.training.state import TrainState


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    devices: list[jax.Device] | None = None,
    overrides: Collection[str] = (),
) -> dict[str, float]:
    """Pretrains (or resumes) in `workdir`, which no other run may use meanwhile (a lock);
    returns the final evaluation metrics. `devices` defaults to all devices; the mesh in
    `config.mesh` must cover them exactly. The model of a run from `train.init_checkpoint`
    is the checkpoint's (`init_architecture.model_of_init_checkpoint`); `overrides` (the
    dotted fields set on the command line) must agree with it."""
    if not workdir.strip():
        raise ConfigError("--workdir is empty: name the directory of the run")
    agreement.check("config", agreement.config_fields(config.to_dict(), workdir))
    validate.model_family(config)
    changed = init_architecture.model_of_init_checkpoint(
        config.model.to_dict(), config.train.init_checkpoint, workdir, overrides
    )
    if changed:
        config = copy.deepcopy(config)
        config.model.update(changed)
    settings = validate.pretraining(config)  # (typed, built once)
    with locks.held_workdir(workdir, jax.process_index()), contextlib.ExitStack() as accepted:
        return _train_and_evaluate(settings, config.to_json(), workdir, devices, accepted)


def _train_and_evaluate(
    settings: PretrainingSettings,
    config_json: str,
    workdir: str,
    devices: list[jax.Device] | None,
    accepted: contextlib.ExitStack,
) -> dict[str, float]:
    """The run of `settings` (`config_json`: its whole config) in its locked `workdir`; once
    its settings are accepted, it writes config.json and its log file (held open by
    `accepted`)."""
    started = time.time()
    is_chief = jax.process_index() == 0
    train, data, model = settings.train, settings.data, settings.model
    phases = settings.phases
    mesh = sharded_run.make_mesh(settings.mesh, devices)
    sharded_run.check_batches(
        mesh, phases, train.grad_accum_steps, model["max_position_embeddings"]
    )  # before preparing any data
    objective = train.pretraining_objective
    checkpointer = checkpoint.Checkpointer(  # (its clean-up of unfinished saves needs the lock)
        os.path.join(workdir, "checkpoints"),
        train.checkpoint_every,
        train.keep_checkpoints,
        train.keep_every,
        on_commit=reporting.announce_commit(os.path.join(workdir, "checkpoints")),
    )
    resume_from = resume.Resume(checkpointer, os.path.join(workdir, resume.QUARANTINE))
    found = resume_from.newest()
    sections = (settings, settings.optimizer)
    plan = (
        run_schedule.resumed(found.record, resume_from.where(found.step), *sections)
        if found
        else run_schedule.planned(*sections)
    )  # (refuses a changed schedule)
    phases, optimizer = plan.phases, plan.optimizer_config
    record = RunRecord.new(
        families.recorded_fields(model),
        config_json,
        guards.data_identity(data, phases),
        plan.record(),
    )
    agreement.check("corpus", agreement.data_fields(record.data or {}), agreement.SAME_FILES)

    def check(found: resume.Found) -> None:
        resume_from.check(found, record, data, phases, train.allow_changed_data)

    if found:
        check(found)  # model and data, before any preparation
    model_config = families.model_config(model)
    cache_dir = data.cache_dir or files.local_cache_dir(workdir)
    tokenizer = pipeline.load_or_train_tokenizer(
        data, cache_dir, jax.process_index(), jax.process_count()
    )
    if not found:
        init_architecture.check_tokenizer(train.init_checkpoint, data, model, tokenizer)
    if tokenizer.vocab_size > model["vocab_size"]:
        raise pipeline.DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size={model['vocab_size']}; set --config.model.vocab_size="
            f"{tokenizer.vocab_size} (or more)"
        )
    record = dataclasses.replace(record, tokenizer=tokenizer.fingerprint())
    agreement.check("tokenizer", agreement.tokenizer_fields(tokenizer), agreement.SAME_FILES)
    if found:  # and the tokenizer
        checkpoint_checks.check_compatible(
            found.record.as_json(), record.as_json(), resume_from.where(found.step)
        )
    stopping.now_doing("preparing data")
    phase_data = loaders.prepare_data(
        data,
        phases,
        model["vocab_size"],
        tokenizer,
        cache_dir,
        next_sentence_prediction=objective.uses_nsp,
    )
    agreement.check("prepared", {})  # (where a host that failed to prepare stops the others)
    stopping.now_doing("building the model (compiling)")
    sharded = sharded_run.build_pretraining(
        model_config,
        optimizer,
        mesh,
        phases,
        train.grad_accum_steps,
        report=False,
        objective=objective,
    )
    accepted.enter_context(console.logging_to(console.log_file(workdir)))  # (once accepted)
    if is_chief:  # the full table goes to a file, its totals to the console
        files.write_text(
            os.path.join(workdir, "config.json"),
            json.dumps(json.loads(config_json), indent=1) + "\n",
        )
        report_path = os.path.join(workdir, "startup_report.txt")
        files.write_text(
            report_path, memory.report(sharded.model, sharded.abstract_state, mesh, phases) + "\n"
        )
        print(
            memory.summary(sharded.model, sharded.abstract_state, mesh, phases)
            + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + f"; full table: {report_path}",
            flush=True,
        )
        if any(steps > 1 for steps in sharded.grad_accum.values()):
            print(
                "Micro-batches per step: "
                + ", ".join(f"{steps} ({name})" for name, steps in sharded.grad_accum.items())
                + (
                    ""
                    if train.grad_accum_steps
                    else " (train.grad_accum_steps=0: the fewest that fit the devices' memory)"
                ),
                flush=True,
            )
    stopping.now_doing(
        f"restoring checkpoint {found.step}" if found else "building the initial state"
    )
    if found:
        state, position = resume_from.restore(found, sharded.abstract_state, record, check)
    else:
        state, position = fresh_state(settings, sharded, phases)
    start = resume.Start.of(state, position, found, phases)
    if start.step >= train.total_steps:
        reporting.chief_print(f"Training already finished ({start.step} steps); evaluating only")
    else:
        reporting.chief_print(
            reporting.steps_line(start.step, train.total_steps, phases, train.log_every)
        )
    writer = metrics_writer.open_writer(workdir)
    try:
        while True:  # (once more from the checkpoint before, after a suspect resume)
            progress = reporting.Progress(
                phases,
                nonfinite.NonFiniteSteps(
                    train.max_nonfinite_steps, start.step, resume_from.resumed_from(start)
                ),
                optimizer,
                model_config,
                writer,
                start.step,
                os.path.join(workdir, "metrics.jsonl") if is_chief else None,
            )
            pretraining = PretrainingLoop(
                train,
                sharded,
                phase_data,
                checkpointer,
                record,
                progress,
                writer,
                restart_step=optimizer.restart_step,
            )
            try:
                state, position, final_eval = pretraining.loop(
                    start.state, start.position, start.step
                )
                break
            except nonfinite.NonFiniteAfterResume as e:
                start = resume_from.fall_back(
                    start, e, sharded.abstract_state, record, check, phases
                )
    except Exception as e:  # (told before the close, which may wait for the other processes)
        peers.announce_failure(e)
        raise
    finally:
        checkpointer.close()
        if writer:
            try:
                writer.close()
            except OSError as e:  # (a full disk: the loop has already stopped and said so)
                logging.warning("closing TensorBoard's writer: %s", failures.os_error_line(e))
    final_step = int(jax.device_get(state.step))
    if is_chief and final_step >= train.total_steps:  # also marks the run as finished
        files.write_text(
            os.path.join(workdir, "final_metrics.json"),
            json.dumps({"step": final_step, **final_eval}, indent=1),
        )
    stopped = pretraining.stopped_by if final_step < train.total_steps else 0
    last_line = (
        failures.stopped_line(f"step {final_step} of {train.total_steps}", stopped)
        if stopped
        else ""
    )
    if (
        not stopped
        and train.stop_after_steps
        and final_step == start.step + train.stop_after_steps
        and final_step < train.total_steps
    ):
        last_line = (
            f"Stopped after {train.stop_after_steps} steps (step {final_step} of "
            f"{train.total_steps}); rerun the same command to continue"
        )
    reporting.chief_print(
        pretrain_loop.outputs_summary(
            workdir, final_step, train.total_steps, final_eval, time.time() - started, last_line
        )
    )
    if stopped:  # (the exit status says so: 130 or 143)
        raise failures.Stopped(stopped)
    return final_eval


def fresh_state(
    settings: PretrainingSettings,
    sharded: sharded_run.ShardedRun,
    phases: list[phase_schedule.Phase],
) -> tuple[TrainState, DataPosition]:
    """A new state, with the parameters of `train.init_checkpoint` when set."""
    train = settings.train
    state = sharded.init_state(jax.random.PRNGKey(train.seed))
    if train.init_checkpoint:  # Google TF, Hugging Face or bertjax
        state = state.replace(
            params=pretrained.load_pretrained(
                train.init_checkpoint, sharded.abstract_state.params, sharded.model.config
            )
        )
    return state, DataPosition(phases[0].name, 0)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """Command-line flags; defined only when run as a program, so importing is side-effect free."""
    config_flags.DEFINE_config_file(
        "config", None, "Config file with get_config().", lock_config=True
    )
    flags.DEFINE_string("workdir", None, "Directory for checkpoints, TensorBoard and data cache.")
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "host:port of process 0 (multi-process "
        "runs off TPU VMs); default: $JAX_COORDINATOR_ADDRESS or auto-detection.",
    )
    flags.DEFINE_integer(
        "num_processes", None, "Processes in the job (with --coordinator_address)."
    )
    flags.DEFINE_integer("process_id", None, "This process's index (with --coordinator_address).")
    flags.DEFINE_integer(
        "heartbeat_timeout_seconds",
        None,
        "Seconds without a heartbeat after "
        "which the processes of a multi-process job give up on a lost peer and "
        "exit; default: JAX's (100).",
    )
    flags.DEFINE_integer(
        "join_timeout_seconds",
        None,
        "Seconds every process waits for all "
        "to join the job; then those that joined exit 75 naming the ones that "
        f"did not; default: {peers.JOIN_TIMEOUT_SECONDS}.",
    )
    flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    del argv
    failures.one_line_thread_errors()
    try:
        validate.pretraining(FLAGS.config)  # (a flag error: the same line on every host, unjoined)
        distributed.initialize(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            FLAGS.heartbeat_timeout_seconds,
            FLAGS.join_timeout_seconds,
        )
        stopping.take_sigterm()  # (JAX's preemption notice, seen also while stuck)
        peers.watch(console.log_file(FLAGS.workdir), FLAGS.heartbeat_timeout_seconds)
        train_and_evaluate(
            FLAGS.config,
            FLAGS.workdir,
            overrides=config_flags.get_override_values(FLAGS["config"]).keys(),
        )
    except failures.Stopped as e:  # (its last line said so)
        sys.exit(e.status)
    except KeyboardInterrupt:
        cli.leave(
            "interrupted (Ctrl-C) outside the training steps; nothing to save (rerun to "
            "resume from the last checkpoint)",
            130,
            at_once=True,
        )
    except (UserError, OSError) as e:
        peers.announce_failure(e)  # (peers waiting for this process stop too)
        cli.leave_on(e, FLAGS.workdir)
    except jax.errors.JaxRuntimeError as e:  # a collective failed: a peer lost?
        peers.leave_if_peer_lost(e)
        raise
    except Exception as e:  # a bug: in a multi-process run the others stop too
        peers.leave_on_bug(e)
        raise


if __name__ == "__main__":
    define_flags()
    cli.run(main)
