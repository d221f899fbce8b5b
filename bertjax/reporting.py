"""What a run tells its operator: progress lines with throughput, MFU and a steady ETA,
TensorBoard scalars, metrics.jsonl, chief-only printing, and the small-file writer that a
kill -9 cannot leave half-written (the console's filters and the log file: bertjax.console)."""
from __future__ import annotations

import collections
import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
from absl import logging

from bertjax import console, failures, files, flops, objectives, optim, schedule, steps
from bertjax.model import BertConfig
from bertjax.schedule import Phase
from bertjax.errors import UserError

if TYPE_CHECKING:  # importing tensorboardX imports torch when it is installed: seconds
    from tensorboardX import SummaryWriter


class TrainingError(UserError, RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps); the message says why."""


class NonFiniteAfterResume(TrainingError):
    """Every step since the run resumed was non-finite (not for its inputs): the checkpoint
    it resumed from is suspect."""


def chief_print(line: str) -> None:
    """Progress lines come from process 0 only (every process computes the same values)."""
    if jax.process_index() == 0:
        console.TERMINAL.clear()
        print(line, flush=True)


def announce_commit(directory: str, prefix: str = "") -> Callable[[int], None]:
    """A Checkpointer's `on_commit`: `checkpoint step N -> DIRECTORY/N` once step N is sealed."""
    return lambda step: chief_print(f"{prefix}checkpoint step {step} -> {directory}/{step}")


def status_bar(step: int, total: int, eta: float | None, width: int = 24) -> str:
    """`137/500 |######......| 27% eta 1m05s`."""
    filled = int(width * step / max(total, 1))
    return (f"{step}/{total} |{'#' * filled}{'.' * (width - filled)}| {step / max(total, 1):.0%}"
            + (f" eta {duration(eta)}" if eta is not None else ""))


def write_text(path: str, text: str, append: bool = False) -> None:
    """Writes a small text file so that a kill -9 never loses what it held. Locally, an append
    is one O_APPEND write (earlier lines are never rewritten; one that does not fit is taken
    back) and a rewrite goes through a renamed temporary file. Object stores (gs://) cannot
    append; there an append rewrites the object, which each upload replaces whole."""
    if not files.is_remote(path):
        if append:
            fd, data = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), \
                text.encode("utf-8")
            try:
                with failures.naming(path):
                    written = os.write(fd, data)
                    if written < len(data):  # a full disk: no partial line is left behind
                        os.ftruncate(fd, os.fstat(fd).st_size - written)
                        raise failures.no_space(path)
            finally:
                os.close(fd)
        else:
            temporary = f"{path}.tmp{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(temporary, path)
        return
    if append and files.exists(path):
        text = files.read_text(path) + text
    files.write_text(path, text)


def duration(seconds: float) -> str:
    """`1h05m` or `4m07s`."""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


class _ObjectEventFile:
    """TensorBoard's event file on an object store, written through bertjax.files: objects
    cannot be appended, so each flush uploads the whole file (once, whatever tensorboardX's
    own GCS writer would repeat when garbage-collected)."""

    def __init__(self, path: str) -> None:
        self.path, self.buffer, self.pending = path, bytearray(), False

    def write(self, data: bytes) -> None:
        self.buffer += data
        self.pending = True

    def flush(self) -> None:
        if self.pending:
            with files.open(self.path, "wb") as f:
                f.write(bytes(self.buffer))
            self.pending = False

    close = flush


class _ObjectEventFiles:
    """tensorboardX's writer factory for a URL scheme."""
    open = staticmethod(_ObjectEventFile)

    def directory_check(self, path: str) -> None:
        del path  # object stores need no directories


def open_writer(workdir: str) -> SummaryWriter | None:
    """TensorBoard event writer in `workdir/tensorboard`, on process 0 only."""
    from tensorboardX import SummaryWriter, record_writer

    if files.is_remote(workdir):
        record_writer.register_writer_factory(workdir.split(":")[0], _ObjectEventFiles())
    return SummaryWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 \
        else None


