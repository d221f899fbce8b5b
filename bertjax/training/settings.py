"""Pretraining's settings as typed, frozen values, built once at an entry point
(`PretrainingSettings.of`, from validate.py): `config.train`, `config.long_phase` and
`config.data` (bertjax.data.settings), with their choices checked there in one line naming the
`--config.SECTION.FIELD` to set, and what the run derives from them computed there.

The fields keep the config's names, types and defaults (configs/base.py documents each one);
validate.py checks their ranges before the conversion. A config an older run recorded
(`recorded=True`) gives its missing fields their default here, else their type's empty value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Literal

from bertjax.data.settings import DataSettings, typed
from bertjax.errors import ConfigError
from bertjax.training import objectives, phase_schedule
from bertjax.training.sharding import MeshSettings


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How pretraining runs (`config.train`, same field names)."""

    global_batch_size: int  # sequences per optimizer step, all hosts
    grad_accum_steps: int  # micro-batches per step; 0 = auto
    total_steps: int  # optimizer steps, both phases
    log_every: int  # steps
    eval_every: int  # steps; 0 = only at the end
    eval_batches: int  # batches per evaluation
    checkpoint_every: int  # steps
    keep_checkpoints: int  # checkpoints
    keep_every: int  # steps; 0 = none kept beyond the latest
    init_checkpoint: str  # a directory; empty = fresh parameters
    stop_after_steps: int  # steps; 0 = no limit
    max_nonfinite_steps: int = 10  # consecutive steps
    profile_steps: int = 0  # steps traced by jax.profiler into WORKDIR/profile; 0 = none
    allow_changed_data: bool = False
    extend: bool = False
    seed: int = 42  # parameter init and dropout
    next_sentence_prediction: bool = True
    objective: Literal["mlm", "ltr"] = "mlm"

    @classmethod
    def of(cls, train: Mapping[str, Any], recorded: bool = False) -> TrainSettings:
        """The settings of `train` (config.train); ConfigError naming an unknown choice."""
        return typed(cls, train, "train", ConfigError, recorded)

    @property
    def pretraining_objective(self) -> objectives.PretrainingObjective:
        """What the run optimises: `objective` and `next_sentence_prediction`."""
        return objectives.PretrainingObjective(self.objective, self.next_sentence_prediction)


@dataclasses.dataclass(frozen=True)
class LongPhaseSettings:
    """The long-sequence phase (`config.long_phase`, same field names)."""

    fraction: float  # of train.total_steps; 0 = no long phase
    max_seq_length: int  # tokens
    max_predictions_per_seq: int
    global_batch_size: int = 0  # sequences per step; 0 = train.global_batch_size
    restart_optimizer: bool = False
    restart_warmup_steps: int = -1  # steps; -1 = optimizer.warmup_steps
    restart_peak_learning_rate: float = 0.0  # 0 = optimizer.peak_learning_rate

    @classmethod
    def of(cls, long_phase: Mapping[str, Any], recorded: bool = False) -> LongPhaseSettings:
        return typed(cls, long_phase, "long_phase", ConfigError, recorded)


@dataclasses.dataclass(frozen=True)
class PretrainingSettings:
    """A pretraining config's sections: train, long_phase and data typed; the model section
    as its values (`families.model_config` types it), the optimizer section as its values
    (completed by run_schedule: optim.OptimizerConfig), the mesh typed."""

    train: TrainSettings
    long_phase: LongPhaseSettings
    data: DataSettings
    model: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mesh: MeshSettings = MeshSettings()

    @classmethod
    def of(cls, config: Mapping[str, Any], recorded: bool = False) -> PretrainingSettings:
        """The settings of a pretraining `config`; DataError or ConfigError naming the field
        whose value is not one of its choices."""
        return cls(
            TrainSettings.of(config["train"], recorded),
            LongPhaseSettings.of(config["long_phase"], recorded),
            DataSettings.of(config["data"], recorded),
            dict(config.get("model", {})),
            dict(config.get("optimizer", {})),
            MeshSettings.of(dict(config.get("mesh", {}))),
        )

    @functools.cached_property
    def phases(self) -> list[phase_schedule.Phase]:
        """The phases these settings plan (plan_phases), derived once: the run's
        check, its schedule (run_schedule) and its data preparation read them here."""
        return plan_phases(self.train, self.data, self.long_phase)


def plan_phases(
    train: TrainSettings, data: DataSettings, long_phase: LongPhaseSettings
) -> list[phase_schedule.Phase]:
    """The paper's schedule from the settings `train`, `data` and `long_phase`:
    `1 - long_phase.fraction` of the steps at data.max_seq_length, the rest at
    long_phase.max_seq_length (one optimizer and learning-rate schedule)."""
    total = train.total_steps
    long_steps = round(total * long_phase.fraction)
    short = phase_schedule.Phase(
        "short",
        data.max_seq_length,
        data.max_predictions_per_seq,
        train.global_batch_size,
        0,
        total - long_steps,
    )
    result = [short] if short.end_step > 0 else []
    if long_steps:
        result.append(
            phase_schedule.Phase(
                "long",
                long_phase.max_seq_length,
                long_phase.max_predictions_per_seq,
                long_phase.global_batch_size or train.global_batch_size,
                total - long_steps,
                total,
            )
        )
    return result
