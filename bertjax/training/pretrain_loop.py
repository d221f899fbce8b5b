"""The pretraining step loop: prefetch the next batch, step, fetch metrics one step late,
switch phases, evaluate, checkpoint (and stop on a preemption notice); the run's last lines."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any

import jax
import optax

from bertjax.checkpoints import checkpoint
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data.loaders import Loader, PhaseData
from bertjax.runtime import failures, files, peers, stopping
from bertjax.training import loop, nonfinite, objectives, phase_schedule, reporting, sharding
from bertjax.training.phase_schedule import DataPosition
from bertjax.training.settings import TrainSettings
from bertjax.training.sharded_run import ShardedRun
from bertjax.training.state import TrainState


def evaluate(
    eval_step, params, loader: Loader | None, num_batches: int, mesh: jax.sharding.Mesh
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


@dataclasses.dataclass
class PretrainingLoop:
    """What the loop needs besides the state and where it stands."""

    settings: TrainSettings  # config.train
    run: ShardedRun
    phase_data: list[PhaseData]
    checkpointer: checkpoint.Checkpointer
    record: RunRecord  # what its checkpoints record
    progress: reporting.Progress
    writer: Any = None  # metrics_writer.open_writer's TensorBoard writer
    restart_step: int = 0  # long_phase.restart_optimizer: fresh moments before this step; 0: none
    stopped_by: int = 0  # set by `loop`: the signal (SIGINT, SIGTERM) that stopped it; 0: none

    def eval_and_log(self, step: int, params: optax.Params, pd: PhaseData) -> dict[str, float]:
        means = evaluate(
            self.run.eval_step, params, pd.eval, self.settings.eval_batches, self.run.mesh
        )
        if means:
            self.progress.log_eval(step, pd.phase, means)
        return means

    def loop(
        self, state: TrainState, position: DataPosition, start_step: int
    ) -> tuple[TrainState, DataPosition, dict[str, float]]:
        """Trains from `start_step` at `position` to the end (or train.stop_after_steps);
        returns the state, the next data position and the final evaluation."""
        with (
            loop.running(self.run.mesh, forward_as_sigterm=jax.process_count() > 1) as ctrl_c,
            concurrent.futures.ThreadPoolExecutor(1) as prefetcher,
        ):
            return self._loop(state, position, start_step, prefetcher, ctrl_c)

    def _loop(self, state, position, start_step, prefetcher, ctrl_c):
        train, mesh, checkpointer = self.settings, self.run.mesh, self.checkpointer
        total = train.total_steps
        phases = [pd.phase for pd in self.phase_data]
        by_name = {pd.phase.name: pd for pd in self.phase_data}
        current = by_name.get(position.phase) or self.phase_data[0]
        trained = current  # the phase of the last step trained
        batch_index = position.batch_index  # the next batch of `current` to train on
        next_batch = prefetcher.submit(current.train.batch, batch_index)
        pending = None  # (step, device metrics, tokens, batch name): fetched one step late

        def flush_pending() -> None:
            nonlocal pending
            if pending is not None:
                self.progress.add(pending[0], jax.device_get(pending[1]), pending[2], pending[3])
                peers.reached_step(pending[0])  # (its results on the host: finished)
                pending = None

        def save(step: int, force: bool = False) -> None:
            flush_pending()  # (this step's metrics: is it the first finite one since resuming?)
            # (the checkpointer announces the save once sealed)
            loop.save(
                checkpointer,
                self.progress.nonfinite,
                step,
                state,
                position.as_dict(),
                self.record.as_json(),
                force=force,
            )

        stop_at = (
            min(total, start_step + train.stop_after_steps) if train.stop_after_steps else total
        )

        def step(index: int) -> None:
            nonlocal state, current, trained, batch_index, next_batch, pending, position
            if index == self.restart_step:  # (a checkpoint at this step has the old moments)
                state = self.run.restart_optimizer(state)
            trained = current
            trained_batch = f"batch {batch_index} of phase {current.phase.name}"
            host_batch = next_batch.result()
            upcoming = phase_schedule.phase_at(phases, index + 1)
            if upcoming.name != current.phase.name:
                current, batch_index = by_name[upcoming.name], -1
                reporting.chief_print(
                    f"phase {upcoming.name} from step {upcoming.start_step + 1}: "
                    f"{upcoming.max_seq_length} tokens, {upcoming.max_predictions_per_seq} "
                    f"predictions per sequence, batch {upcoming.global_batch_size}"
                )
            batch_index += 1
            if index + 1 < stop_at:
                next_batch = prefetcher.submit(current.train.batch, batch_index)
            state, metrics = self.run.train_step(
                state, sharding.global_batch_from_host(host_batch, mesh)
            )
            flush_pending()  # the previous step's metrics: ready by now, so no stall
            pending = (
                index + 1,
                metrics,
                host_batch["input_ids"].size * jax.process_count(),
                trained_batch,
            )
            position = DataPosition(current.phase.name, batch_index)

        def report(done: int) -> None:
            flush_pending()
            self.progress.report(done, trained.phase)

        def stop(done: int) -> int:
            stopped = loop.stop_request(ctrl_c, done, checkpointer)
            if stopped:
                report(done)
                print(
                    f"{'Ctrl-C' if ctrl_c.requested else 'Preemption notice'}: saving a "
                    f"checkpoint at step {done} and exiting",
                    flush=True,
                )
                self.stopped_by = stopped
            return stopped

        def evaluate_held_out(done: int) -> None:
            if done != total:  # (the last evaluation follows the loop)
                self.eval_and_log(done, state.params, trained)

        def save_due(done: int) -> None:
            if checkpointer.should_save(done) and done != stop_at:  # (the last: after the loop)
                save(done)

        actions = [
            loop.Periodic(report, train.log_every, at={stop_at}),
            loop.Periodic(evaluate_held_out, train.eval_every),
            loop.Periodic(stop),
            loop.Periodic(save_due),
            loop.Periodic(lambda done: checkpointer.seal_finished()),
        ]
        try:
            loop.run(start_step, stop_at, step, actions)
            stopping.now_doing("finishing (the last checkpoint and evaluation)")
            flush_pending()
        except OSError as e:  # e.g. a full disk under metrics.jsonl or TensorBoard's events
            step_now = int(jax.device_get(state.step))
            try:
                if checkpointer.latest_step() != step_now:
                    save(step_now, force=True)
                checkpointer.wait()
                saved = f"saved a checkpoint at step {step_now}, which a rerun resumes from"
            except (checkpoint.CheckpointWriteError, nonfinite.NonFiniteState) as save_error:
                saved = f"no checkpoint could be saved ({save_error})"
            raise nonfinite.TrainingError(f"{failures.os_error_line(e)}; {saved}") from e
        final_step = int(jax.device_get(state.step))
        final_eval = (
            self.eval_and_log(final_step, state.params, current) if final_step == total else {}
        )
        if checkpointer.latest_step() != final_step:
            save(final_step, force=True)
        checkpointer.wait()
        return state, position, final_eval


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
