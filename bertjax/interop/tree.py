"""Parameter trees as the checkpoint formats see them: flat `/` paths with Google's names
(`bert/encoder/layer_0/...`, `predictions/...`, `seq_relationship/...`), unrolled or stacked
(scanned) layers, shape checks against a config, and what a loader reports."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import traverse_util

from bertjax.errors import UserError
from bertjax.models import families
from bertjax.runtime import files

LAYER_PATH = re.compile(r"^bert/encoder/layer_(\d+)/(.*)$")


class ConversionError(UserError, ValueError):
    """A checkpoint that cannot be read or does not fit; the message names file and fix."""


@dataclasses.dataclass
class LoadReport:
    """What a loader found in the source and what it did with it (the CLI prints it)."""

    source: str = ""
    format: str = ""
    found: int = 0
    mapped: int = 0
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"{self.source}: {self.format} checkpoint, {self.found} tensors; "
            f"{self.mapped} mapped to bertjax parameters, {len(self.skipped)} skipped"
        ]
        reasons: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            reasons.setdefault(reason, []).append(name)
        for reason, names in sorted(reasons.items()):
            lines.append(f"  skipped ({reason}): {few(names)}")
        return "\n".join(lines)


def abstract_params(config: families.ModelConfig) -> Any:
    """ShapeDtypeStructs of the pretraining model's parameters (BertForPreTraining's), in
    `config`'s layer layout."""
    return families.abstract_params(families.pretraining_model(config))


def param_shapes(config: families.ModelConfig) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of the pretraining model's parameters, unrolled layers."""
    tree = abstract_params(families.with_layout(config, False))
    return {path: x.shape for path, x in flatten(tree).items()}


def flatten(params: Mapping[str, Any]) -> dict[str, Any]:
    return traverse_util.flatten_dict(params, sep="/")


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    return traverse_util.unflatten_dict(flat, sep="/")


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Unrolled `encoder/layer_{i}/...` -> scanned `encoder/layers/...` (leading layer axis)."""
    flat: dict[str, Any] = {}
    per_layer: dict[str, dict[int, Any]] = {}
    for path, value in flatten(params).items():
        match = LAYER_PATH.match(path)
        if match:
            per_layer.setdefault(match.group(2), {})[int(match.group(1))] = value
        else:
            flat[path] = value
    for rest, layers in per_layer.items():
        flat[f"bert/encoder/layers/{rest}"] = np.stack([layers[i] for i in range(len(layers))])
    return unflatten(flat)


def unstack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Scanned `encoder/layers/...` -> unrolled `encoder/layer_{i}/...` (unrolled: unchanged)."""
    flat = {}
    for path, value in flatten(params).items():
        if path.startswith("bert/encoder/layers/"):
            rest = path[len("bert/encoder/layers/") :]
            for i, layer_value in enumerate(np.asarray(value)):
                flat[f"bert/encoder/layer_{i}/{rest}"] = layer_value
        else:
            flat[path] = value
    return unflatten(flat)


def collect(
    tensors: dict[str, np.ndarray],
    config: families.ModelConfig,
    where: str,
    report: families.Report,
    encoder_only: bool = False,
) -> dict[str, Any]:
    """Checks mapped tensors against the shapes `config` implies (for `encoder_only`, those of
    the encoder, `bert/...`); returns the param tree."""
    encoder = families.of(config).encoder_scope + "/"
    expected = {
        path: shape
        for path, shape in param_shapes(config).items()
        if not encoder_only or path.startswith(encoder)
    }
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if missing or unknown:
        raise ConversionError(
            f"{where}: the weights do not match its config ({describe(config)}): "
            + (f"missing {few(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"not in a model of that config: {few(unknown)}" if unknown else "")
        )
    for path, shape in expected.items():
        if tensors[path].shape != shape:
            raise ConversionError(
                f"{where}: weight {path} has shape {tensors[path].shape}, but "
                f"the config ({describe(config)}) implies {shape}"
            )
    report.mapped = len(tensors)
    return unflatten(tensors)


def describe(config: families.ModelConfig) -> str:
    """The config's first five architecture fields, `name=value`."""
    return ", ".join(f"{f}={v}" for f, v in list(families.architecture(config).items())[:5])


def few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def check_vocab_file(directory: str, config: families.ModelConfig) -> None:
    """A `vocab.txt` next to a checkpoint must have one line per embedding row."""
    path = os.path.join(directory, "vocab.txt")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        lines = f.read().count(b"\n")
    if lines != config.vocab_size:
        raise ConversionError(
            f"{path} has {lines} tokens but the checkpoint's vocab_size is "
            f"{config.vocab_size}: the vocab does not belong to these weights"
        )


def read_json_config(path: str, what: str) -> dict[str, Any]:
    """A checkpoint's JSON config (`bert_config.json`, `config.json`, a shard index)."""
    if not files.isfile(path):
        raise ConversionError(
            f"{path} not found: a {what} checkpoint needs its config next to the weights"
        )
    try:
        with files.open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


def write_json(path: str, values: dict[str, Any]) -> None:
    with files.open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
