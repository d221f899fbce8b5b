"""The model of a pretraining run's `train.init_checkpoint`: the architecture read from the
checkpoint's config file (`pretrained.architecture_of`), which the run's `model` section takes
(`checkpoint_model`, `model_of_init_checkpoint`), and a ModernBERT's padding id checked
against the tokenizer (`check_tokenizer`; which tokenizer: `pretrained.tokenizer_of`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from bertjax.data import tokenization
from bertjax.errors import ConfigError
from bertjax.interop import pretrained, pretrained_weights
from bertjax.interop.pretrained import PretrainedError
from bertjax.interop.tree import ConversionError
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.runtime import console, files


def checkpoint_model(
    model: Mapping[str, Any], path: str, explicit: Collection[str] = ()
) -> dict[str, Any]:
    """The fields of a pretraining config's `model` section (`model`: its values) that the
    checkpoint at `path` changes: its architecture, as `from_pretrained` takes it, and a
    ModernBERT's padding id unless `explicit` names it. A field that `explicit` (the dotted
    names set on the command line) sets to another value than the checkpoint's, or a
    checkpoint of another family, is refused in one line before any data work."""
    try:
        found = pretrained.architecture_of(path)
    except (ConversionError, FileNotFoundError) as e:  # (FileNotFoundError: no finished step)
        raise PretrainedError(f"init_checkpoint={path!r}: {e}") from None
    if families.name_of(found) != families.family(model):
        raise PretrainedError(pretrained_weights.other_family(found, families.family(model), path))
    values = families.architecture(found)
    contradicted = [
        f"--config.model.{name}={model[name]!r} (the checkpoint's: {value!r})"
        for name, value in values.items()
        if f"model.{name}" in explicit and model[name] != value
    ]
    if contradicted:
        raise PretrainedError(
            f"{', '.join(contradicted)} contradicts init_checkpoint {path}, "
            "whose architecture the run takes: drop the override, or start "
            "from another checkpoint"
        )
    if families.of(found).tokenizer_pad and "model.pad_token_id" not in explicit:
        values["pad_token_id"] = families.of(found).pad_id(found)  # (checked: the tokenizer's)
    return {name: value for name, value in values.items() if model[name] != value}


def model_of_init_checkpoint(
    model: Mapping[str, Any],
    init_checkpoint: str,
    workdir: str,
    overrides: Collection[str],
    tell: bool = True,
) -> dict[str, Any]:
    """The fields of the `model` section that the architecture of `init_checkpoint` changes
    (`checkpoint_model`; none without one), told in a line if `tell`. A resumed run (in `workdir`)
    whose init_checkpoint has gone since takes its own checkpoints' architecture."""
    path = init_checkpoint
    if not path or families.family(model) not in families.names():
        return {}  # (an unknown family: validate.model_family names it)
    if not pretrained.exists(path):
        if not files.exists(os.path.join(workdir, "checkpoints")):
            pretrained.check_exists(path, "train.init_checkpoint")
        path = workdir
    changed = checkpoint_model(model, path, overrides)
    if changed and tell:
        console.chief_print(
            f"The model of init_checkpoint {path}: "
            + ", ".join(f"{name}={value}" for name, value in changed.items())
            + " (the config's replaced)"
        )
    return changed


def check_tokenizer(config: ModelConfig, tokenizer: tokenization.Tokenizer) -> None:
    """Before a new run prepares data: a ModernBERT's padding id (`config`: the run's model)
    is its tokenizer's [PAD] (what an export's config.json names)."""
    family = families.of(config)
    if family.tokenizer_pad and family.pad_id(config) != tokenizer.pad_id:
        raise ConfigError(
            f"model.pad_token_id={family.pad_id(config)} but the tokenizer's "
            f"[PAD] is {tokenizer.pad_id}; set --config.model.pad_token_id="
            f"{tokenizer.pad_id}"
        )
