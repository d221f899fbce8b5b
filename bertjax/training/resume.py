"""Which checkpoint a run continues from, whether it may, and when it falls back to an
earlier one.

The newest checkpoint whose files match their recorded checksums wins. A damaged one (a
checksum mismatch, a missing or unreadable item; for a checkpoint saved without checksums,
also a failed restore or NaN/Inf in the restored state; for any, values that differ from the
digest recorded at the save) is reported by name and moved to
`WORKDIR/checkpoints_quarantine`, never deleted, and the next older one is tried; the run
says how many steps that costs. A read that the storage failed (after its retries,
`bertjax.runtime.storage`) proves nothing: the run stops with one line and moves nothing. Its
settings are checked (`check`) before any data is prepared. If every step since resuming
was non-finite (bertjax.training.nonfinite), the run falls back once to the checkpoint before
(`Resume.fall_back`: what to train from instead).

Fine-tuning keeps only its latest and its best checkpoint, so there is nothing to fall back
to: `restore_exactly` restores the one asked for or fails naming it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
from absl import logging

from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.checkpoints.run_record import GLOBAL, RunRecord
from bertjax.data.settings import DataSettings
from bertjax.runtime import console, failures, storage
from bertjax.runtime.failures import first_line
from bertjax.training import guards, nonfinite, phase_schedule
from bertjax.training.state import TrainState

QUARANTINE = "checkpoints_quarantine"
T = TypeVar("T")


class UnusableCheckpoint(checkpoint_checks.CheckpointMismatch):
    """No checkpoint in the workdir can be resumed from; the message names the choices."""


class OtherProcessCount(checkpoint_checks.CheckpointMismatch):
    """The checkpoint was trained by several processes of an older version, each on its own
    share of the documents: its batches cannot be reproduced."""


class CheckpointUnreadable(UnusableCheckpoint):
    """A checkpoint could not be read because the storage failed (not because it is
    damaged); it is left where it is."""


@dataclasses.dataclass
class Found:
    """A checkpoint that verified: its step, run record and data position, and whether it
    had checksums to verify."""

    step: int
    record: RunRecord
    position: dict[str, Any]
    sealed: bool


@dataclasses.dataclass(frozen=True)
class Start:
    """What a run trains from: a state (restored from `found`, or new if None) at `step`,
    its data position, and whether the run has fallen back already (`Resume.fall_back`)."""

    state: TrainState
    position: phase_schedule.DataPosition
    step: int
    found: Found | None
    fell_back: bool = False

    @classmethod
    def of(
        cls,
        state: TrainState,
        position: phase_schedule.DataPosition,
        found: Found | None,
        phases: Sequence[phase_schedule.Phase],
        fell_back: bool = False,
    ) -> Start:
        """From `state` at the data `position`, or where the schedule `phases` puts its step
        (phase_schedule.consistent_position)."""
        step = int(jax.device_get(state.step))
        return cls(
            state,
            phase_schedule.consistent_position(position, step, phases),
            step,
            found,
            fell_back,
        )


class Resume:
    """Finds, checks and restores the checkpoint a run continues from."""

    def __init__(self, checkpointer: checkpoint.Checkpointer, quarantine_directory: str) -> None:
        self.checkpointer, self.quarantine_directory = checkpointer, quarantine_directory
        self.set_aside: list[int] = []  # damaged steps moved to the quarantine this run

    def where(self, step: int) -> str:
        return f"{self.checkpointer.directory}/{step}"

    def newest(self) -> Found | None:
        """The newest checkpoint that verifies and whose metadata reads (damaged newer ones
        are set aside); None if the workdir has none."""
        for step in reversed(self.checkpointer.all_steps()):
            sealed, problem = self._read(step, lambda: self.checkpointer.verify(step))  # noqa: B023 (at once)
            if problem is None:
                try:
                    meta, position = self._read(step, lambda: self.checkpointer.metadata(step))  # noqa: B023 (at once)
                    return Found(step, RunRecord.of(meta), position, sealed)
                except UnusableCheckpoint:
                    raise
                except Exception as e:  # (any other failure to read it)
                    if sealed:
                        raise UnusableCheckpoint(
                            f"checkpoint {self.where(step)} cannot be read although its files "
                            f"are intact: {first_line(e)}"
                        ) from e
                    problem = f"its metadata cannot be read ({first_line(e)})"
            self._set_aside(step, problem)
        if self.set_aside:
            steps = ", ".join(map(str, self.set_aside))
            raise UnusableCheckpoint(
                f"no usable checkpoint in {self.checkpointer.directory}: step(s) {steps} were "
                f"damaged and moved to {self.quarantine_directory}. Choices: rerun to start "
                "from step 0 in this workdir; move a (repaired) checkpoint back from there to "
                "resume from it; or use another --workdir."
            )
        return None

    def _newest_left(self) -> Found:
        """`newest()` after one was set aside: never None (it raises UnusableCheckpoint once
        the last one is gone)."""
        found = self.newest()
        assert found is not None
        return found

    def _read(self, step: int, read: Callable[[], T]) -> T:
        """`read()`; a read of checkpoint `step` that failed for the storage (after its
        retries) proves no damage: CheckpointUnreadable, and the checkpoint stays."""
        try:
            return read()
        except Exception as e:
            if not storage.unavailable(e):
                raise
            raise CheckpointUnreadable(
                f"cannot read checkpoint {self.where(step)}: {first_line(e)}; it was left in "
                f"place, and a rerun resumes from it (or from a newer one) once the storage "
                "answers"
            ) from e

    def _set_aside(self, step: int, problem: str) -> None:
        moved = self.checkpointer.quarantine(step, self.quarantine_directory)
        self.set_aside.append(step)
        console.chief_print(
            f"Checkpoint {self.where(step)} is damaged: {problem}; moved to {moved}"
        )

    def resumed_from(self, start: Start) -> str | None:
        """The checkpoint `start` was restored from (None: a new state)."""
        return self.where(start.step) if start.found else None

    def check(
        self,
        found: Found,
        expected: RunRecord,
        data: DataSettings,
        phases: Sequence[phase_schedule.Phase],
        allow_changed_data: bool,
    ) -> None:
        """Refuses `found` if this run (its record: `expected`) changes its model (or
        tokenizer, once recorded) or, mid-phase, its data (guards.check_resume); a changed
        shape (processes, devices) continues with a notice (`check_shape`)."""
        try:
            checkpoint_checks.check_compatible(
                found.record.as_json(), expected.as_json(), self.where(found.step)
            )
        except checkpoint_checks.CheckpointMismatch as e:
            raise self._naming_an_older_match(e, found.step, expected) from e
        if found.step < phases[-1].end_step:  # (a finished run only evaluates)
            check_shape(found.record, expected, self.where(found.step), allow_changed_data)
        guards.check_resume(
            found.record,
            expected.data or {},
            data,
            found.position,
            phase_schedule.phase_at(phases, found.step).name,
            self.where(found.step),
            allow_changed_data,
        )

    def _naming_an_older_match(
        self, error: checkpoint_checks.CheckpointMismatch, step: int, expected: RunRecord
    ) -> checkpoint_checks.CheckpointMismatch:
        """`error` (checkpoint `step` refused: another model or tokenizer), naming the newest
        older checkpoint that verifies and was written with this run's settings, if any: moving
        the newer ones aside resumes from it."""
        for older in reversed([s for s in self.checkpointer.all_steps() if s < step]):
            if self.checkpointer.verify(older)[1] is not None:
                continue
            try:
                meta, _ = self.checkpointer.metadata(older)
                checkpoint_checks.check_compatible(meta, expected.as_json(), self.where(older))
            except Exception:  # noqa: BLE001 (unreadable or another model too: not this one)
                continue
            newer = [s for s in self.checkpointer.all_steps() if s > older]
            return checkpoint_checks.CheckpointMismatch(
                f"{error}\nCheckpoint {self.where(older)} matches these settings: move "
                f"{', '.join(self.where(s) for s in newer)} aside (e.g. into "
                f"{self.quarantine_directory}) and rerun to resume from step {older}."
            )
        return error

    def restore(
        self,
        found: Found,
        abstract_state: TrainState,
        record: RunRecord,
        check: Callable[[Found], None],
    ) -> tuple[TrainState, phase_schedule.DataPosition]:
        """Restores `found` onto `abstract_state`'s shardings; a checkpoint without checksums
        that fails to restore, or restores NaN/Inf, and any that holds another step than its
        directory's name, is set aside and the next one (passed through `check`) tried."""
        while True:
            try:
                restore = functools.partial(
                    self.checkpointer.restore, found.step, abstract_state, record.as_json()
                )
                state, position, meta = self._read(found.step, restore)
                nonfinite.check_finite(state, found.step)
                if int(jax.device_get(state.step)) != found.step:  # (later saves would be
                    raise checkpoint_checks.DamagedCheckpoint(
                        self.where(found.step),
                        (  # skipped)
                            f"its directory is named {found.step} but it holds step "
                            f"{int(jax.device_get(state.step))} (renamed?)"
                        ),
                    )
                break
            except checkpoint_checks.CheckpointMismatch:
                raise
            except checkpoint_checks.DamagedCheckpoint as e:  # (every process computed the digest)
                self._set_aside(found.step, e.problem)
                found = self._newest_left()
                check(found)
            except checkpoint_checks.StateUnreadable as e:  # (every process alike: agreed)
                found = self._unreadable(found, e, check)
            except Exception as e:  # (any failure to restore it)
                if found.sealed or jax.process_count() > 1:
                    raise UnusableCheckpoint(
                        f"checkpoint {self.where(found.step)} failed to restore: {first_line(e)}"
                    ) from e
                self._set_aside(found.step, f"it cannot be restored ({first_line(e)})")
                found = self._newest_left()
                check(found)
        if self.set_aside:
            console.chief_print(
                f"Resuming from step {found.step} instead of "
                f"{max(self.set_aside)}: {max(self.set_aside) - found.step} "
                "steps will be trained again"
            )
        if not found.sealed:
            console.chief_print(unsealed_notice(self.where(found.step), meta))
        data_position = phase_schedule.DataPosition.from_dict(position)
        self.checkpointer.keep_until_newer_sealed(found.step)
        console.chief_print(
            f"Resuming from {self.checkpointer.directory} at step "
            f"{found.step} (phase {data_position.phase}, next batch "
            f"{data_position.batch_index})"
        )
        return state, data_position

    def _unreadable(
        self, found: Found, error: checkpoint_checks.StateUnreadable, check: Callable[[Found], None]
    ) -> Found:
        """The checkpoint to try after `found`'s state failed to restore (`error`): for one
        without checksums (its save may have been cut off, or it was damaged before its
        seal), the next older one, `found` set aside; one whose files match their
        checksums is not damaged: UnusableCheckpoint, with what failed."""
        if found.sealed:
            raise UnusableCheckpoint(
                f"checkpoint {self.where(found.step)} failed to restore although its files "
                f"match their checksums: {error.problem}"
            ) from error
        self._set_aside(found.step, f"it cannot be restored ({error.problem})")
        older = self._newest_left()
        check(older)
        return older

    def fall_back(
        self,
        start: Start,
        error: nonfinite.NonFiniteAfterResume,
        abstract_state: TrainState,
        record: RunRecord,
        check: Callable[[Found], None],
        phases: Sequence[phase_schedule.Phase],
    ) -> Start:
        """What to train from after every step since resuming from `start` was non-finite
        (`error`, raised again if the run has fallen back already: once): `start`'s
        checkpoint set aside (and any later step, none of which a finite step has come from)
        and the newest one before it restored (UnusableCheckpoint if there is none)."""
        if start.fell_back or start.found is None:
            raise error
        self.checkpointer.wait()
        for step in reversed(self.checkpointer.all_steps()):
            if step >= start.found.step:
                self._set_aside(
                    step,
                    "every step since resuming from it was non-finite; "
                    "falling back (once) to the checkpoint before it",
                )
        previous = self._newest_left()
        check(previous)
        state, position = self.restore(previous, abstract_state, record, check)
        return Start.of(state, position, previous, phases, fell_back=True)


