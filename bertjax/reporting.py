"""What a run tells its operator: progress lines with throughput, MFU and ETA, TensorBoard
scalars, metrics.jsonl, chief-only printing, library log filters, and the small-file writer
that a kill -9 cannot leave half-written."""
from __future__ import annotations

import json
import logging as std_logging
import os
import time
from typing import Any

import jax
from absl import logging
from etils import epath
from tensorboardX import SummaryWriter

from bertjax import flops, objectives, optim, steps
from bertjax.model import BertConfig
from bertjax.schedule import Phase


class TrainingError(RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps); the message says why."""


def chief_print(line: str) -> None:
    """Progress lines come from process 0 only (every process computes the same values)."""
    if jax.process_index() == 0:
        print(line, flush=True)


def write_text(path: str, text: str, append: bool = False) -> None:
    """Writes a small text file so that a kill -9 never loses what it held. Locally, an append
    is one O_APPEND write (earlier lines are never rewritten) and a rewrite goes through a
    renamed temporary file. Object stores (gs://) cannot append; there an append rewrites
    the object, which each upload replaces whole."""
    if "://" not in path:
        if append:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, text.encode("utf-8"))
            except OSError as e:  # name the file (a failed write does not)
                raise OSError(e.errno, e.strerror, path) from e
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


def duration(seconds: float) -> str:
    """`1h05m` or `4m07s`."""
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def open_writer(workdir: str) -> SummaryWriter | None:
    """TensorBoard event writer in `workdir/tensorboard`, on process 0 only."""
    return SummaryWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 \
        else None


def log_scalars(writer: SummaryWriter | None, prefix: str, values: dict[str, float], step: int,
                flush: bool = True) -> None:
    """`prefix/key` scalars at `step` (no-op without a writer)."""
    if writer:
        for key, value in values.items():
            writer.add_scalar(f"{prefix}/{key}", value, step)
        if flush:
            try:
                writer.flush()
            except OSError as e:  # name the directory (a failed write does not)
                raise OSError(e.errno, e.strerror, writer.logdir) from e


class QuietLibraryInfo(std_logging.Filter):
    """Drops INFO chatter from Orbax (tens of lines per save); warnings still show."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or "/orbax/" not in record.pathname


def quiet_library_info() -> None:
    """Installs QuietLibraryInfo on absl's log handler."""
    logging.get_absl_handler().addFilter(QuietLibraryInfo())


class Progress:
    """Accumulates pretraining metric sums on the host and prints/writes them every report."""

    def __init__(self, total_steps: int, max_nonfinite_steps: int,
                 optimizer: optim.OptimizerConfig, model_config: BertConfig,
                 writer: SummaryWriter | None, start_step: int, jsonl_path: str | None):
        self.total_steps, self.max_nonfinite_steps = total_steps, max_nonfinite_steps
        self.optimizer, self.model_config = optimizer, model_config
        self.writer, self.jsonl_path = writer, jsonl_path
        self.sums: dict[str, float] = {}
        self.tokens = 0
        self.window_start, self.window_start_step = time.time(), start_step
        self.nonfinite_in_a_row = self.nonfinite_total = 0
        self.peak_tflops = flops.peak_tflops(jax.devices()[0].device_kind)

    def add(self, step: int, metrics: dict[str, Any], tokens: int, batch: str = "") -> None:
        """Adds one step's metrics (already on the host); stops on repeated non-finite steps.
        `batch` names the step's batch in messages."""
        if metrics["nonfinite"] > 0:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            what, advice = steps.NONFINITE_CAUSES.get(int(metrics["nonfinite"]),
                                                      steps.NONFINITE_CAUSES[2])
            logging.warning("step %d (%s): non-finite %s; update skipped (%d in a row, %d in "
                            "this run)", step, batch, what, self.nonfinite_in_a_row,
                            self.nonfinite_total)
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps or what == "state":
                raise TrainingError(
                    f"{self.nonfinite_in_a_row} consecutive non-finite steps ending at step {step} "
                    f"({batch}), the last with non-finite {what}; the last checkpoint is intact. "
                    f"{advice[0].upper()}{advice[1:]}, then rerun to resume.")
            return
        self.nonfinite_in_a_row = 0
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.sums["steps"] = self.sums.get("steps", 0.0) + 1
        self.tokens += tokens

    def report(self, step: int, phase: Phase) -> dict[str, float]:
        """Prints a progress line for the steps since the last report and resets the window."""
        if not self.sums:
            return {}
        now = time.time()
        seconds_per_step = (now - self.window_start) / max(step - self.window_start_step, 1)
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
        eta = seconds_per_step * (self.total_steps - step)
        chief_print(f"step {step}/{self.total_steps} "
                    f"[{phase.name} L={phase.max_seq_length}] "
                    f"loss {means['loss']:.4f} mlm_acc {means['mlm_accuracy']:.4f} "
                    f"nsp_acc {means['nsp_accuracy']:.4f} lr {means['learning_rate']:.3e} "
                    f"tok/s {means['tokens_per_second']:,.0f} "
                    f"TFLOP/s {means['model_tflops_per_second']:.3g} "
                    + (f"MFU {mfu:.1%} " if mfu is not None else "") + f"eta {duration(eta)}")
        log_scalars(self.writer, "train", means, step)
        if self.jsonl_path:
            write_text(self.jsonl_path, json.dumps({"step": step, "phase": phase.name, **means})
                       + "\n", append=True)
        self.sums, self.tokens = {}, 0
        self.window_start, self.window_start_step = now, step
        return means
