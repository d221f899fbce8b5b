"""A pretraining run (`PretrainingRun`): its typed settings and workdir, held once, and its
stages in turn (`run`): the mesh, the schedule planned or resumed and the run record; the
tokenizer, checked (`checked_tokenizer`); the data prepared; the model built; the start-up
report (`report_startup`); the state restored or new (`fresh_state`); the training to its end
(`train_to_end`: the loop, once more from the checkpoint before after a suspect resume, then
the checkpoints and metrics closed); and the run's last lines (`finish`: final metrics, the
outputs, a stop's exit status).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Collection

import jax
import ml_collections
from absl import logging

from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data import corpus_source, loaders, tokenization
from bertjax.data.errors import DataError
from bertjax.data.loaders import PhaseData
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.runtime import agreement, console, failures, files, locks, peers, stopping
from bertjax.training import (
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
    tokenizer_model,
    validate,
)
from bertjax.training.phase_schedule import DataPosition
from bertjax.training.pretrain_loop import PretrainingLoop
from bertjax.training.settings import PretrainingSettings
from bertjax.training.sharded_run import ShardedRun
from bertjax.training.state import TrainState


class PretrainingRun:
    """One pretraining run: its typed `settings` (`config_json`: its whole config, as
    config.json records it) in its locked `workdir`, on `devices` (None: all). `run` takes it
    through its stages; each reads the settings and the workdir held here."""

    def __init__(
        self,
        settings: PretrainingSettings,
        config_json: str,
        workdir: str,
        devices: list[jax.Device] | None = None,
    ) -> None:
        self.settings = settings
        self.config_json = config_json
        self.workdir = workdir
        self.devices = devices

    def train(self, overrides: Collection[str] = ()) -> dict[str, float]:
        """Pretrains (or resumes) in the workdir, which no other run may use meanwhile (a
        lock); returns the final evaluation metrics. The hosts agree on the config first; then
        the run takes its model (`resolved`, told)."""
        agreement.check(
            "config", agreement.config_fields(json.loads(self.config_json), self.workdir)
        )
        self.settings, self.config_json = self.resolved(overrides)
        with (
            locks.held_workdir(self.workdir, jax.process_index()),
            contextlib.ExitStack() as accepted,
        ):
            return self.run(accepted)

    def resolved(
        self, overrides: Collection[str], tell: bool = True
    ) -> tuple[PretrainingSettings, str]:
        """The settings and config JSON with the model the run takes, checked
        (`validate.model`): train.init_checkpoint's (`init_architecture.model_of_init_checkpoint`),
        else the config's with the fields its tokenizer file sets
        (`tokenizer_model.model_of_tokenizer_file`); `overrides` (the dotted fields set on the
        command line) must agree with it; each change told in a line if `tell`."""
        settings = self.settings
        config = ml_collections.ConfigDict(json.loads(self.config_json))
        config.model.update(
            init_architecture.model_of_init_checkpoint(
                dict(settings.model), settings.train.init_checkpoint, self.workdir, overrides, tell
            )
        )
        validate.model_family(config.model)
        if not settings.train.init_checkpoint:
            config.model.update(
                tokenizer_model.model_of_tokenizer_file(
                    config.model.to_dict(), settings.data, overrides, tell
                )
            )
        settings = settings.with_model(config.model.to_dict())
        validate.model(settings)
        return settings, config.to_json()

    def run(self, accepted: contextlib.ExitStack) -> dict[str, float]:
        """Trains (or resumes) to the end; returns the final evaluation metrics. Once its
        settings are accepted, it writes config.json and its log file (held open by
        `accepted`)."""
        started = time.time()
        settings, workdir = self.settings, self.workdir
        train, data, model = settings.train, settings.data, settings.model_config
        phases = settings.phases
        mesh = sharded_run.make_mesh(settings.mesh, self.devices)
        sharded_run.check_batches(
            mesh, phases, train.grad_accum_steps, model.max_position_embeddings
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
        phases = plan.phases
        record = RunRecord.new(
            families.recorded_fields(model),
            self.config_json,
            guards.data_identity(data, phases),
            plan.record(),
            mesh.devices.size,
        )
        agreement.check("corpus", agreement.data_fields(record.data or {}), agreement.SAME_FILES)

        def check(found: resume.Found) -> None:
            resume_from.check(found, record, data, phases, train.allow_changed_data)

        if found:
            check(found)  # model and data, before any preparation
        cache_dir = data.cache_dir or files.local_cache_dir(workdir)
        tokenizer, record = self.checked_tokenizer(
            cache_dir, record, (found, resume_from.where(found.step)) if found else None
        )
        stopping.now_doing("preparing data")
        phase_data = loaders.prepare_data(
            data,
            phases,
            model.vocab_size,
            tokenizer,
            cache_dir,
            next_sentence_prediction=objective.uses_nsp,
        )
        agreement.check("prepared", {})  # (where a host that failed to prepare stops the others)
        stopping.now_doing("building the model (compiling)")
        sharded = sharded_run.build_pretraining(
            model,
            plan.optimizer_config,
            mesh,
            phases,
            train.grad_accum_steps,
            report=False,
            objective=objective,
        )
        accepted.enter_context(console.logging_to(console.log_file(workdir)))  # (once accepted)
        self.report_startup(sharded, phases)
        stopping.now_doing(
            f"restoring checkpoint {found.step}" if found else "building the initial state"
        )
        if found:
            state, position = resume_from.restore(found, sharded.abstract_state, record, check)
        else:
            state, position = self.fresh_state(sharded, model, phases)
        start = resume.Start.of(state, position, found, phases)
        state, final_eval, stopped_by, start = self.train_to_end(
            sharded, phase_data, plan, model, record, start, resume_from, check
        )
        self.finish(state, final_eval, stopped_by, start.step, time.time() - started)
        return final_eval

    def checked_tokenizer(
        self,
        cache_dir: str,
        record: RunRecord,
        resumed_from: tuple[resume.Found, str] | None,
    ) -> tuple[tokenization.Tokenizer, RunRecord]:
        """The run's tokenizer, as every entry point resolves it (`pretrained.tokenizer_of`):
        `data.vocab_file` if named, else init_checkpoint's own, else the configured one (a
        SentencePiece model trained once into `cache_dir`); and `record` with its fingerprint.
        Refused unless its ids are init_checkpoint's, it fits the model's vocabulary, and it is
        the other processes' and the checkpoint's `resumed_from` (found, where)."""
        train, data, model = self.settings.train, self.settings.data, self.settings.model_config
        init_checkpoint = train.init_checkpoint
        if resumed_from and not pretrained.exists(init_checkpoint):
            init_checkpoint = ""  # (gone since: the checkpoint's record names its tokenizer)
        source = pretrained.Source(
            init_checkpoint=init_checkpoint,
            vocab_file=data.vocab_file,
            tokenizer=data.tokenizer,
            do_lower_case=data.do_lower_case,
            vocab_flag="--config.data.vocab_file",
        )
        tokenizer = pretrained.tokenizer_of(
            source,
            pretrained.pretraining_run(source),
            lambda: corpus_source.load_or_train_tokenizer(
                data, cache_dir, jax.process_index(), jax.process_count()
            ),
        )
        if not resumed_from:
            init_architecture.check_tokenizer(model, tokenizer)
        if tokenizer.vocab_size > model.vocab_size:
            raise DataError(
                f"the tokenizer has {tokenizer.vocab_size} tokens but "
                f"model.vocab_size={model.vocab_size}; set --config.model.vocab_size="
                f"{tokenizer.vocab_size} (or more)"
            )
        record = dataclasses.replace(record, tokenizer=tokenizer.fingerprint())
        agreement.check("tokenizer", agreement.tokenizer_fields(tokenizer), agreement.SAME_FILES)
        if resumed_from:  # (the model and data were checked before)
            found, where = resumed_from
            checkpoint_checks.check_compatible(found.record.as_json(), record.as_json(), where)
        return tokenizer, record

    def report_startup(self, sharded: ShardedRun, phases: list[phase_schedule.Phase]) -> None:
        """Process 0 writes config.json and the start-up report's full table into the workdir,
        and prints its totals and the micro-batches per step where there are several."""
        if jax.process_index() != 0:
            return
        workdir, config_json = self.workdir, self.config_json
        files.write_text(
            os.path.join(workdir, "config.json"),
            json.dumps(json.loads(config_json), indent=1) + "\n",
        )
        mesh = sharded.mesh
        report_path = os.path.join(workdir, "startup_report.txt")
        files.write_text(
            report_path, memory.report(sharded.model, sharded.abstract_state, mesh, phases) + "\n"
        )
        console.say(
            memory.summary(sharded.model, sharded.abstract_state, mesh, phases)
            + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else "")
            + f"; full table: {report_path}"
        )
        if any(steps > 1 for steps in sharded.grad_accum.values()):
            console.say(
                "Micro-batches per step: "
                + ", ".join(f"{steps} ({name})" for name, steps in sharded.grad_accum.items())
                + (
                    ""
                    if self.settings.train.grad_accum_steps
                    else " (train.grad_accum_steps=0: the fewest that fit the devices' memory)"
                )
            )

    def fresh_state(
        self,
        sharded: ShardedRun,
        model_config: ModelConfig,
        phases: list[phase_schedule.Phase],
    ) -> tuple[TrainState, DataPosition]:
        """A new state of `sharded`'s model (of `model_config`), with the parameters of
        `train.init_checkpoint` when set; the pretraining heads a bare encoder (or a fine-tuned
        model) lacks keep their initialisation, as the original's, which is said in a line."""
        train = self.settings.train
        state = sharded.init_state(jax.random.PRNGKey(train.seed))
        if train.init_checkpoint:  # Google TF, Hugging Face or bertjax
            heads = pretrained_weights.pretraining_heads(state.params, model_config)
            loaded = pretrained_weights.load_pretrained(
                train.init_checkpoint, sharded.abstract_state.params, model_config, optional=heads
            )
            fresh = [name for name in heads if name not in loaded]
            if fresh:
                console.chief_print(
                    pretrained_weights.fresh_heads_line(train.init_checkpoint, fresh)
                )
            state = state.replace(params=dict(state.params, **loaded))
        return state, DataPosition(phases[0].name, 0)

    def train_to_end(
        self,
        sharded: ShardedRun,
        phase_data: list[PhaseData],
        plan: run_schedule.Plan,
        model_config: ModelConfig,
        record: RunRecord,
        start: resume.Start,
        resume_from: resume.Resume,
        check: Callable[[resume.Found], None],
    ) -> tuple[TrainState, dict[str, float], int, resume.Start]:
        """Says where the run starts and trains from `start` to the end (or a stop), once more
        from the checkpoint before it after a suspect resume (`resume_from.fall_back`, with
        `check`); then closes the checkpoints and metrics. Returns the state, the final
        evaluation, the signal that stopped the run (0: none) and what it last started from."""
        train, workdir = self.settings.train, self.workdir
        if start.step >= train.total_steps:
            console.chief_print(f"Training already finished ({start.step} steps); evaluating only")
        else:
            console.chief_print(
                reporting.steps_line(start.step, train.total_steps, plan.phases, train.log_every)
            )
        checkpointer = resume_from.checkpointer
        writer = metrics_writer.open_writer(workdir)
        try:
            while True:  # (once more from the checkpoint before, after a suspect resume)
                progress = reporting.Progress(
                    plan.phases,
                    nonfinite.NonFiniteSteps(
                        train.max_nonfinite_steps, start.step, resume_from.resumed_from(start)
                    ),
                    plan.optimizer_config,
                    model_config,
                    writer,
                    start.step,
                    os.path.join(workdir, "metrics.jsonl") if jax.process_index() == 0 else None,
                )
                pretraining = PretrainingLoop(
                    train,
                    sharded,
                    phase_data,
                    checkpointer,
                    record,
                    progress,
                    restart_step=plan.optimizer_config.restart_step,
                    profile_dir=os.path.join(workdir, "profile"),
                )
                try:
                    state, _, final_eval = pretraining.loop(start.state, start.position, start.step)
                    break
                except nonfinite.NonFiniteAfterResume as e:
                    start = resume_from.fall_back(
                        start, e, sharded.abstract_state, record, check, plan.phases
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
        return state, final_eval, pretraining.stopped_by, start

    def finish(
        self,
        state: TrainState,
        final_eval: dict[str, float],
        stopped_by: int,
        start_step: int,
        seconds: float,
    ) -> None:
        """The run's end after `seconds`: final_metrics.json once finished (it marks the run as
        such), the outputs' summary and its last line; failures.Stopped after a stop by signal
        `stopped_by` before the end (exit 130 or 143)."""
        train, workdir = self.settings.train, self.workdir
        final_step = int(jax.device_get(state.step))
        if jax.process_index() == 0 and final_step >= train.total_steps:
            files.write_text(
                os.path.join(workdir, "final_metrics.json"),
                json.dumps({"step": final_step, **final_eval}, indent=1),
            )
        stopped = stopped_by if final_step < train.total_steps else 0
        last_line = (
            failures.stopped_line(f"step {final_step} of {train.total_steps}", stopped)
            if stopped
            else ""
        )
        if (
            not stopped
            and train.stop_after_steps
            and final_step == start_step + train.stop_after_steps
            and final_step < train.total_steps
        ):
            last_line = (
                f"Stopped after {train.stop_after_steps} steps (step {final_step} of "
                f"{train.total_steps}); rerun the same command to continue"
            )
        console.chief_print(
            pretrain_loop.outputs_summary(
                workdir, final_step, train.total_steps, final_eval, seconds, last_line
            )
        )
        if stopped:  # (the exit status says so: 130 or 143)
            raise failures.Stopped(stopped)