def unsealed_notice(where: str, meta: dict[str, Any]) -> str:
    """The line for resuming from the checkpoint `where` (its `meta`), which has no checksums
    (its run stopped between its save and its seal): what was checked instead."""
    digest = meta.get(checkpoint_checks.DIGEST)
    checked = (
        f"its restored state matches the digest recorded at its save ({len(digest)} arrays, "
        "bit for bit) and is finite"
        if digest
        else "only that it restores and is finite (it records no digest of its state)"
    )
    return (
        f"Checkpoint {where} was not sealed (no {checkpoint.CHECKSUMS}: its run stopped between "
        f"its save and its seal), so its files were not checked; checked instead: {checked}"
    )


def shape(processes: int, devices: int | None) -> str:
    """`4 processes x 1 device`: a run's shape as its record gives it."""
    if devices is None:
        return f"{processes} process{'es' if processes != 1 else ''}"
    per = devices // processes
    return (
        f"{processes} process{'es' if processes != 1 else ''} x "
        f"{per} device{'s' if per != 1 else ''}"
    )


def check_shape(
    found: RunRecord, expected: RunRecord, where: str, allow_changed_data: bool
) -> None:
    """Continues the checkpoint `where` (its record: `found`) on this run's shape: global
    batch k holds the same instances and masks on any number of processes and devices, so a
    relaunch on another shape says so in one line and continues (exactly on the same number
    of devices; on another, the sums are reduced in another order). Refused (OtherProcessCount)
    only for a checkpoint of an older version trained by several processes, each on its own
    share of the documents, whose batches cannot be reproduced; with `allow_changed_data`,
    a warning instead."""
    old, new = found.processes, expected.processes
    if old is None or new is None:
        return
    if found.data_order != GLOBAL and old > 1:
        if allow_changed_data:
            logging.warning(
                "continuing checkpoint %s, trained by %d processes each on its own share "
                "of the documents (train.allow_changed_data): the batches differ from here on",
                where,
                old,
            )
            return
        raise OtherProcessCount(
            f"checkpoint {where} was trained by {old} processes with an older bertjax, whose "
            f"processes each prepared their own share of the documents (document i on "
            f"process i mod {old}); this version's batches are the same on any number of "
            "processes but are not those, so the batches from here on would differ from an "
            "uninterrupted run's. Accept them with --config.train.allow_changed_data=True; or "
            "start a new run in another --workdir (--config.train.init_checkpoint="
            "THIS_WORKDIR/checkpoints starts it from these parameters)"
        )
    if (old, found.devices) == (new, expected.devices) or (found.devices is None and old == new):
        return
    same_devices = found.devices == expected.devices
    console.chief_print(
        f"The run's shape changed: checkpoint {where} was trained on "
        f"{shape(old, found.devices)}, this run has {shape(new, expected.devices)}; it "
        "continues with the same global batches and masks"
        + (
            " (the same device count: exactly)"
            if same_devices
            else " (another device count: the losses differ only by the order of the sums)"
        )
    )


