"""`python -m bertjax.train --config=configs/large.py --workdir=DIR`: BERT pretraining.

Any config field can be overridden on the command line, e.g. `--config.train.total_steps=100`.
Running the same command again resumes from the latest checkpoint in DIR.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from collections.abc import Collection

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from bertjax import cli
from bertjax.checkpoints import checkpoint
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data import loaders
from bertjax.errors import ConfigError, UserError
from bertjax.models import families
from bertjax.runtime import agreement, console, distributed, failures, files, locks, peers, stopping
from bertjax.training import (
    guards,
    init_architecture,
    pretrain_run,
    reporting,
    resume,
    run_schedule,
    sharded_run,
    tokenizer_model,
    validate,
)
from bertjax.training.settings import PretrainingSettings


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
    config = with_checkpoint_model(config, workdir, overrides)
    validate.model_family(config)
    if not config.train.init_checkpoint:
        config.model.update(
            tokenizer_model.model_of_tokenizer_file(
                config.model.to_dict(), validate.settings(config).data, overrides
            )
        )
    settings = validate.pretraining(config)  # (typed, built once)
    with locks.held_workdir(workdir, jax.process_index()), contextlib.ExitStack() as accepted:
        return _train_and_evaluate(settings, config.to_json(), workdir, devices, accepted)


def with_checkpoint_model(
    config: ml_collections.ConfigDict,
    workdir: str,
    overrides: Collection[str],
    tell: bool = True,
) -> ml_collections.ConfigDict:
    """A copy of `config` with its train.init_checkpoint's model and the command line's
    `overrides` (`init_architecture.model_of_init_checkpoint`; told if `tell`)."""
    config = copy.deepcopy(config)
    config.model.update(
        init_architecture.model_of_init_checkpoint(
            config.model.to_dict(), config.train.init_checkpoint, workdir, overrides, tell
        )
    )
    return config


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
        mesh.devices.size,
    )
    agreement.check("corpus", agreement.data_fields(record.data or {}), agreement.SAME_FILES)

    def check(found: resume.Found) -> None:
        resume_from.check(found, record, data, phases, train.allow_changed_data)

    if found:
        check(found)  # model and data, before any preparation
    model_config = families.model_config(model)
    cache_dir = data.cache_dir or files.local_cache_dir(workdir)
    tokenizer, record = pretrain_run.checked_tokenizer(
        settings, cache_dir, record, (found, resume_from.where(found.step)) if found else None
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
    pretrain_run.report_startup(workdir, config_json, sharded, phases, train.grad_accum_steps)
    stopping.now_doing(
        f"restoring checkpoint {found.step}" if found else "building the initial state"
    )
    if found:
        state, position = resume_from.restore(found, sharded.abstract_state, record, check)
    else:
        state, position = pretrain_run.fresh_state(train, sharded, model_config, phases)
    start = resume.Start.of(state, position, found, phases)
    state, final_eval, stopped_by, start = pretrain_run.train_to_end(
        train, sharded, phase_data, plan, model_config, record, start, resume_from, check, workdir
    )
    pretrain_run.finish(
        workdir, train, state, final_eval, stopped_by, start.step, time.time() - started
    )
    return final_eval


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
    overrides = config_flags.get_override_values(FLAGS["config"]).keys()
    try:
        checked = with_checkpoint_model(  # (the model the run takes, told
            FLAGS.config,
            FLAGS.workdir,
            overrides,
            tell=False,  # later: no JAX backend yet)
        )
        validate.pretraining(checked)  # (a flag error: the same line on every host, unjoined)
        distributed.initialize(
            FLAGS.coordinator_address,
            FLAGS.num_processes,
            FLAGS.process_id,
            FLAGS.heartbeat_timeout_seconds,
            FLAGS.join_timeout_seconds,
        )
        stopping.take_sigterm()  # (JAX's preemption notice, seen also while stuck)
        peers.watch(console.log_file(FLAGS.workdir), FLAGS.heartbeat_timeout_seconds)
        train_and_evaluate(FLAGS.config, FLAGS.workdir, overrides=overrides)
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
