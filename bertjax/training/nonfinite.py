"""Why a run stops on NaN or Inf, in one place: the causes a skipped step reports
(`NonFinite`, computed inside the jitted step), the one policy of both loops
(`NonFiniteSteps`; its setting `max_in_a_row`: pretraining stops after K skipped steps in a
row, or at once for a non-finite state, and a resume whose every step was non-finite blames
its checkpoint; fine-tuning, 0, counts and names them) and the check that no checkpoint is
written from, or restored into, a state holding NaN or Inf (`check_finite`)."""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import optax
from absl import logging

from bertjax.errors import UserError
from bertjax.training.state import TrainState


class TrainingError(UserError, RuntimeError):
    """The run cannot continue (e.g. too many non-finite steps); the message says why."""


class NonFiniteAfterResume(TrainingError):
    """Every step since the run resumed was non-finite (not for its inputs): the checkpoint
    it resumed from is suspect."""


class NonFiniteState(UserError, RuntimeError):
    """The train state holds NaN or Inf; it must not be checkpointed."""


class NonFinite(enum.IntEnum):
    """What `metrics["nonfinite"]` says went non-finite in a skipped step (0: nothing, the step
    was applied): `what` names it, `advice` says what to do about it."""

    INPUTS = 1
    LOSS_OR_GRADIENTS = 2
    STATE = 3  # (before the step: a restored state; `NonFiniteSteps` names it UPDATE once this
    UPDATE = 4  # run has made finite steps, since then only an update of this run can have)

    @property
    def what(self) -> str:
        return self.name.lower().replace("_", " ")

    @property
    def advice(self) -> str:
        return _ADVICE[self]


_ADVICE = {
    NonFinite.INPUTS: "the batch holds NaN or Inf: check the data",
    NonFinite.LOSS_OR_GRADIENTS: "lower optimizer.peak_learning_rate or check the data",
    NonFinite.STATE: "the parameters or optimizer state held NaN or Inf before the step, which "
    "is not a learning-rate problem: the checkpoint the run resumed from may be "
    "damaged; move it out of WORKDIR/checkpoints to resume from the one before",
    NonFinite.UPDATE: "an update of this run made the state non-finite from finite gradients: "
    "lower optimizer.peak_learning_rate or set optimizer.clip_global_norm",
}


class NonFiniteSteps:
    """The policy of both loops for skipped (non-finite) steps, with one setting,
    `max_in_a_row`. Pretraining's (train.max_nonfinite_steps) checks each step on the host
    (`add`): each skipped one is logged; the run stops (TrainingError) after `max_in_a_row`
    in a row, or at once for a non-finite state; NonFiniteAfterResume when every step since
    resuming from `resumed_from` (at `start_step`) was non-finite, for other than its inputs.
    Fine-tuning's, 0, never stops: its steps are counted on the device and each progress
    window's skipped ones named (`add_counted`). `state_advice` ends the refusal to save a
    non-finite state (loop.save)."""

    def __init__(
        self,
        max_in_a_row: int,
        start_step: int = 0,
        resumed_from: str | None = None,
        state_advice: str = NonFinite.UPDATE.advice,
    ) -> None:
        self.max_in_a_row, self.start_step, self.resumed_from = (
            max_in_a_row,
            start_step,
            resumed_from,
        )
        self.state_advice = state_advice
        self.in_a_row = self.total = self.finite_steps = 0

    def add(self, step: int, cause: int, batch: str = "") -> bool:
        """Counts step `step` (`cause`: its `metrics["nonfinite"]`; `batch` names its batch in
        messages); whether it was skipped. Raises when the run must stop."""
        if not cause:
            self.in_a_row = 0
            self.finite_steps += 1
            return False
        self.in_a_row += 1
        self.total += 1
        found = NonFinite(int(cause))
        if found == NonFinite.STATE and self.finite_steps:  # (restored states are checked:
            found = NonFinite.UPDATE  # an update of this run made it so)
        what, advice = found.what, found.advice
        logging.warning(
            "step %d (%s): non-finite %s; update skipped (%d in a row, %d in this run)",
            step,
            batch,
            what,
            self.in_a_row,
            self.total,
        )
        suspect = self.suspect_resume(step) and what != "inputs"
        if suspect:
            advice = (
                f"every step since resuming from checkpoint {self.resumed_from} was "
                "non-finite, which points at that checkpoint rather than the learning "
                "rate: move it out of WORKDIR/checkpoints (e.g. to "
                "WORKDIR/checkpoints_quarantine) to resume from the one before"
            )
        if not self.max_in_a_row:
            return True
        if self.in_a_row >= self.max_in_a_row or found in (NonFinite.STATE, NonFinite.UPDATE):
            raise (NonFiniteAfterResume if suspect else TrainingError)(
                f"{self.in_a_row} consecutive non-finite steps ending at step {step} "
                f"({batch}), the last with non-finite {what}; the last checkpoint is intact. "
                f"{advice[0].upper()}{advice[1:]}, then rerun to resume."
            )
        return True

    def add_counted(self, step: int, skipped: int, steps: int, label: str = "") -> None:
        """Counts the `steps` steps up to `step`, `skipped` of them skipped (summed on the
        device: no wait for the host per step, so no count in a row); names the skipped ones
        in a warning (`label` starts it)."""
        self.total += skipped
        self.finite_steps += steps - skipped
        if skipped:
            logging.warning(
                "%s%d of the %d steps up to step %d skipped: their loss or gradients "
                "held NaN or Inf",
                label,
                skipped,
                steps,
                step,
            )

    def suspect_resume(self, step: int) -> bool:
        """Whether every step of this run up to `step` (added) was non-finite after a resume:
        nothing finite has come from the checkpoint yet, so none is saved from it."""
        return (
            bool(self.resumed_from)
            and step > self.start_step
            and self.in_a_row == step - self.start_step
        )


def all_finite(tree: optax.Params) -> jax.Array:
    """Whether every float in `tree` is finite (a scalar bool array), one reduction per leaf:
    the host's check of a restored state and of a state about to be saved (`check_finite`)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


_all_finite = jax.jit(all_finite)


def check_finite(state: TrainState, step: int, advice: str = "") -> None:
    """Raises NonFiniteState unless every float in params and optimizer state is finite;
    `advice` ends its message."""
    for name in ("params", "opt_state"):
        if not bool(jax.device_get(_all_finite(getattr(state, name)))):
            raise NonFiniteState(
                f"step {step}: the {name} hold NaN or Inf; refusing to write a "
                "checkpoint (the last finished checkpoint is intact)" + advice
            )
