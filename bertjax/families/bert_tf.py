"""BERT's Google TF form (`families.TfForm`): Google BERT's TensorFlow checkpoints <-> bertjax
parameters, without TensorFlow.

`load_tf` / `save_tf` map Google's variable names one to one (`cls/` dropped, LayerNorm
`gamma`/`beta` -> `scale`/`bias`) and read/write `bert_config.json`; the checkpoint files
themselves (TensorFlow's tensor bundle) are `tf_bundle`'s.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from bertjax.interop import tf_bundle, tree
from bertjax.models import families
from bertjax.models.bert import model as bert_model
from bertjax.models.bert.model import BertConfig

CONFIG_FILE = "bert_config.json"


def tf_to_path(name: str) -> str:
    path = re.sub(r"LayerNorm/gamma$", "LayerNorm/scale", name.removeprefix("cls/"))
    return re.sub(r"LayerNorm/beta$", "LayerNorm/bias", path)


def path_to_tf(path: str) -> str:
    name = "cls/" + path if path.startswith(("predictions/", "seq_relationship/")) else path
    name = re.sub(r"LayerNorm/scale$", "LayerNorm/gamma", name)
    return re.sub(r"LayerNorm/bias$", "LayerNorm/beta", name)


def skip_reason(name: str) -> str | None:
    """Why a variable of a Google checkpoint is not a bertjax parameter (None: it is one)."""
    if name.endswith(("/adam_m", "/adam_v")):
        return "optimizer slot"
    if name == "global_step":
        return "training step counter"
    if not tf_to_path(name).startswith(("bert/", "predictions/", "seq_relationship/")):
        return "not a BertForPreTraining variable"
    return None


def load_tf(path: str, report: families.Report | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads a Google BERT TF checkpoint: a directory with `bert_config.json` and
    `bert_model.ckpt.*` (or a checkpoint prefix with `bert_config.json` beside it)."""
    report = report if report is not None else tree.LoadReport()
    try:
        prefix = tf_bundle.resolve_prefix(path)
        reader = tf_bundle.BundleReader(prefix)
        directory = os.path.dirname(prefix)
        config = BertConfig.from_dict(
            tree.read_json_config(os.path.join(directory, CONFIG_FILE), "Google")
        )
        report.source, report.format, report.found = path, "Google TF", len(reader.entries)
        tensors = {}
        for name in reader.entries:
            reason = skip_reason(name)
            if reason:
                report.skipped[name] = reason
            else:
                tensors[tf_to_path(name)] = reader.read(name)
    except tf_bundle.CheckpointFormatError as e:
        raise tree.ConversionError(str(e)) from None
    params = tree.collect(tensors, config, prefix, report)
    tree.check_vocab_file(directory, config)
    return config, params


def save_tf(config: BertConfig, params: dict[str, Any], path: str) -> None:
    """Writes a Google-style TF checkpoint directory: `bert_config.json`, `bert_model.ckpt.*`."""
    os.makedirs(path, exist_ok=True)
    tensors = {
        path_to_tf(p): np.asarray(v) for p, v in tree.flatten(tree.unstack_layers(params)).items()
    }
    tf_bundle.write_bundle(os.path.join(path, "bert_model.ckpt"), tensors)
    fields = (
        *bert_model.ARCHITECTURE_FIELDS,
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "initializer_range",
    )
    tree.write_json(
        os.path.join(path, CONFIG_FILE), {name: getattr(config, name) for name in fields}
    )


def read_config(directory: str) -> BertConfig:
    """The BertConfig of `bert_config.json` in `directory`."""
    config_file = os.path.join(directory, CONFIG_FILE)
    try:
        return BertConfig.from_dict(tree.read_json_config(config_file, "Google"))
    except ValueError as e:
        raise tree.ConversionError(f"{config_file}: {e}") from None


class BertTf(families.TfForm[BertConfig]):
    """`bert_config.json` and `bert_model.ckpt.*`."""

    config_file = CONFIG_FILE

    read = staticmethod(load_tf)
    config = staticmethod(read_config)
    write = staticmethod(save_tf)