def restore_exactly(
    checkpointer: checkpoint.Checkpointer,
    step: int,
    abstract_state: TrainState,
    meta: dict[str, Any],
) -> tuple[TrainState, dict[str, Any]]:
    """`(state, position)` of checkpoint `step`; a checkpoint that differs from its recorded
    checksums (e.g. its epoch or best-so-far in the position edited), fails to restore or
    does not match its digest is one DamagedCheckpoint error naming it and the way on."""
    if step not in checkpointer.all_steps():  # (deleted: no checkpoint before it helps)
        raise checkpoint_checks.DamagedCheckpoint(
            f"{checkpointer.directory}/{step}",
            ("it is missing; start this fine-tuning again with --overwrite"),
        )
    try:
        problem = checkpointer.verify(step)[1]
        if problem:
            raise checkpoint_checks.DamagedCheckpoint(f"{checkpointer.directory}/{step}", problem)
        state, position, _ = checkpointer.restore(step, abstract_state, meta)
    except checkpoint_checks.CheckpointMismatch:
        raise
    except Exception as e:  # (any failure to restore it)
        problem = (
            e.problem
            if isinstance(e, checkpoint_checks.DamagedCheckpoint)
            else (f"it cannot be restored ({failures.first_line(e)})")
        )
        raise checkpoint_checks.DamagedCheckpoint(
            f"{checkpointer.directory}/{step}",
            (
                f"{problem}; move it out of {checkpointer.directory} and rerun to resume from the "
                "checkpoint before it, or start this fine-tuning again with --overwrite"
            ),
        ) from e
    return state, position
