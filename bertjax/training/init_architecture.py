"""The model of a pretraining run's `train.init_checkpoint`: the architecture read from the
checkpoint's config file (`architecture_of`), which the run's `model` section takes
(`checkpoint_model`, `model_of_init_checkpoint`), and the tokenizer checked to fit it
(`check_tokenizer`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from bertjax.data import tokenization
from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.interop import native, pretrained, pretrained_weights, tree
from bertjax.interop.pretrained import PretrainedError
from bertjax.interop.tree import ConversionError
from bertjax.models import families
from bertjax.models.bert.model import BertConfig
from bertjax.runtime import files
from bertjax.training import reporting


def architecture_of(path: str) -> families.ModelConfig:
    """The model config of the checkpoint at `path` (any format; local or a URL), from its
    config file alone: a Hugging Face `config.json`, Google's `bert_config.json`, a bertjax
    run's recorded config. No weights are read."""
    source_format = pretrained.detect_format(path)
    if source_format == "bertjax":
        return native.config_of(native.checkpoint_dir(path))
    if source_format == "hf":
        values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
        return families.by_hf_type(values.get("model_type", "")).hf_form.config(values, path)
    directory = path if files.isdir(path) else os.path.dirname(path)
    config_file = os.path.join(directory, "bert_config.json")
    try:
        return BertConfig.from_dict(tree.read_json_config(config_file, "Google"))
    except ValueError as e:
        raise ConversionError(f"{config_file}: {e}") from None


def checkpoint_model(
    model: Mapping[str, Any], path: str, explicit: Collection[str] = ()
) -> dict[str, Any]:
    """The fields of a pretraining config's `model` section (`model`: its values) that the
    checkpoint at `path` changes: its architecture, as `from_pretrained` takes it, and a
    ModernBERT's padding id unless `explicit` names it. A field that `explicit` (the dotted
    names set on the command line) sets to another value than the checkpoint's, or a
    checkpoint of another family, is refused in one line before any data work."""
    try:
        found = architecture_of(path)
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
        values["pad_token_id"] = getattr(
            found, "pad_token_id", None
        )  # (checked against the tokenizer's [PAD])
    return {name: value for name, value in values.items() if model[name] != value}


def model_of_init_checkpoint(
    model: Mapping[str, Any], init_checkpoint: str, workdir: str, overrides: Collection[str]
) -> dict[str, Any]:
    """The fields of the `model` section that the architecture of `init_checkpoint` changes
    (`checkpoint_model`; none without one), told in a line. A resumed run (in `workdir`)
    whose init_checkpoint has gone since takes its own checkpoints' architecture."""
    path = init_checkpoint
    if not path:
        return {}
    if not (files.exists(path) or files.exists(path + ".index")):
        if not files.exists(os.path.join(workdir, "checkpoints")):
            pretrained.check_exists(path, "train.init_checkpoint")
        path = workdir
    changed = checkpoint_model(model, path, overrides)
    if changed:
        reporting.chief_print(
            f"The model of init_checkpoint {path}: "
            + ", ".join(f"{name}={value}" for name, value in changed.items())
            + " (the config's replaced)"
        )
    return changed


def check_tokenizer(
    init_checkpoint: str,
    data: DataSettings,
    model: Mapping[str, Any],
    tokenizer: tokenization.Tokenizer,
) -> None:
    """Before a new run prepares data: the tokenizer is the init_checkpoint's
    (`pretrained.check_run_tokenizer`), and a ModernBERT's padding id (`model`: the `model`
    section's values) is its [PAD] (what an export's config.json names)."""
    if init_checkpoint:
        pretrained.check_run_tokenizer(
            init_checkpoint, data, tokenizer.vocab_size, model["vocab_size"]
        )
    if (
        families.get(families.family(model)).tokenizer_pad
        and model["pad_token_id"] != tokenizer.pad_id
    ):
        raise ConfigError(
            f"model.pad_token_id={model['pad_token_id']} but the tokenizer's "
            f"[PAD] is {tokenizer.pad_id}; set --config.model.pad_token_id="
            f"{tokenizer.pad_id}"
        )
