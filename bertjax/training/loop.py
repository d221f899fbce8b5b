"""The one loop skeleton of pretraining (pretrain_loop) and fine-tuning (finetune_loop), in
the style of CLU's periodic actions: `run` trains one step after another and after each runs
the actions that are due, in order; an action that returns a signal (a stop request) ends
it. Both loops are a `Loop`: a step and its actions, trained by `Loop.train_steps`. The
pieces both use: the running context (`running`: the mesh and Ctrl-C), the stop request
(`stop_request`: Ctrl-C, a preemption notice) and its line (`announce_stop`), the save that
refuses a non-finite state (`save`), the profiler (`Profile`: a trace of a few steps) and the
NaN policy (`nonfinite.NonFiniteSteps`, whose one setting says whether skipped steps stop the
run or are only counted and named)."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import signal
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import jax
from absl import logging

from bertjax.checkpoints import checkpoint
from bertjax.runtime import console, failures, stopping
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


class Profile:
    """The profiler's action: a `jax.profiler` trace of `steps` steps (0: none) into
    `directory` (as TensorBoard's profile plugin reads it: `plugins/profile/SESSION/HOST.xplane.pb`,
    and HOST.trace.json.gz for Perfetto), from process 0 only: every process runs the same
    program, and the profiler names its files by host, so that processes sharing a host would
    overwrite each other's. The traced steps follow the first this loop trains (which
    compiles): steps `start + 2` to `start + steps + 1`, fewer if the loop stops sooner;
    `wait` (for the steps dispatched so far) bounds them. Used as a context, it ends a trace
    that a stop or an error interrupts."""

    def __init__(
        self, directory: str, steps: int, start: int, stop: int, wait: Callable[[], object]
    ) -> None:
        self.directory, self.wait, self.tracing = directory, wait, False
        self.first = start + 1  # (done, and compiled, when the trace starts)
        self.last = min(start + 1 + steps, stop)
        self.done = start
        self.enabled = steps > 0 and self.first < self.last and jax.process_index() == 0

    def actions(self) -> list[Periodic]:
        """This action (after every step), if it traces at all."""
        return [Periodic(self)] if self.enabled else []

    def __call__(self, step: int) -> None:
        self.done = step
        if step == self.first:
            self.wait()
            jax.profiler.start_trace(self.directory)
            self.tracing = True
        elif step == self.last and self.tracing:
            self.finish()

    def finish(self, wait: bool = True) -> None:
        """Ends the trace (after the steps dispatched, with `wait`) and says where it is."""
        if wait:
            self.wait()
        jax.profiler.stop_trace()
        self.tracing = False
        console.chief_print(
            f"Profile of steps {self.first + 1}-{self.done}: {self.directory} (view it with "
            f"tensorboard --logdir {self.directory} and tensorboard-plugin-profile installed, "
            "or open its .trace.json.gz in https://ui.perfetto.dev)"
        )

    def __enter__(self) -> Profile:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *_: object) -> None:
        if self.tracing:
            self.finish(wait=error_type is None)


class Loop(abc.ABC):
    """What pretraining's and fine-tuning's loops are: the state their steps make, one step
    (`train_step`) and the actions due after each step (`actions`), trained on the skeleton
    by `train_steps` (with the profiler's action first)."""

    state: Any  # the train state the steps make (the profiler waits for it)

    @abc.abstractmethod
    def train_step(self, index: int) -> None:
        """Trains the step that makes `index + 1` steps done."""

    @abc.abstractmethod
    def actions(self, ctrl_c: failures.CtrlC) -> list[Periodic]:
        """The actions after each step, in order (`ctrl_c`: the stop request's)."""

    def train_steps(
        self,
        start: int,
        stop: int,
        ctrl_c: failures.CtrlC,
        profile_steps: int = 0,
        profile_dir: str = "",
    ) -> tuple[int, int]:
        """`run` from `start` to `stop` on this loop's step and actions, with a profile of
        `profile_steps` steps into `profile_dir` (`Profile`); returns `run`'s."""
        with Profile(
            profile_dir, profile_steps, start, stop, lambda: jax.block_until_ready(self.state)
        ) as profile:
            return run(start, stop, self.train_step, [*profile.actions(), *self.actions(ctrl_c)])


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


def announce_stop(ctrl_c: failures.CtrlC, step: int) -> None:
    """The line of a stop request (`stop_request`) that saves at `step` and exits."""
    console.chief_print(
        f"{'Ctrl-C' if ctrl_c.requested else 'Preemption notice'}: saving a checkpoint at "
        f"step {step} and exiting"
    )


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
