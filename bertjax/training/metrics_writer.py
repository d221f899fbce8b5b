"""Where a run's metrics are written: TensorBoard's event files (also on an object store)
and the rows of metrics.jsonl (each an append that a kill -9 cannot leave half-written)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import jax

from bertjax.runtime import files

if TYPE_CHECKING:  # importing tensorboardX imports torch when it is installed: seconds
    from tensorboardX import SummaryWriter


class _ObjectEventFile:
    """TensorBoard's event file on an object store, written through bertjax.runtime.files: objects
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
        record_writer.register_writer_factory(
            workdir.split(":", maxsplit=1)[0], _ObjectEventFiles()
        )
    return SummaryWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 else None


def log_scalars(
    writer: SummaryWriter | None,
    prefix: str,
    values: dict[str, float],
    step: int,
    flush: bool = True,
) -> None:
    """`prefix/key` scalars at `step` (no-op without a writer)."""
    if writer:
        for key, value in values.items():
            writer.add_scalar(f"{prefix}/{key}", value, step)
        if flush:
            with files.naming(writer.logdir):
                writer.flush()


def write(
    writer: SummaryWriter | None,
    path: str | None,
    tag: str,
    step: int,
    values: dict[str, float],
    flush: bool = True,
    **fields: str | int,
) -> None:
    """One set of metrics, where both loops write it: TensorBoard's `tag/key` scalars at
    `step` (`log_scalars`), and the metrics.jsonl row `{"step": step, **fields, **values}`
    (`fields`: the phase, the epoch, the split) in `path` (`write_jsonl`)."""
    log_scalars(writer, tag, values, step, flush)
    write_jsonl(path, {"step": step, **fields, **values})


def write_jsonl(path: str | None, row: dict[str, Any]) -> None:
    """Appends one JSON row to `path` (no-op without a path, e.g. on other processes)."""
    if path:
        files.write_text(path, json.dumps(row) + "\n", append=True)
