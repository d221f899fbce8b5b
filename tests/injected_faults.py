"""Faults that tests inject into bertjax from the outside, at its public seams (bertjax has
no test switch of its own):

* pauses, so that a fault test lands its signal exactly where it must instead of polling and
  retrying: a test starts `python -m bertjax.*` with `pausing(where)` in its environment, which
  puts tests/startup first on the child's PYTHONPATH; Python then runs
  tests/startup/sitecustomize.py at start-up, which calls `install(where)` before bertjax runs;
* NaN batches, for a run trained in the test's own process (`poison_batches`).

`where` is one of:

* `step:N`: the pretraining or fine-tuning loop pauses once step N is done (its checkpoint
  saves written; pretraining's preemption sync point for step N passed), as the loop moves
  on from its activity `training step N` (bertjax.runtime.stopping.now_doing);
* `start`: pretraining pauses as it enters its loop (`PretrainingLoop.loop`: data prepared,
  state built), where a signal is outside the training steps;
* `save`: every asynchronous checkpoint write pauses with its files written but its
  temporary directory not yet renamed into place (an unfinished checkpoint; Orbax's
  post-finalization callback);
* `upload`: a preparation into object storage pauses with a phase claimed and its shards
  uploaded, before its meta.json (at `prepared_files.upload`'s second claim check).

A paused process prints `BERTJAX_TEST_PAUSE: paused at <where>` and goes on when a line (or
end of file) arrives on its stdin.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from collections.abc import Callable, Collection
from typing import Any

import numpy as np

VARIABLE = "BERTJAX_TEST_PAUSE"
TESTS = os.path.dirname(os.path.abspath(__file__))
STARTUP = os.path.join(TESTS, "startup")  # holds the sitecustomize.py that calls `install`


def pausing(where: str | None, pythonpath: str = os.path.dirname(TESTS)) -> dict[str, str]:
    """The environment of a child process that pauses at `where` (None: none), whose
    PYTHONPATH is otherwise `pythonpath` (default: the repository's root)."""
    if not where:
        return {"PYTHONPATH": pythonpath}
    return {VARIABLE: where, "PYTHONPATH": os.pathsep.join([STARTUP, pythonpath])}


def _pause(where: str) -> None:
    sys.stdout.write(f"{VARIABLE}: paused at {where}\n")  # one write: not split by other threads
    sys.stdout.flush()
    if sys.stdin is None:
        return
    # The line is read by a thread while this one polls: a signal the kernel hands to another
    # of the process's threads does not interrupt a blocking read here, so Python would run
    # its handler (Ctrl-C's notice) only after the line came, and the tests wait for the notice.
    arrived = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), arrived.set()), daemon=True).start()
    while not arrived.wait(0.05):
        pass


def install(where: str) -> None:
    """Installs the pause `where` (see the module's docstring) into this process."""
    kind, _, step = where.partition(":")
    installers: dict[str, Callable[[], None]] = {
        "step": lambda: _pause_after_step(int(step)),
        "start": _pause_at_start,
        "save": _pause_in_checkpoint_writes,
        "upload": _pause_before_meta_upload,
    }
    if kind not in installers:
        raise ValueError(f"{VARIABLE}={where!r}: expected step:N, start, save or upload")
    installers[kind]()


def _pause_after_step(step: int) -> None:
    from bertjax.checkpoints import checkpoint
    from bertjax.runtime import stopping

    created: list[checkpoint.Checkpointer] = []
    init, now_doing = checkpoint.Checkpointer.__init__, stopping.now_doing
    label, doing = f"training step {step}", [""]

    @functools.wraps(init)
    def registered(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        created.append(self)

    @functools.wraps(now_doing)
    def moving_on(what: str) -> None:
        if doing[0] == label and what != label:  # step `step` is done
            created[-1].wait()  # (its saves written)
            _pause(f"step {step}")
        doing[0] = what
        now_doing(what)

    checkpoint.Checkpointer.__init__ = registered
    stopping.now_doing = moving_on


def _pause_at_start() -> None:
    from bertjax.training.pretrain_loop import PretrainingLoop

    loop, paused = PretrainingLoop.loop, []

    @functools.wraps(loop)
    def entered(self, *args, **kwargs):
        if not paused:  # (not again when the run falls back to an earlier checkpoint)
            paused.append(True)
            _pause("the start of training")
        return loop(self, *args, **kwargs)

    PretrainingLoop.loop = entered


def _pause_in_checkpoint_writes() -> None:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions

    @functools.wraps(options)
    def pausing_options(*args, **kwargs):
        if kwargs.get("enable_async_checkpointing"):
            kwargs["async_options"] = ocp.AsyncOptions(
                post_finalization_callback=lambda: _pause("a checkpoint write")
            )
        return options(*args, **kwargs)

    ocp.CheckpointManagerOptions = pausing_options


def _pause_before_meta_upload() -> None:
    from bertjax.data import prepared_files

    upload = prepared_files.upload

    @functools.wraps(upload)
    def paused_upload(local: str, remote: str, still_claimed: Callable[[str], None]) -> None:
        checks = []

        def check(when: str) -> None:
            checks.append(when)
            if len(checks) == 2:  # (the check before meta.json: the shards are uploaded)
                _pause("an upload's meta.json")
            still_claimed(when)

        upload(local, remote, check)

    prepared_files.upload = paused_upload


def poison(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of `batch` whose masked-LM weights are NaN, so loss and gradients are NaN."""
    return {**batch, "masked_lm_weights": np.full_like(batch["masked_lm_weights"], np.nan)}


class _PoisonedLoader:
    """A training loader whose batches `indices` are poisoned; the rest is `loader`'s."""

    def __init__(self, loader: Any, indices: Collection[int]):
        self.loader, self.indices = loader, set(indices)

    def batch(self, index: int) -> dict[str, np.ndarray]:
        batch = self.loader.batch(index)
        return poison(batch) if index in self.indices else batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def poison_batches(monkeypatch: Any, phase: str, indices: Collection[int]) -> None:
    """Makes the training batches `indices` (0-based) of phase `phase` NaN in the runs that
    this test (`monkeypatch`: pytest's fixture) trains in its own process, at the seam where
    the run gets its data (bertjax.data.loaders.prepare_data)."""
    from bertjax.data import loaders

    prepare_data = loaders.prepare_data

    @functools.wraps(prepare_data)
    def poisoned(*args, **kwargs) -> list[loaders.PhaseData]:
        return [
            dataclasses.replace(pd, train=_PoisonedLoader(pd.train, indices))
            if pd.phase.name == phase
            else pd
            for pd in prepare_data(*args, **kwargs)
        ]

    monkeypatch.setattr(loaders, "prepare_data", poisoned)
