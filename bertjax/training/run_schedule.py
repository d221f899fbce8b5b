"""The schedule a pretraining run follows in its workdir: the phases' step ranges and the
learning rate of every step. A new run plans it from its config; a resumed run keeps the
schedule its checkpoint recorded (its run record's `schedule`), so that a rerun never moves
the phases or the learning rate under steps already trained. A rerun that changes a field of
`SCHEDULE_FIELDS` is refused, unless it asks to extend the run (`train.extend`): the steps the
run had been planned for keep their schedule; the steps added after them train in its last
phase, at the learning rate this config's schedule gives them (docs/pretraining.md). Another
optimizer (`optimizer.name`), whose state would not be the checkpoint's, is refused always.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from bertjax.checkpoints import checkpoint_checks
from bertjax.checkpoints.run_record import RunRecord
from bertjax.runtime import console
from bertjax.training import optim, schedules, sharded_run
from bertjax.training.phase_schedule import Phase
from bertjax.training.settings import PretrainingSettings

# The config fields that set the phases' step ranges or the learning rate of a step.
SCHEDULE_FIELDS = (
    "train.total_steps",
    "optimizer.peak_learning_rate",
    "optimizer.warmup_steps",
    "long_phase.fraction",
    "long_phase.restart_optimizer",
    "long_phase.restart_warmup_steps",
    "long_phase.restart_peak_learning_rate",
    "optimizer.schedule",
    "optimizer.decay_fraction",
    "optimizer.decay_shape",
)


class ScheduleChanged(checkpoint_checks.CheckpointMismatch):
    """A rerun would change the schedule of steps its checkpoint trained or planned."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The phases (with their step ranges) and the optimizer with its learning rate."""

    phases: list[Phase]
    optimizer_config: optim.OptimizerConfig

    def record(self) -> dict[str, Any]:
        """What a checkpoint's run record holds as its `schedule` (JSON values)."""
        return {
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "optimizer": self.optimizer_config.to_json(),
        }


def planned(settings: PretrainingSettings, optimizer: Mapping[str, Any]) -> Plan:
    """A run's schedule from its `settings` (their phases) and the config section
    `optimizer`."""
    train, long_phase, phases = settings.train, settings.long_phase, settings.phases
    return Plan(
        phases, sharded_run.pretraining_optimizer(optimizer, train.total_steps, long_phase, phases)
    )


def recorded(record: RunRecord) -> Plan:
    """The schedule a checkpoint's `record` holds (for older checkpoints, planned from the
    config it records)."""
    if record.schedule is not None:
        return Plan(
            [Phase(**p) for p in record.schedule["phases"]],
            optim.OptimizerConfig.from_json(record.schedule["optimizer"]),
        )
    config = record.config_values
    return planned(PretrainingSettings.of(config, recorded=True), config["optimizer"])


def _field(sections: Mapping[str, Any], field: str) -> Any:
    section, name = field.split(".")
    value = sections[section]
    value = getattr(value, name, None) if dataclasses.is_dataclass(value) else value.get(name)
    if value is None and section == "optimizer":  # (a field older checkpoints lack: its default)
        value = getattr(optim.OptimizerConfig, name)
    return json.loads(json.dumps(value))


def resumed(
    record: RunRecord, where: str, settings: PretrainingSettings, optimizer: Mapping[str, Any]
) -> Plan:
    """The schedule of a run resuming from the checkpoint `where` with `record`: the recorded
    one (the phases with this config's lengths and batches) if this config keeps every
    field of SCHEDULE_FIELDS; with `train.extend`, the recorded one extended to this config's
    total_steps; else ScheduleChanged, naming the changes and the choices."""
    train, long_phase = settings.train, settings.long_phase
    old = record.config_values
    new = {"train": train, "long_phase": long_phase, "optimizer": optimizer}
    if _field(old, "optimizer.name") != _field(new, "optimizer.name"):
        raise ScheduleChanged(
            f"checkpoint {where} was trained with optimizer.name="
            f"{_field(old, 'optimizer.name')!r}, and this run asks for "
            f"{_field(new, 'optimizer.name')!r}: its optimizer state belongs to the first. Rerun "
            f"with --config.optimizer.name={_field(old, 'optimizer.name')}; or start a new run "
            "in another --workdir (--config.train.init_checkpoint=THIS_WORKDIR/checkpoints "
            "starts it from these parameters)"
        )
    changes = [
        f"{field}: {_field(old, field)!r} -> {_field(new, field)!r}"
        for field in SCHEDULE_FIELDS
        if _field(old, field) != _field(new, field)
    ]
    before = recorded(record)
    end = before.phases[-1].end_step
    shapes = {p.name: p for p in settings.phases}
    if sorted(shapes) != sorted(p.name for p in before.phases):
        changes = changes or [f"phases: {[p.name for p in before.phases]} -> {sorted(shapes)}"]
        if train.extend:
            raise ScheduleChanged(
                f"checkpoint {where}: train.extend=True continues the run's phases "
                f"({', '.join(p.name for p in before.phases)}) but this config has "
                f"{', '.join(shapes)}: keep --config.long_phase.fraction as it was "
                f"({_field(old, 'long_phase.fraction')}), or use another --workdir"
            )
    if not changes:
        return Plan(
            [
                dataclasses.replace(shapes[p.name], start_step=p.start_step, end_step=p.end_step)
                for p in before.phases
            ],
            before.optimizer_config,
        )
    if not train.extend:
        raise ScheduleChanged(
            f"checkpoint {where} was trained on a schedule this run changes ({'; '.join(changes)})"
            ": resuming would move the phases and the learning rate under the steps it "
            f"trained. Use another --workdir for a new run; or extend this one past step "
            f"{end} with --config.train.extend=True (steps 1-{end} keep their schedule, the "
            f"added ones train in phase {before.phases[-1].name} at the learning rate this "
            "config gives them: docs/pretraining.md); or rerun with the settings it recorded."
        )
    if train.total_steps <= end:
        raise ScheduleChanged(
            f"checkpoint {where}: train.extend=True continues a run past the end of its "
            f"schedule (step {end}), but train.total_steps={train.total_steps}; set "
            f"--config.train.total_steps > {end}, or use another --workdir"
        )
    phases = [
        dataclasses.replace(shapes[p.name], start_step=p.start_step, end_step=p.end_step)
        for p in before.phases
    ]
    phases[-1] = dataclasses.replace(phases[-1], end_step=train.total_steps)
    extension = sharded_run.pretraining_optimizer(optimizer, train.total_steps, long_phase, phases)
    recorded_config = before.optimizer_config
    earlier = (*recorded_config.earlier, (end, dataclasses.replace(recorded_config, earlier=())))
    extended = dataclasses.replace(extension, earlier=earlier)
    console.chief_print(
        f"Extending the run past step {end} (train.extend): steps "
        f"{end + 1}-{train.total_steps} train in phase {phases[-1].name}, the "
        f"learning rate from {schedules.learning_rate_at(extended, end):.3e}"
    )
    return Plan(phases, extended)
