"""Test-only pauses, so that a fault test lands its signal exactly where it must instead of
polling and retrying. Inert unless the environment variable BERTJAX_TEST_PAUSE is set:

* `BERTJAX_TEST_PAUSE=step:N`: the pretraining or fine-tuning loop pauses once step N is
  done (its checkpoint saves written, JAX's preemption sync point for step N passed);
* `BERTJAX_TEST_PAUSE=start`: pretraining pauses before its first step (data prepared,
  state built), where a signal is outside the training steps;
* `BERTJAX_TEST_PAUSE=save`: every checkpoint write pauses with its files written but its
  temporary directory not yet renamed into place (an unfinished checkpoint);
* `BERTJAX_TEST_PAUSE=upload`: a preparation into object storage pauses with a phase claimed
  and its shards uploaded, before its meta.json.

A paused process prints `BERTJAX_TEST_PAUSE: paused at <where>` and goes on when a line (or
end of file) arrives on its stdin.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

VARIABLE = "BERTJAX_TEST_PAUSE"


def _pause(where: str) -> None:
    sys.stdout.write(f"{VARIABLE}: paused at {where}\n")  # one write: not split by other threads
    sys.stdout.flush()
    if sys.stdin is not None:
        sys.stdin.readline()


def after_step(step: int, write_checkpoints: Callable[[], None]) -> None:
    """Pauses after step `step` if asked to (`write_checkpoints` first finishes its saves)."""
    if os.environ.get(VARIABLE) == f"step:{step}":
        write_checkpoints()
        _pause(f"step {step}")


def before_training() -> None:
    """Pauses before the pretraining loop if asked to."""
    if os.environ.get(VARIABLE) == "start":
        _pause("the start of training")


def in_checkpoint_write() -> Callable[[], None] | None:
    """Orbax's post-finalization callback that pauses each write if asked to, else None."""
    if os.environ.get(VARIABLE) != "save":
        return None
    return lambda: _pause("a checkpoint write")


def before_meta_upload() -> None:
    """Pauses a preparation into object storage before a phase's meta.json if asked to."""
    if os.environ.get(VARIABLE) == "upload":
        _pause("an upload's meta.json")
