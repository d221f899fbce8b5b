"""What a run tells its operator: progress lines with throughput, MFU and a steady ETA, the
terminal's status line and checkpoint announcements, printed from process 0 through
bertjax.runtime.console (which also holds the console's filters and the log file). (Where
metrics are written: bertjax.training.metrics_writer; why a run stops on NaN/Inf:
bertjax.training.nonfinite.)"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax

from bertjax.data.batch import PhaseShape
from bertjax.models import flops
from bertjax.models.families import ModelConfig
from bertjax.runtime import console
from bertjax.training import metrics_writer, nonfinite, objectives, optim, phase_schedule, schedules
from bertjax.training.phase_schedule import Phase

if TYPE_CHECKING:  # importing tensorboardX imports torch when it is installed: seconds
    from tensorboardX import SummaryWriter


def announce_commit(directory: str, prefix: str = "") -> Callable[[int], None]:
    """A Checkpointer's `on_commit`: `checkpoint step N -> DIRECTORY/N` once step N is sealed."""
    return lambda step: console.chief_print(f"{prefix}checkpoint step {step} -> {directory}/{step}")


def status_bar(step: int, total: int, eta: float | None, width: int = 24) -> str:
    """`137/500 |######......| 27% eta 1m05s`."""
    filled = int(width * step / max(total, 1))
    return f"{step}/{total} |{'#' * filled}{'.' * (width - filled)}| {step / max(total, 1):.0%}" + (
        f" eta {duration(eta)}" if eta is not None else ""
    )


def duration(seconds: float) -> str:
    """`1h05m` or `4m07s`."""
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


