"""One check of every numeric config field against its range, before any work (no file
written, no data prepared, nothing compiled): pretraining (`pretraining`) and fine-tuning
(`finetuning`) configs. A refusal is one line naming the field, its value, the allowed range
and the fix. (A learning rate of 0 is allowed: a run that only evaluates or converts
starting weights.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections
from absl import logging

from bertjax.data.errors import DataError
from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.models import families
from bertjax.models.layers import config as layer_config
from bertjax.runtime import schema
from bertjax.runtime.schema import (
    BELOW_1,
    Range,
    Schema,
)
from bertjax.training import optim, schedules
from bertjax.training.finetune_schema import FinetuneFields, NerFields, SquadFields
from bertjax.training.settings import (
    LongPhaseSettings,
    OptimizerSettings,
    PretrainingSettings,
    TrainSettings,
)
from bertjax.training.sharding import MeshSettings

# (field, its range): the model's dropout, which validate checks field by field; the other
# sections carry their ranges in their schema (SECTIONS, FINETUNING).
Rule = tuple[str, Range]

SECTIONS: dict[str, type[Schema]] = {
    "train": TrainSettings,
    "long_phase": LongPhaseSettings,
    "data": DataSettings,
    "optimizer": OptimizerSettings,  # (fine-tuning's too: the fields it has)
    "mesh": MeshSettings,  # (no ranges: the mesh checks its sizes against the devices)
}
BERT_DROPOUT: list[Rule] = [
    ("model.hidden_dropout_prob", BELOW_1),  # (ModernBERT's: its check)
    ("model.attention_probs_dropout_prob", BELOW_1),
]
FINETUNING: tuple[type[Schema], ...] = (FinetuneFields, SquadFields, NerFields)  # (at the top)


def optimizer_choices() -> dict[str, tuple[str, ...]]:
    """The optimizer section's settings that name one of a few choices (the optimizers:
    those registered now, `optim.names`). The model's: bert_config.check; the data's, train's
    and long phase's: PretrainingSettings, checked as it is built."""
    return {
        "optimizer.name": optim.names(),
        "optimizer.schedule": schedules.SCHEDULE_NAMES,
        "optimizer.decay_shape": schedules.DECAY_SHAPES,
    }


def _value(config: Mapping[str, Any], field: str) -> Any:
    value = config
    for name in field.split("."):
        value = value[name]
    return value


def check(config: Mapping[str, Any], rules: list[Rule]) -> None:
    """Raises ConfigError for the first field of `rules` outside its range (or not a finite
    number)."""
    for field, allowed in rules:
        value = _value(config, field)
        if not allowed.holds(value):
            raise ConfigError(
                f"{field}={value!r} is out of range: it must be {allowed.text}; "
                f"set --config.{field}"
            )


def check_sections(
    config: ml_collections.ConfigDict,
    only: dict[str, tuple[str, ...]],
    sections: dict[str, type[Schema]] = SECTIONS,
) -> None:
    """Raises ConfigError for the first field of the schema'd `sections` outside its range: of
    the sections `only` names, all fields (an empty tuple) or those it lists. The long phase's
    own lengths are checked only when it runs."""
    for name, fields in only.items():
        values = {k: v for k, v in config[name].items() if not fields or k in fields}
        runs = name != "long_phase" or config.long_phase.fraction > 0
        skip = () if runs else LongPhaseSettings.RUN_ONLY
        refusal = schema.out_of_range(sections[name], values, name, skip)
        if refusal:
            raise ConfigError(refusal)


def check_choices(config: ml_collections.ConfigDict, choices: dict[str, tuple[str, ...]]) -> None:
    """Raises ConfigError for the first field of `choices` whose value is not one of its
    choices (compared as lower-case text)."""
    for field, allowed in choices.items():
        value = _value(config, field)
        if str(value).lower() not in allowed:
            raise ConfigError(
                f"{field}={value!r} is not one of {', '.join(map(repr, allowed))}; "
                f"set --config.{field}"
            )


def settings(config: ml_collections.ConfigDict) -> PretrainingSettings:
    """The typed settings of a pretraining `config` (their choices and the mask mix checked:
    ConfigError)."""
    try:
        return PretrainingSettings.of(config)
    except DataError as e:
        raise ConfigError(str(e)) from e


def pretraining(config: ml_collections.ConfigDict) -> PretrainingSettings:
    """Every check a pretraining config allows before any data is read, its model the
    config's own (`sections`, then `model`). Returns the settings, built once here."""
    typed = sections(config)
    model(typed)
    return typed


