"""BERT's Hugging Face form (`families.HfForm`): `transformers` BERT checkpoints <-> bertjax
parameters (no torch needed for safetensors): Dense kernels are transposed ([out, in] in
PyTorch) and names mapped; the decoder weight tied to the word embeddings is checked, not
stored twice."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from bertjax.interop import hf, tree
from bertjax.models import families
from bertjax.models.bert import model as bert_model
from bertjax.models.bert.model import BertConfig

MODEL_TYPE = "bert"  # config.json's `model_type` of this form
# Hugging Face tensors that duplicate (tie) another one, and buffers that are not weights.
HF_TIED = {
    "cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
    "cls.predictions.decoder.bias": "cls.predictions.bias",
}
HF_BUFFERS = ("bert.embeddings.position_ids",)


def path_to_hf(path: str) -> tuple[str, bool]:
    """The Hugging Face name of a bertjax path, and whether the tensor is transposed."""
    special = {
        "predictions/output_bias": "cls.predictions.bias",
        "seq_relationship/output_weights": "cls.seq_relationship.weight",
        "seq_relationship/output_bias": "cls.seq_relationship.bias",
    }
    if path in special:
        return special[path], False
    name = re.sub(r"^(predictions|seq_relationship)/", r"cls/\1/", path)
    name = re.sub(r"encoder/layer_(\d+)/", r"encoder/layer/\1/", name)
    transpose = name.endswith("/kernel")
    name = re.sub(r"/(kernel|scale)$", "/weight", name)
    if name.endswith("_embeddings"):
        name += "/weight"
    return name.replace("/", "."), transpose


def hf_config(values: dict[str, Any], where: str) -> BertConfig:
    """The BertConfig of a transformers `config.json` (another family's: refused, naming it)."""
    model_type = values.get("model_type", MODEL_TYPE)
    if model_type != MODEL_TYPE:
        other = families.by_hf_type(model_type)
        if other.hf_form.model_type == model_type:
            raise tree.ConversionError(
                f"{where}: a {other.title} model, which its family's reader reads "
                "(pretrained.read chooses it by model_type)"
            )
        raise tree.ConversionError(f"{where}: model_type={model_type!r}; only BERT is supported")
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise tree.ConversionError(
            f"{where}: position_embedding_type="
            f"{values['position_embedding_type']!r}; only 'absolute' is BERT's"
        )
    if values.get("is_decoder") or values.get("add_cross_attention"):
        raise tree.ConversionError(f"{where}: decoder/cross-attention BERT is not supported")
    act = values.get("hidden_act", "gelu")
    if act not in hf.HF_ACTIVATIONS:
        raise tree.ConversionError(
            f"{where}: hidden_act={act!r}; supported: {sorted(hf.HF_ACTIVATIONS)}"
        )
    return BertConfig.from_dict({**values, "hidden_act": hf.HF_ACTIVATIONS[act]})


def load_hf(path: str, report: families.Report | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads a Hugging Face BERT directory (`config.json` + `model.safetensors`, sharded
    safetensors, or `pytorch_model.bin` when torch is installed). A directory without BERT's
    pretraining heads (a fine-tuned BertFor... class, or BertModel) gives its encoder only
    (`{"bert": ...}`), with a fresh pooler where it has none."""
    report = report if report is not None else tree.LoadReport()
    config = hf_config(
        tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face"), path
    )
    tensors = hf.read_tensors(path)
    if tensors and not any(k.startswith("bert.") for k in tensors):  # saved from BertModel
        tensors = {"bert." + k: v for k, v in tensors.items()}
    # Old checkpoints name LayerNorm parameters gamma/beta.
    tensors = {
        re.sub(
            r"LayerNorm\.beta$",
            "LayerNorm.bias",
            re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k),
        ): v
        for k, v in tensors.items()
    }
    report.source, report.format, report.found = path, "Hugging Face", len(tensors)
    encoder_only = not any(k.startswith("cls.") for k in tensors)  # fine-tuned, or BertModel
    by_hf_name = {path_to_hf(p)[0]: p for p in tree.param_shapes(config)}
    mapped = {}
    for name, value in tensors.items():
        if name in by_hf_name:
            path_, transpose = by_hf_name[name], path_to_hf(by_hf_name[name])[1]
            mapped[path_] = np.ascontiguousarray(value.T) if transpose else value
        elif name in HF_TIED:
            tied_to = tensors.get(HF_TIED[name])
            if tied_to is not None and not np.array_equal(value, tied_to):
                raise tree.ConversionError(
                    f"{path}: {name} differs from {HF_TIED[name]}; bertjax "
                    "ties them as the original BERT does, so it cannot hold "
                    "these weights"
                )
            report.skipped[name] = f"tied to {HF_TIED[name]}"
        elif name in HF_BUFFERS:
            report.skipped[name] = "buffer, not a weight"
        elif name.startswith(("bert.", "cls.")):
            mapped[name] = value  # reported by _collect as not fitting the config
        else:
            report.skipped[name] = (
                "a task's output layer, not carried over"
                if encoder_only
                else "not a BertForPreTraining weight"
            )
    if encoder_only and not any(p.startswith("bert/pooler/") for p in mapped):
        mapped.update(fresh_pooler(config))  # token classification, QA: no pooler
        report.skipped["bert.pooler"] = "not in the checkpoint: initialised fresh"
    params = tree.collect(mapped, config, path, report, encoder_only)
    tree.check_vocab_file(path, config)
    return config, params


def fresh_pooler(config: BertConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """BERT's pooler as initialised for training (normal(initializer_range) kernel, zero
    bias), for an encoder saved without one."""
    kernel = np.random.default_rng(seed).normal(
        0.0, config.initializer_range, (config.hidden_size, config.hidden_size)
    )
    return {
        "bert/pooler/dense/kernel": kernel.astype(np.float32),
        "bert/pooler/dense/bias": np.zeros(config.hidden_size, np.float32),
    }


def save_hf(
    config: BertConfig,
    params: dict[str, Any],
    path: str,
    head: families.TaskHead | None = None,
    pad_token_id: int = 0,
) -> int:
    """Writes `config.json` + `model.safetensors` that `transformers.BertForPreTraining
    .from_pretrained(path)` loads with no missing or unexpected weights (no torch needed);
    with `head` (a fine-tuned model's output layer), the class it names instead;
    `pad_token_id`: the tokenizer's [PAD]. Returns the number of parameters written."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, leaf in tree.flatten(tree.unstack_layers(params)).items():
        if head and (
            not p.startswith("bert/") or (p.startswith("bert/pooler/") and not head.pooler)
        ):
            continue  # the output layer comes from `head`; no pooler where the class has none
        name, transpose = path_to_hf(p)
        value = np.asarray(leaf)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    tensors.update(head.tensors if head else {})
    hf.write_safetensors(tensors, path)
    values = bert_model.architecture(config)
    values.update(
        hidden_act=hf.TO_HF_ACTIVATION[config.hidden_act],
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        initializer_range=config.initializer_range,
        model_type=MODEL_TYPE,
        architectures=[head.architecture if head else "BertForPreTraining"],
        tie_word_embeddings=head is None,
        pad_token_id=pad_token_id,
        **(head.config if head else {}),
    )
    tree.write_json(os.path.join(path, "config.json"), values)
    return sum(int(np.size(v)) for v in tensors.values())


class BertHf(families.HfForm[BertConfig]):
    """BertForPreTraining and the BertFor... task classes."""

    model_type = MODEL_TYPE
    class_prefix = "Bert"
    pretraining_class = "BertForPreTraining"
    pretraining_heads = "masked-LM and next-sentence heads"
    pretrained_classes = ("BertForPreTraining", "BertForMaskedLM", "BertModel")

    read = staticmethod(load_hf)
    config = staticmethod(hf_config)
    write = staticmethod(save_hf)

    def describe(self, config: BertConfig) -> str:
        return hf.TO_HF_ACTIVATION[config.hidden_act]