def log_scalars(writer: SummaryWriter | None, prefix: str, values: dict[str, float], step: int,
                flush: bool = True) -> None:
    """`prefix/key` scalars at `step` (no-op without a writer)."""
    if writer:
        for key, value in values.items():
            writer.add_scalar(f"{prefix}/{key}", value, step)
        if flush:
            with failures.naming(writer.logdir):
                writer.flush()


class StepClock:
    """Seconds per training step, measured per phase with compilation excluded: the first
    step a process trains in each phase (which compiles) only starts that phase's clock. The
    median of the recent intervals ignores the occasional evaluation or checkpoint pause."""

    def __init__(self, window: int = 200):
        self.window = window
        self.intervals: dict[str, collections.deque] = {}
        self.last: tuple[str, int, float] | None = None

    def tick(self, phase: str, step: int, now: float | None = None) -> None:
        """Step `step` of `phase` has finished (its results are on the host) at `now`
        (default: the current time, in seconds)."""
        now = time.perf_counter() if now is None else now
        if self.last and self.last[0] == phase and step > self.last[1]:
            self.intervals.setdefault(phase, collections.deque(maxlen=self.window)).append(
                (now - self.last[2]) / (step - self.last[1]))
        self.last = (phase, step, now)

    def restart(self) -> None:
        """The time since the last tick was not training (e.g. an evaluation)."""
        self.last = None

    def seconds_per_step(self, phase: str) -> float | None:
        measured = self.intervals.get(phase)
        return float(sorted(measured)[len(measured) // 2]) if measured else None


def eta_seconds(clock: StepClock, phases: Sequence[Phase], step: int,
                relative_cost: dict[str, float]) -> float | None:
    """Seconds to the end of the last phase from `step`: each phase's remaining steps at its
    measured time per step; a phase not yet measured at the latest measured one's, scaled by
    `relative_cost` (e.g. model FLOPs per step). None before any measurement."""
    measured = [(p.name, clock.seconds_per_step(p.name)) for p in phases]
    known = [(name, seconds) for name, seconds in measured if seconds is not None]
    if not known:
        return None
    reference, reference_seconds = known[-1]
    total = 0.0
    for phase, (name, seconds) in zip(phases, measured):
        if seconds is None:
            seconds = reference_seconds * relative_cost[name] / relative_cost[reference]
        total += max(0, phase.end_step - max(step, phase.start_step)) * seconds
    return total


def write_jsonl(path: str | None, row: dict[str, Any]) -> None:
    """Appends one JSON row to `path` (no-op without a path, e.g. on other processes)."""
    if path:
        write_text(path, json.dumps(row) + "\n", append=True)


class Progress:
    """Accumulates pretraining metric sums on the host and prints/writes them every report;
    times the steps of each phase for the ETA and the terminal's status line."""

    def __init__(self, phases: Sequence[Phase], max_nonfinite_steps: int,
                 optimizer: optim.OptimizerConfig, model_config: BertConfig,
                 writer: SummaryWriter | None, start_step: int, jsonl_path: str | None,
                 resumed_from: str | None = None):
        """`resumed_from`: the checkpoint the run resumed from at `start_step`, if any."""
        self.phases, self.total_steps = list(phases), phases[-1].end_step
        self.start_step, self.resumed_from = start_step, resumed_from
        self.max_nonfinite_steps = max_nonfinite_steps
        self.optimizer, self.model_config = optimizer, model_config
        self.writer, self.jsonl_path = writer, jsonl_path
        self.sums: dict[str, float] = {}
        self.tokens = 0
        self.window_start, self.window_start_step = time.time(), start_step
        self.nonfinite_in_a_row = self.nonfinite_total = self.finite_steps = 0
        self.peak_tflops = flops.peak_tflops(jax.devices()[0].device_kind)
        self.clock = StepClock()
        self.flops_per_step = {p.name: float(p.global_batch_size * flops.train_flops_per_sequence(
            model_config, p.max_seq_length, p.max_predictions_per_seq)) for p in self.phases}

    def eta(self, step: int) -> float | None:
        return eta_seconds(self.clock, self.phases, step, self.flops_per_step)

    def add(self, step: int, metrics: dict[str, Any], tokens: int, batch: str = "") -> None:
        """Adds one step's metrics (already on the host); stops on repeated non-finite steps.
        `batch` names the step's batch in messages."""
        self.clock.tick(schedule.phase_at(self.phases, step - 1).name, step)
        console.TERMINAL.show(status_bar(step, self.total_steps, self.eta(step)))
        if metrics["nonfinite"] > 0:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            cause = steps.NonFinite(int(metrics["nonfinite"]))
            if cause == steps.NonFinite.STATE and self.finite_steps:  # (restored states are
                cause = steps.NonFinite.UPDATE  # checked: an update of this run made it so)
            what, advice = cause.what, cause.advice
            logging.warning("step %d (%s): non-finite %s; update skipped (%d in a row, %d in "
                            "this run)", step, batch, what, self.nonfinite_in_a_row,
                            self.nonfinite_total)
            suspect = self.suspect_resume(step) and what != "inputs"
            if suspect:
                advice = (f"every step since resuming from checkpoint {self.resumed_from} was "
                          "non-finite, which points at that checkpoint rather than the learning "
                          "rate: move it out of WORKDIR/checkpoints (e.g. to "
                          "WORKDIR/checkpoints_quarantine) to resume from the one before")
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps or cause in (
                    steps.NonFinite.STATE, steps.NonFinite.UPDATE):
                raise (NonFiniteAfterResume if suspect else TrainingError)(
                    f"{self.nonfinite_in_a_row} consecutive non-finite steps ending at step {step} "
                    f"({batch}), the last with non-finite {what}; the last checkpoint is intact. "
                    f"{advice[0].upper()}{advice[1:]}, then rerun to resume.")
            return
        self.nonfinite_in_a_row = 0
        self.finite_steps += 1
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.sums["steps"] = self.sums.get("steps", 0.0) + 1
        self.tokens += tokens

    def suspect_resume(self, step: int) -> bool:
        """Whether every step of this run up to `step` (added) was non-finite after a resume:
        nothing finite has come from the checkpoint yet, so none is saved from it."""
        return bool(self.resumed_from) and step > self.start_step \
            and self.nonfinite_in_a_row == step - self.start_step

    def report(self, step: int, phase: Phase) -> dict[str, float]:
        """Prints a progress line for the steps since the last report and resets the window."""
        if not self.sums:
            return {}
        now = time.time()
        means = objectives.summarize(self.sums)
        means["grad_norm"] = self.sums["grad_norm"] / self.sums["steps"]
        means["learning_rate"] = optim.learning_rate_at(self.optimizer, step - 1)
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
        eta = self.eta(step)
        chief_print((f"step {step}/{self.total_steps} "
                    f"[{phase.name} L={phase.max_seq_length}] "
                    f"loss {means['loss']:.4f} mlm_acc {means['mlm_accuracy']:.4f} "
                    + (f"nsp_acc {means['nsp_accuracy']:.4f} " if "nsp_accuracy" in means else "")
                    + f"lr {means['learning_rate']:.3e} "
                    f"tok/s {means['tokens_per_second']:,.0f} "
                    f"TFLOP/s {means['model_tflops_per_second']:.3g} "
                    + (f"MFU {mfu:.1%} " if mfu is not None else "")
                    + (f"eta {duration(eta)}" if eta is not None else "")).rstrip())
        log_scalars(self.writer, "train", means, step)
        write_jsonl(self.jsonl_path, {"step": step, "phase": phase.name, "split": "train",
                                      **means})
        self.sums, self.tokens = {}, 0
        self.window_start, self.window_start_step = now, step
        return means

    def log_eval(self, step: int, phase: Phase, means: dict[str, float]) -> None:
        """Prints, and writes to TensorBoard and metrics.jsonl, a held-out evaluation (a
        rerun of a finished run, which trains no step, prints it only: its row is there)."""
        chief_print(f"eval step {step} [{phase.name}]: " + " ".join(
            f"{k} {v:.4f}" for k, v in sorted(means.items())))
        if self.start_step < self.total_steps:
            log_scalars(self.writer, "eval", means, step, flush=False)
            write_jsonl(self.jsonl_path, {"step": step, "phase": phase.name, "split": "eval",
                                          **means})
        self.clock.restart()
