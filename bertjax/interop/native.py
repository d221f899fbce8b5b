"""bertjax's own checkpoints (Orbax, through `bertjax.checkpoint`) as host parameters: a
pretraining workdir or its `checkpoints/` folder, or a params-only checkpoint written by
`save_bertjax` (what `python -m bertjax.convert` writes for `train.init_checkpoint`)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from bertjax import checkpoint, files
from bertjax.interop import tree
from bertjax.model import BertConfig


def checkpoint_dir(path: str) -> str:
    """A workdir holds its checkpoints in `checkpoints/`; accept both."""
    inner = os.path.join(path, "checkpoints")
    return inner if files.isdir(inner) else path


def config_of(directory: str) -> BertConfig:
    """The model config a checkpoint directory recorded (a run's full model config, else the
    architecture of a params-only checkpoint)."""
    meta = checkpoint.read_meta(directory)
    if "config" in meta:  # a training run: the full model config
        return BertConfig.from_dict(json.loads(meta["config"])["model"])
    return BertConfig.from_dict(meta["model"])


def load_bertjax(path: str, report: tree.LoadReport | None = None
                 ) -> tuple[BertConfig, dict[str, Any]]:
    """Reads the parameters of the latest bertjax checkpoint in a checkpoint directory or
    workdir onto the host (numpy), with unrolled layers."""
    report = report if report is not None else tree.LoadReport()
    directory = checkpoint_dir(path)
    config = config_of(directory)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
                            tree.abstract_params(config))
    restored = checkpoint.restore_params(directory, abstract)
    params = tree.unstack_layers(jax.tree.map(np.asarray, restored))
    report.source, report.format = path, "bertjax"
    report.found = report.mapped = len(tree.flatten(params))
    return dataclasses.replace(config, scan_layers=False), params


def save_bertjax(config: BertConfig, params: dict[str, Any], path: str) -> None:
    """Writes a params-only bertjax checkpoint that `train.init_checkpoint` (and
    `pretrained.load_pretrained`) reads, in the layer layout of `config.scan_layers`."""
    params = tree.unstack_layers(params)
    if config.scan_layers:
        params = tree.stack_layers(params)
    checkpoint.save_params(path, params, {"model": dataclasses.asdict(config)})
