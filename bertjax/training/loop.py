"""The one loop skeleton of pretraining (pretrain_loop) and fine-tuning (finetune_loop), in
the style of CLU's periodic actions: `run` trains one step after another and after each runs
the actions that are due, in order; an action that returns a signal (a stop request) ends
it. The pieces both loops use: the running context (`running`: the mesh and Ctrl-C), the
stop request (`stop_request`: Ctrl-C, a preemption notice), the save that refuses a
non-finite state (`save`) and the NaN policy (`nonfinite.NonFiniteSteps`, whose one setting
says whether skipped steps stop the run or are only counted and named)."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
from absl import logging

from bertjax.checkpoints import checkpoint
from bertjax.runtime import failures, stopping
from bertjax.training import nonfinite, sharding
from bertjax.training.state import TrainState


@dataclasses.dataclass(frozen=True)
class Periodic:
    """`action(step)` after every `every`th step (0: none) and after each step in `at`; what
    it returns, a signal (SIGINT, SIGTERM), stops the loop after that step (None, 0: go on)."""

    action: Callable[[int], int | None]
    every: int = 1
    at: Collection[int] = ()

    def __call__(self, step: int) -> int | None:
        if (self.every and step % self.every == 0) or step in self.at:
            return self.action(step)
        return None


def run(
    start: int, stop: int, step: Callable[[int], None], actions: Sequence[Periodic]
) -> tuple[int, int]:
    """Trains steps `start` to `stop - 1` (`step(index)`: the step that makes `index + 1`
    steps done), after each the actions due, in order, until one returns a signal. Returns
    the steps done and that signal (0: none, the loop reached `stop`)."""
    done = start
    for index in range(start, stop):
        stopping.now_doing(f"training step {index + 1}")
        step(index)
        done = index + 1
        for action in actions:
            stopped = action(done)
            if stopped:
                return done, stopped
    return done, 0


@contextlib.contextmanager
def running(mesh: jax.sharding.Mesh, forward_as_sigterm: bool = False) -> Iterator[failures.CtrlC]:
    """The mesh active and Ctrl-C asking for a save and a stop (`failures.CtrlC`; in a
    multi-process job, `forward_as_sigterm`) while a loop runs."""
    with sharding.activate(mesh), failures.CtrlC(forward_as_sigterm) as ctrl_c:
        yield ctrl_c


def stop_request(
    ctrl_c: failures.CtrlC, step: int, checkpointer: checkpoint.Checkpointer | None = None
) -> int:
    """The signal that asks a loop to save and stop after `step` (0: none): a preemption
    notice every process has reached (with a `checkpointer`; a Ctrl-C forwarded to every
    process as one too), SIGTERM, or SIGINT for a Ctrl-C; a Ctrl-C of this process alone
    (not forwarded) at once."""
    preempted = checkpointer is not None and checkpointer.reached_preemption(step)
    if preempted or (ctrl_c.requested and not ctrl_c.forward_as_sigterm):
        return signal.SIGINT if ctrl_c.requested else signal.SIGTERM
    return 0


def save(
    checkpointer: checkpoint.Checkpointer,
    policy: nonfinite.NonFiniteSteps,
    step: int,
    state: TrainState,
    position: Mapping[str, Any],
    record: Mapping[str, Any],
    force: bool = False,
) -> None:
    """Saves `state` at `step` with its data `position` and the run's `record`, unless every
    step since resuming was non-finite (`policy`: nothing finite has come from the checkpoint
    yet); a state holding NaN or Inf is refused (NonFiniteState, with the policy's advice)."""
    if policy.suspect_resume(step):
        logging.warning(
            "step %d: no checkpoint saved, since every step since resuming from %s was non-finite",
            step,
            policy.resumed_from,
        )
        return
    nonfinite.check_finite(state, step, "; " + policy.state_advice)
    checkpointer.save(step, state, dict(position), dict(record), force=force)