def sections(config: ml_collections.ConfigDict) -> PretrainingSettings:
    """The checks of a pretraining config that do not depend on its model (which a run may
    take from its init checkpoint or its tokenizer: `model` checks it then): the ranges, the
    choices, a warmup that fits in the run. Returns the settings, built once here."""
    check_sections(config, dict.fromkeys(SECTIONS, ()))
    check_choices(config, optimizer_choices())
    typed = settings(config)
    warmup, total = config.optimizer.warmup_steps, config.train.total_steps
    if warmup > total:
        raise ConfigError(
            f"optimizer.warmup_steps={warmup} is longer than the run "
            f"(train.total_steps={total}): the learning rate would never reach "
            "its peak nor decay; set --config.optimizer.warmup_steps <= "
            f"{total} (the paper warms up for 1% of the steps)"
        )
    if config.optimizer.schedule == "wsd" and config.long_phase.restart_optimizer:
        raise ConfigError(
            "long_phase.restart_optimizer=True restarts BERT's linear schedule; "
            "optimizer.schedule='wsd' holds its peak through the phases instead: "
            "set --config.long_phase.restart_optimizer=False or "
            "--config.optimizer.schedule=linear"
        )
    return typed


def model(typed: PretrainingSettings) -> None:
    """The model of pretraining settings `typed`: its family and shape (`model_family`), its
    family's ranges, and what the run asks of it (`pretraining_model`)."""
    model_family(typed.model)
    rules = list(families.get(families.family(typed.model)).pretraining_rules)
    check({"model": typed.model}, rules)
    pretraining_model(typed)


def pretraining_model(typed: PretrainingSettings) -> None:
    """The model of pretraining settings `typed` (its family and shape checked:
    `model_family`): what its family can pretrain (`Family.check_pretraining`: BERT's two
    segment types, ModernBERT's masked LM alone), positions for every phase's length, and room
    for the SentencePiece model it trains."""
    model = typed.model_config
    families.of(model).check_pretraining(
        model, typed.train.objective, typed.train.next_sentence_prediction
    )
    positions, vocab_size = model.max_position_embeddings, model.vocab_size
    for phase in typed.phases:
        if phase.max_seq_length > positions:
            field = "data.max_seq_length" if phase.name == "short" else "long_phase.max_seq_length"
            shorter = f"--config.{field} <= {positions}"
            fix = (
                f"{shorter} (the model is init_checkpoint's)"
                if typed.train.init_checkpoint
                else f"--config.model.max_position_embeddings >= {phase.max_seq_length}, "
                f"or {shorter}"
            )
            raise ConfigError(
                f"{field}={phase.max_seq_length} (phase {phase.name}) is longer than "
                f"model.max_position_embeddings={positions}; "
                f"set {fix}"
            )
    data = typed.data
    trains_sentencepiece = (
        data.tokenizer == "sentencepiece" and not data.vocab_file and not data.prepared_dir
    )
    if trains_sentencepiece and data.sentencepiece_vocab_size > vocab_size:
        raise ConfigError(
            f"data.sentencepiece_vocab_size={data.sentencepiece_vocab_size} is "
            f"larger than model.vocab_size={vocab_size}: the tokenizer "
            "the run trains would not fit the model; set "
            f"--config.model.vocab_size >= {data.sentencepiece_vocab_size}, or "
            f"--config.data.sentencepiece_vocab_size <= {vocab_size}"
        )


def model_family(model: Mapping[str, Any]) -> None:
    """The model section's family and shape (`families.check`), as a ConfigError."""
    try:
        families.check(dict(model))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def finetuning(config: ml_collections.ConfigDict) -> None:
    """Every range of a fine-tuning config (and of its task's fields), and its seeds."""
    for fields in FINETUNING:  # (a task's fields where its config has them)
        refusal = schema.out_of_range(fields, config, "")
        if refusal:
            raise ConfigError(refusal)
    check_sections(config, {"optimizer": ()})
    check_choices(config, {"dtype": layer_config.DTYPES, "optimizer.name": optim.names()})
    seeds(config.seeds)
    if config.warmup_proportion >= 1:
        logging.warning(
            "warmup_proportion=%s: the learning rate climbs for the whole run and "
            "never decays (the recipe warms up for 0.1)",
            config.warmup_proportion,
        )


def seeds(value: object) -> list[int]:
    """The seeds of a fine-tuning config's comma-separated `seeds` (at least one)."""
    try:
        found = [int(s) for s in str(value).replace(" ", "").split(",") if s]
    except ValueError:
        found = []
    if not found:
        raise ConfigError(
            f"seeds={value!r} is not a comma-separated list of integers (e.g. "
            "1,2,3); set --config.seeds"
        )
    return found


def data_preparation(config: ml_collections.ConfigDict) -> PretrainingSettings:
    """The ranges of a pretraining config that its data preparation depends on (the data, the
    phases' lengths and the schedule that makes them); returns the settings."""
    check_sections(
        config, {"data": (), "long_phase": (), "train": ("total_steps", "global_batch_size")}
    )
    return settings(config)
