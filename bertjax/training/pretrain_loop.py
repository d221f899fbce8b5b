"""The pretraining step loop: prefetch the next batch, step, fetch metrics one step late,
switch phases, evaluate, checkpoint (and stop on a preemption notice); the run's last lines."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
import optax

from bertjax.checkpoints import checkpoint
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data.loaders import Loader, PhaseData
from bertjax.runtime import console, failures, files, peers, stopping
from bertjax.training import (
    loop,
    nonfinite,
    objectives,
    phase_schedule,
    reporting,
    sharding,
)
from bertjax.training.loop import Periodic
from bertjax.training.phase_schedule import DataPosition, Phase
from bertjax.training.settings import TrainSettings
from bertjax.training.sharded_run import ShardedRun
from bertjax.training.state import TrainState


def evaluate(
    eval_step: Callable[[optax.Params, dict[str, jax.Array]], dict[str, jax.Array]],
    params: optax.Params,
    loader: Loader | None,
    num_batches: int,
    mesh: jax.sharding.Mesh,
) -> dict[str, float]:
    """Mean MLM/NSP loss and accuracy over the first `num_batches` held-out batches."""
    if loader is None:
        return {}
    sums: dict[str, float] = {}
    for index in range(min(num_batches, loader.batches_per_epoch)):
        batch = sharding.global_batch_from_host(loader.batch(index), mesh)
        for key, value in jax.device_get(eval_step(params, batch)).items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return objectives.summarize(sums)


class PretrainingLoop(loop.Loop):
    """Pretraining on the loop skeleton: what it needs (the settings, the sharded run, each
    phase's data, the checkpointer, the record its checkpoints carry, the progress reports and
    where a profile goes), where it stands while `loop` runs, its step and its actions."""

    # Where the loop stands (set by `loop`):
    state: TrainState
    position: DataPosition  # the next batch to train on, as a checkpoint records it
    current: Phase  # the phase of the next step
    trained: Phase  # the phase of the last step trained
    batch_index: int  # the next batch of `current` to train on
    next_batch: concurrent.futures.Future[dict[str, np.ndarray]]  # (prefetched)
    pending: Pending | None  # the last step's metrics, fetched one step late
    stop_at: int  # the step this run stops at (train.stop_after_steps, else the last)
    prefetcher: concurrent.futures.ThreadPoolExecutor

    def __init__(
        self,
        settings: TrainSettings,  # config.train
        run: ShardedRun,
        phase_data: list[PhaseData],
        checkpointer: checkpoint.Checkpointer,
        record: RunRecord,  # what its checkpoints record
        progress: reporting.Progress,
        restart_step: int = 0,  # long_phase.restart_optimizer: fresh moments before it; 0: none
        profile_dir: str = "",  # where a profile of train.profile_steps steps goes
    ) -> None:
        self.settings, self.run, self.checkpointer = settings, run, checkpointer
        self.record, self.progress = record, progress
        self.restart_step, self.profile_dir = restart_step, profile_dir
        self.phases = progress.phases  # the schedule; each phase's data by its name:
        self.data = {pd.phase.name: pd for pd in phase_data}
        self.stopped_by = 0  # the signal (SIGINT, SIGTERM) that stopped `loop`; 0: none

    def eval_and_log(self, step: int, params: optax.Params, phase: Phase) -> dict[str, float]:
        means = evaluate(
            self.run.eval_step,
            params,
            self.data[phase.name].eval,
            self.settings.eval_batches,
            self.run.mesh,
        )
        if means:
            self.progress.log_eval(step, phase, means)
        return means

    def loop(
        self, state: TrainState, position: DataPosition, start_step: int
    ) -> tuple[TrainState, DataPosition, dict[str, float]]:
        """Trains from `start_step` at `position` to the end (or train.stop_after_steps);
        returns the state, the next data position and the final evaluation."""
        train, total = self.settings, self.settings.total_steps
        self.state, self.position, self.pending = state, position, None
        self.current = next((p for p in self.phases if p.name == position.phase), self.phases[0])
        self.trained = self.current
        self.batch_index = position.batch_index  # (the next batch of `current`)
        self.stop_at = (
            min(total, start_step + train.stop_after_steps) if train.stop_after_steps else total
        )
        with (
            loop.running(self.run.mesh, forward_as_sigterm=jax.process_count() > 1) as ctrl_c,
            concurrent.futures.ThreadPoolExecutor(1) as self.prefetcher,
        ):
            self.next_batch = self.prefetch()
            self.train_to_stop(start_step, ctrl_c)
            final_step = int(jax.device_get(self.state.step))
            final_eval = (
                self.eval_and_log(final_step, self.state.params, self.current)
                if final_step == total
                else {}
            )
            if self.checkpointer.latest_step() != final_step:
                self.save(final_step, force=True)
            self.checkpointer.wait()
            return self.state, self.position, final_eval

    def train_to_stop(self, start_step: int, ctrl_c: failures.CtrlC) -> None:
        """The steps to `stop_at` (or a stop request); after an OSError (e.g. a full disk
        under metrics.jsonl or TensorBoard's events), a save and one TrainingError."""
        try:
            self.train_steps(
                start_step, self.stop_at, ctrl_c, self.settings.profile_steps, self.profile_dir
            )
            stopping.now_doing("finishing (the last checkpoint and evaluation)")
            self.flush_pending()
        except OSError as e:
            step_now = int(jax.device_get(self.state.step))
            try:
                if self.checkpointer.latest_step() != step_now:
                    self.save(step_now, force=True)
                self.checkpointer.wait()
                saved = f"saved a checkpoint at step {step_now}, which a rerun resumes from"
            except (checkpoint.CheckpointWriteError, nonfinite.NonFiniteState) as save_error:
                saved = f"no checkpoint could be saved ({save_error})"
            raise nonfinite.TrainingError(f"{failures.os_error_line(e)}; {saved}") from e

    def prefetch(self) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """Batch `batch_index` of the current phase, read in the background."""
        return self.prefetcher.submit(self.data[self.current.name].train.batch, self.batch_index)

    def flush_pending(self) -> None:
        """The last step's metrics to the progress reports (its results on the host: the
        step has finished)."""
        if self.pending is not None:
            step, metrics, tokens, batch = self.pending
            self.progress.add(step, jax.device_get(metrics), tokens, batch)
            peers.reached_step(step)
            self.pending = None

    def save(self, step: int, force: bool = False) -> None:
        """Saves the state at `step` (after its metrics: is it the first finite step since
        resuming?); the checkpointer announces it once sealed."""
        self.flush_pending()
        loop.save(
            self.checkpointer,
            self.progress.nonfinite,
            step,
            self.state,
            self.position.as_dict(),
            self.record.as_json(),
            force=force,
        )

    def train_step(self, index: int) -> None:
        """Step `index + 1`: the prefetched batch, then the next one prefetched (of the next
        step's phase: a new phase starts at its first batch, announced)."""
        if index == self.restart_step:  # (a checkpoint at this step has the old moments)
            self.state = self.run.restart_optimizer(self.state)
        self.trained = self.current
        trained_batch = f"batch {self.batch_index} of phase {self.current.name}"
        host_batch = self.next_batch.result()
        upcoming = phase_schedule.phase_at(self.phases, index + 1)
        if upcoming.name != self.current.name:
            self.current, self.batch_index = upcoming, -1
            console.chief_print(
                f"phase {upcoming.name} from step {upcoming.start_step + 1}: "
                f"{upcoming.max_seq_length} tokens, {upcoming.max_predictions_per_seq} "
                f"predictions per sequence, batch {upcoming.global_batch_size}"
            )
        self.batch_index += 1
        if index + 1 < self.stop_at:
            self.next_batch = self.prefetch()
        self.state, metrics = self.run.train_step(
            self.state, sharding.global_batch_from_host(host_batch, self.run.mesh)
        )
        self.flush_pending()  # the previous step's metrics: ready by now, so no stall
        self.pending = Pending(
            index + 1, metrics, host_batch["input_ids"].size * jax.process_count(), trained_batch
        )
        self.position = DataPosition(self.current.name, self.batch_index)

    def actions(self, ctrl_c: failures.CtrlC) -> list[Periodic]:
        """Progress lines, held-out evaluations, the stop request, the checkpoints due."""
        train = self.settings
        return [
            Periodic(self.report, train.log_every, at={self.stop_at}),
            Periodic(self.evaluate_held_out, train.eval_every),
            Periodic(lambda done: self.stop(ctrl_c, done)),
            Periodic(self.save_due),
            Periodic(lambda done: self.checkpointer.seal_finished()),
        ]

    def report(self, done: int) -> None:
        self.flush_pending()
        self.progress.report(done, self.trained)

    def stop(self, ctrl_c: failures.CtrlC, done: int) -> int:
        """A stop request after step `done`: a progress line, the line that says so, and the
        signal (the save follows the loop)."""
        stopped = loop.stop_request(ctrl_c, done, self.checkpointer)
        if stopped:
            self.report(done)
            loop.announce_stop(ctrl_c, done)
            self.stopped_by = stopped
        return stopped

    def evaluate_held_out(self, done: int) -> None:
        if done != self.settings.total_steps:  # (the last evaluation follows the loop)
            self.eval_and_log(done, self.state.params, self.trained)

    def save_due(self, done: int) -> None:
        if self.checkpointer.should_save(done) and done != self.stop_at:  # (the last: after)
            self.save(done)


class Pending(NamedTuple):
    """A step's metrics, fetched one step late: the step, its metrics on the device, its
    tokens and its batch's name (for messages)."""

    step: int
    metrics: dict[str, jax.Array]
    tokens: int
    batch: str


def outputs_summary(
    workdir: str,
    step: int,
    total_steps: int,
    final_eval: dict[str, float],
    seconds: float,
    last_line: str = "",
) -> str:
    """The run's last lines: where it stands (`Done` only once finished), the held-out
    metrics, where each output is, and `last_line` (e.g. how to continue a stopped run)."""
    lines = [
        f"{'Done in' if step >= total_steps else 'Ran for'} {reporting.duration(seconds)}: "
        f"step {step} of {total_steps}"
        + (
            "; held-out " + " ".join(f"{k} {v:.4f}" for k, v in sorted(final_eval.items()))
            if final_eval
            else ""
        )
    ]
    outputs = [
        ("checkpoints", f"checkpoints (latest: step {step})"),
        ("metrics.jsonl", "progress and evaluation rows"),
        ("tensorboard", f"TensorBoard (tensorboard --logdir {workdir})"),
        ("final_metrics.json", "final evaluation"),
        ("config.json", "resolved config"),
        ("startup_report.txt", "parameter shardings and bytes per device"),
        ("log.txt", "the full log: every console line and the libraries' messages"),
    ]
    lines += [
        f"  {os.path.join(workdir, name)}: {what}"
        for name, what in outputs
        if files.exists(os.path.join(workdir, name))
    ]
    return "\n".join(lines + ([last_line] if last_line else []))