class StepClock:
    """Seconds per training step, measured per phase with compilation excluded: the first
    step a process trains in each phase (which compiles) only starts that phase's clock. The
    median of the recent intervals ignores the occasional evaluation or checkpoint pause."""

    def __init__(self, window: int = 200) -> None:
        self.window = window
        self.intervals: dict[str, collections.deque] = {}
        self.last: tuple[str, int, float] | None = None

    def tick(self, phase: str, step: int, now: float | None = None) -> None:
        """Step `step` of `phase` has finished (its results are on the host) at `now`
        (default: the current time, in seconds)."""
        now = time.perf_counter() if now is None else now
        if self.last and self.last[0] == phase and step > self.last[1]:
            self.intervals.setdefault(phase, collections.deque(maxlen=self.window)).append(
                (now - self.last[2]) / (step - self.last[1])
            )
        self.last = (phase, step, now)

    def restart(self) -> None:
        """The time since the last tick was not training (e.g. an evaluation)."""
        self.last = None

    def seconds_per_step(self, phase: str) -> float | None:
        measured = self.intervals.get(phase)
        return float(sorted(measured)[len(measured) // 2]) if measured else None


def eta_seconds(
    clock: StepClock, phases: Sequence[Phase], step: int, relative_cost: dict[str, float]
) -> float | None:
    """Seconds to the end of the last phase from `step`: each phase's remaining steps at its
    measured time per step; a phase not yet measured at the latest measured one's, scaled by
    `relative_cost` (e.g. model FLOPs per step). None before any measurement."""
    measured = [(p.name, clock.seconds_per_step(p.name)) for p in phases]
    known = [(name, seconds) for name, seconds in measured if seconds is not None]
    if not known:
        return None
    reference, reference_seconds = known[-1]
    total = 0.0
    for phase, (name, measured_seconds) in zip(phases, measured):
        seconds = measured_seconds
        if seconds is None:
            seconds = reference_seconds * relative_cost[name] / relative_cost[reference]
        total += max(0, phase.end_step - max(step, phase.start_step)) * seconds
    return total


class Progress:
    """Accumulates pretraining metric sums on the host and prints/writes them every report;
    times the steps of each phase for the ETA and the terminal's status line."""

    def __init__(
        self,
        phases: Sequence[Phase],
        nonfinite_steps: nonfinite.NonFiniteSteps,
        optimizer: optim.OptimizerConfig,
        model_config: ModelConfig,
        writer: SummaryWriter | None,
        start_step: int,
        jsonl_path: str | None,
    ) -> None:
        """`nonfinite_steps`: the run's policy for skipped steps, counted and applied in
        `add`."""
        self.phases, self.total_steps = list(phases), phases[-1].end_step
        self.start_step, self.nonfinite = start_step, nonfinite_steps
        self.optimizer, self.model_config = optimizer, model_config
        self.writer, self.jsonl_path = writer, jsonl_path
        self.sums: dict[str, float] = {}
        self.tokens = 0
        self.window_start, self.window_start_step = time.time(), start_step
        self.peak_tflops = flops.peak_tflops(jax.devices()[0].device_kind)
        self.clock = StepClock()
        self.flops_per_step = {
            p.name: float(
                p.global_batch_size
                * flops.train_flops_per_sequence(
                    model_config, p.max_seq_length, p.max_predictions_per_seq
                )
            )
            for p in self.phases
        }

    def eta(self, step: int) -> float | None:
        return eta_seconds(self.clock, self.phases, step, self.flops_per_step)

    def add(self, step: int, metrics: dict[str, Any], tokens: int, batch: str = "") -> None:
        """Adds one step's metrics (already on the host); a skipped (non-finite) step goes to
        the policy, which stops the run when it must. `batch` names the step's batch in
        messages."""
        self.clock.tick(phase_schedule.phase_at(self.phases, step - 1).name, step)
        console.TERMINAL.show(status_bar(step, self.total_steps, self.eta(step)))
        if self.nonfinite.add(step, metrics["nonfinite"], batch):
            return
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.sums["steps"] = self.sums.get("steps", 0.0) + 1
        self.tokens += tokens

    def report(self, step: int, phase: Phase) -> dict[str, float]:
        """Prints a progress line for the steps since the last report and resets the window."""
        if not self.sums:
            return {}
        now = time.time()
        means = objectives.summarize(self.sums)
        means["grad_norm"] = self.sums["grad_norm"] / self.sums["steps"]
        means["learning_rate"] = schedules.learning_rate_at(self.optimizer, step - 1)
        means["nonfinite_steps"] = self.nonfinite.total
        means["tokens_per_second"] = self.tokens / max(now - self.window_start, 1e-9)
        flops_per_token = (
            flops.train_flops_per_sequence(
                self.model_config,
                phase.max_seq_length,
                phase.max_predictions_per_seq,
            )
            / phase.max_seq_length
        )
        means["model_tflops_per_second"] = means["tokens_per_second"] * flops_per_token / 1e12
        mfu = flops.mfu(
            means["model_tflops_per_second"] * 1e12, jax.device_count(), self.peak_tflops
        )
        if mfu is not None:
            means["mfu"] = mfu
        eta = self.eta(step)
        console.chief_print(
            (
                f"step {step}/{self.total_steps} "
                f"[{phase.name} L={phase.max_seq_length}] "
                f"loss {means['loss']:.4f} mlm_acc {means['mlm_accuracy']:.4f} "
                + (f"nsp_acc {means['nsp_accuracy']:.4f} " if "nsp_accuracy" in means else "")
                + f"lr {means['learning_rate']:.3e} "
                f"tok/s {means['tokens_per_second']:,.0f} "
                f"TFLOP/s {means['model_tflops_per_second']:.3g} "
                + (f"MFU {mfu:.1%} " if mfu is not None else "")
                + (f"eta {duration(eta)}" if eta is not None else "")
            ).rstrip()
        )
        metrics_writer.write(
            self.writer, self.jsonl_path, "train", step, means, phase=phase.name, split="train"
        )
        self.sums, self.tokens = {}, 0
        self.window_start, self.window_start_step = now, step
        return means

    def log_eval(self, step: int, phase: PhaseShape, means: dict[str, float]) -> None:
        """Prints, and writes to TensorBoard and metrics.jsonl, a held-out evaluation (a
        rerun of a finished run, which trains no step, prints it only: its row is there)."""
        console.chief_print(
            f"eval step {step} [{phase.name}]: "
            + " ".join(f"{k} {v:.4f}" for k, v in sorted(means.items()))
        )
        if self.start_step < self.total_steps:
            metrics_writer.write(
                self.writer,
                self.jsonl_path,
                "eval",
                step,
                means,
                flush=False,
                phase=phase.name,
                split="eval",
            )
        self.clock.restart()


def steps_line(start_step: int, total_steps: int, phases: list[Phase], log_every: int) -> str:
    """What a run (or a resumed one) has left to train from `start_step`: its steps and
    each unfinished phase's."""
    left = [
        (p, p.end_step - max(p.start_step, start_step)) for p in phases if p.end_step > start_step
    ]
    return (
        f"Training steps {start_step + 1}-{total_steps}: "
        + ", ".join(
            f"{p.name} {steps} step{'s' if steps > 1 else ''} x "
            f"{p.global_batch_size} x {p.max_seq_length} tokens"
            for p, steps in left
        )
        + f"; progress every {log_every} steps"
    )
