"""The phase schedule of pretraining: which sequence length, predictions and batch each step
trains with (phases), and where in the data a run stands (the data position a checkpoint
saves). The learning-rate schedule is schedules.py's; what a run records of both,
run_schedule.py's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from absl import logging

from bertjax.data.batch import PhaseShape


@dataclasses.dataclass(frozen=True)
class Phase(PhaseShape):
    """A contiguous range of steps trained at one sequence length: its batches' shape
    (`batch.PhaseShape`: name, max_seq_length, max_predictions_per_seq, global_batch_size)
    and its steps."""

    start_step: int
    end_step: int


# The config field that sets each phase's global batch (the long phase's: 0 = the short's).
BATCH_FIELDS = {"short": "train.global_batch_size", "long": "long_phase.global_batch_size"}


def phase_at(schedule: Sequence[Phase], step: int) -> Phase:
    """The phase that trains `step` (the last phase for steps past the end)."""
    for phase in schedule:
        if step < phase.end_step:
            return phase
    return schedule[-1]


@dataclasses.dataclass(frozen=True)
class DataPosition:
    """The next batch to train on: batch `batch_index` of phase `phase` (checkpointed as the
    JSON `{"phase": ..., "batch_index": ...}`)."""

    phase: str
    batch_index: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DataPosition:
        return cls(values["phase"], int(values["batch_index"]))


def consistent_position(
    position: DataPosition, step: int, schedule: Sequence[Phase]
) -> DataPosition:
    """The saved data position, unless the phase schedule changed (e.g. a new total_steps):
    then the position the new schedule implies for `step`."""
    phase = phase_at(schedule, step)
    if position.phase == phase.name:
        return position
    implied = DataPosition(phase.name, step - phase.start_step)
    logging.warning(
        "checkpoint data position %s does not match this run's phase schedule at "
        "step %d; continuing at %s",
        position.as_dict(),
        step,
        implied.as_dict(),
    )
    return implied
