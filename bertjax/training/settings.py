"""Pretraining's settings: the schema of `config.train` and `config.long_phase` (each field's
default, unit, range and doc: bertjax.runtime.schema), and the typed, frozen values of a whole
pretraining config, built once at an entry point (`PretrainingSettings.of`, from validate.py),
with `config.data` (bertjax.data.settings): their choices checked there in one line naming the
`--config.SECTION.FIELD` to set, and what the run derives from them computed there.

validate.py checks the ranges before the conversion. A config an older run recorded
(`recorded=True`) gives its missing fields their default here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.runtime.schema import (
    AT_LEAST_0,
    AT_LEAST_1,
    BELOW_1,
    POSITIVE,
    PROBABILITY,
    SEQ_LENGTH,
    Range,
    setting,
    typed,
)
from bertjax.training import objectives, phase_schedule
from bertjax.training.sharding import MeshSettings


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How pretraining runs (`config.train`, same field names)."""

    global_batch_size: int = setting(
        256, "sequences per optimizer step, summed over all hosts", "sequences", AT_LEAST_1
    )
    grad_accum_steps: int = setting(
        0,
        "micro-batches per step (the global batch stays the same); 0 = auto: per phase, the "
        "fewest that fit the devices' memory (bertjax.training.autofit; 1 on CPU)",
        "micro-batches",
        Range(">= 1, or 0 for auto", lambda v: v >= 0),
    )
    total_steps: int = setting(1_000_000, "optimizer steps, both phases", "steps", AT_LEAST_1)
    log_every: int = setting(
        100, "steps between progress lines and TensorBoard scalars", "steps", AT_LEAST_1
    )
    eval_every: int = setting(
        10_000, "steps between evaluations; 0 = only at the end", "steps", AT_LEAST_0
    )
    eval_batches: int = setting(50, "batches per evaluation", "batches", AT_LEAST_0)
    checkpoint_every: int = setting(
        10_000, "steps between checkpoints (one is also saved at the end)", "steps", AT_LEAST_1
    )
    keep_checkpoints: int = setting(3, "latest checkpoints kept", "checkpoints", AT_LEAST_1)
    keep_every: int = setting(
        100_000,
        "also keep every checkpoint at a multiple of this; 0 = none",
        "steps",
        AT_LEAST_0,
    )
    init_checkpoint: str = setting(
        "", "parameters to start from: a Google TF, Hugging Face or bertjax directory"
    )
    stop_after_steps: int = setting(
        0, "stop this run after N steps (time-limited jobs); 0 = no limit", "steps", AT_LEAST_0
    )
    max_nonfinite_steps: int = setting(
        10, "consecutive non-finite steps before the run stops", "steps", AT_LEAST_1
    )
    profile_steps: int = setting(
        0,
        "trace N steps with jax.profiler (those after this run's first, compiled, step) into "
        "WORKDIR/profile, for TensorBoard's profile plugin or Perfetto; 0 = no trace",
        "steps",
        AT_LEAST_0,
    )
    allow_changed_data: bool = setting(
        False,
        "resume in the middle of a phase with changed data settings or corpus (refused by "
        "default: the batches would differ from an uninterrupted run's)",
    )
    extend: bool = setting(
        False,
        "rerun a workdir with another schedule (run_schedule.SCHEDULE_FIELDS; refused by "
        "default): the run's steps keep their phases and learning rates, the added steps "
        'train in its last phase (docs/pretraining.md, "Extending a run")',
    )
    seed: int = setting(42, "parameter init and dropout seed")
    next_sentence_prediction: bool = setting(
        True,
        "ablation (paper Table 5); False: no NSP loss, and instances whose B always really "
        "follows A; the NSP head stays in the parameters",
    )
    objective: Literal["mlm", "ltr"] = setting(
        "mlm",
        "`mlm` (masked LM) or `ltr`: left-to-right LM, causal attention, next-token loss over "
        "every real token, no NSP, einsum attention only",
    )

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

    fraction: float = setting(
        0.1,
        "the fraction of train.total_steps at the long length; 0 disables",
        "fraction",
        PROBABILITY,
    )
    max_seq_length: int = setting(512, "tokens per sequence", "tokens", SEQ_LENGTH)
    max_predictions_per_seq: int = setting(
        80, "masked positions per sequence", "positions", AT_LEAST_1
    )
    global_batch_size: int = setting(
        0,
        "sequences per step; 0 = train.global_batch_size",
        "sequences",
        Range("> 0, or 0 for train.global_batch_size", lambda v: v >= 0),
    )
    restart_optimizer: bool = setting(
        False,
        "deviation, off = one optimizer and schedule over both phases (the paper's wording); "
        "True starts the long phase as the original code's second run did: fresh Adam "
        "moments, a new warmup and linear decay (docs/deviations.md)",
    )
    restart_warmup_steps: int = setting(
        -1, "warmup after the restart; -1 = optimizer.warmup_steps", "steps"
    )
    restart_peak_learning_rate: float = setting(
        0.0, "peak after the restart; 0 = optimizer.peak_learning_rate", "learning rate"
    )

    #: the fields checked only when the phase runs (fraction > 0)
    RUN_ONLY: ClassVar[tuple[str, ...]] = ("max_seq_length", "max_predictions_per_seq")

    @classmethod
    def of(cls, long_phase: Mapping[str, Any], recorded: bool = False) -> LongPhaseSettings:
        return typed(cls, long_phase, "long_phase", ConfigError, recorded)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The schema of the optimizer and its learning-rate schedule (`config.optimizer`, same
    field names; fine-tuning's lacks the learning rate and warmup, which it sets its own way).
    A run completes it with its step counts (`optim.optimizer_config`)."""

    name: str = setting(
        "bert_adam",
        "one of optim.names() (the registered optimizers): `bert_adam` (the original's), `adamw` "
        "(bias-corrected), `lamb`, `stable_adamw` (AdamW with per-tensor update clipping: "
        "Wortsman et al. 2023; ModernBERT's)",
    )
    peak_learning_rate: float = setting(
        1e-4, "the learning rate after warmup", "learning rate", AT_LEAST_0
    )
    warmup_steps: int = setting(10_000, "steps of linear warmup", "steps", AT_LEAST_0)
    schedule: str = setting(
        "linear",
        "`linear` (the paper's: decays from the peak to 0 at the last step) or `wsd` "
        "(warmup-stable-decay: the peak until the last decay_fraction of the steps; ModernBERT's)",
    )
    decay_fraction: float = setting(
        0.1, "`wsd`: the last fraction of the steps, decaying to 0", "fraction", PROBABILITY
    )
    decay_shape: str = setting(
        "1-sqrt", "`wsd`: the decay's shape, `linear` or `1-sqrt` (Hägele et al. 2024)"
    )
    weight_decay_rate: float = setting(
        0.01, "decoupled weight decay (x lr); not on LayerNorm or biases", "rate", AT_LEAST_0
    )
    b1: float = setting(0.9, "Adam's beta1", "decay rate", BELOW_1)
    b2: float = setting(0.999, "Adam's beta2", "decay rate", BELOW_1)
    eps: float = setting(1e-6, "Adam's epsilon", "", POSITIVE)
    clip_global_norm: float = setting(
        1.0,
        "the gradients' global-norm clip; 0 disables",
        "norm",
        Range(">= 0 (0 disables clipping)", lambda v: v >= 0),
    )


@dataclasses.dataclass(frozen=True)
class PretrainingSettings:
    """A pretraining config's sections: train, long_phase and data typed; the model section
    as its values, which the run resolves (`PretrainingRun.resolved`) and then reads typed
    (`model_config`); the optimizer section as its values (completed by run_schedule:
    optim.OptimizerConfig), the mesh typed."""

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

    def with_model(self, model: Mapping[str, Any]) -> PretrainingSettings:
        """These settings with the model section `model` (the run's, once resolved)."""
        return dataclasses.replace(self, model=dict(model))

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        """The model section as its family's config (`families.model_config`), built once:
        what the run and its checks read of the model (`validate.model_family` first names a
        section it cannot build)."""
        return families.model_config(self.model)

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
