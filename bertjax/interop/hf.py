"""Hugging Face `transformers` BERT checkpoints <-> bertjax parameters (no torch needed for
safetensors): Dense kernels are transposed ([out, in] in PyTorch) and names mapped; the
decoder weight tied to the word embeddings is checked, not stored twice."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from bertjax.interop import tree
from bertjax.interop.finetuned import HFHead
from bertjax.models import families
from bertjax.models.bert import model as bert_model
from bertjax.models.bert.model import BertConfig
from bertjax.runtime import files

MODEL_TYPE = "bert"  # config.json's `model_type` of this form
HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
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
    if act not in HF_ACTIVATIONS:
        raise tree.ConversionError(
            f"{where}: hidden_act={act!r}; supported: {sorted(HF_ACTIVATIONS)}"
        )
    return BertConfig.from_dict({**values, "hidden_act": HF_ACTIVATIONS[act]})


def weight_files(directory: str) -> list[str]:
    """The files a HF model directory's weights are read from (local or a URL):
    `model.safetensors`, else the shard index and its shards, else `pytorch_model.bin`."""
    if files.isfile(os.path.join(directory, "model.safetensors")):
        return ["model.safetensors"]
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if files.isfile(index_path):
        shards = tree.read_json_config(index_path, "sharded")["weight_map"].values()
        return ["model.safetensors.index.json", *sorted(set(shards))]
    if files.isfile(os.path.join(directory, "pytorch_model.bin")):
        return ["pytorch_model.bin"]
    raise tree.ConversionError(
        f"{directory}: no Hugging Face weights ({', '.join(HF_WEIGHT_FILES)})"
    )


def read_tensors(directory: str) -> dict[str, np.ndarray]:
    """All tensors of a local HF model directory: safetensors (single or sharded) or, with
    torch, `pytorch_model.bin`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    def load(name: str) -> dict[str, np.ndarray]:
        path = os.path.join(directory, name)
        try:
            return load_file(path)
        except (SafetensorError, OSError) as e:
            raise tree.ConversionError(
                f"cannot read {path} ({e}): the file is missing, truncated or "
                "not safetensors; download it again"
            ) from None

    names = weight_files(directory)
    if names != ["pytorch_model.bin"]:
        return {
            k: v for name in names if name.endswith(".safetensors") for k, v in load(name).items()
        }
    bin_path = os.path.join(directory, "pytorch_model.bin")
    try:
        import torch
    except ImportError:
        raise tree.ConversionError(
            f"{bin_path} needs PyTorch to read (pip install torch==2.13.0), "
            "or convert it to model.safetensors"
        ) from None
    try:
        state = torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for damaged files
        raise tree.ConversionError(f"cannot read {bin_path}: {e}") from None
    # numpy has no bfloat16: such tensors are widened to float32.
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in state.items()}


def load_hf(path: str, report: tree.LoadReport | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads a Hugging Face BERT directory (`config.json` + `model.safetensors`, sharded
    safetensors, or `pytorch_model.bin` when torch is installed). A directory without BERT's
    pretraining heads (a fine-tuned BertFor... class, or BertModel) gives its encoder only
    (`{"bert": ...}`), with a fresh pooler where it has none."""
    report = report if report is not None else tree.LoadReport()
    config = hf_config(
        tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face"), path
    )
    tensors = read_tensors(path)
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


def finetuned_task(path: str) -> str:
    """What the Hugging Face model at `path` was fine-tuned for (its transformers class and
    labels), or "" for a pretrained model (BertForPreTraining, BertForMaskedLM, BertModel)."""
    values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
    architecture = (values.get("architectures") or [""])[0]
    if architecture in (
        "",
        "BertForPreTraining",
        "BertForMaskedLM",
        "BertModel",
        "ModernBertForMaskedLM",
        "ModernBertModel",
    ):
        return ""
    labels = list((values.get("id2label") or {}).values())
    return architecture + (
        f" (labels {', '.join(map(str, labels))})"
        if architecture != "BertForQuestionAnswering" and labels
        else ""
    )


def save_hf(
    config: BertConfig,
    params: dict[str, Any],
    path: str,
    head: HFHead | None = None,
    pad_token_id: int = 0,
) -> int:
    """Writes `config.json` + `model.safetensors` that `transformers.BertForPreTraining
    .from_pretrained(path)` loads with no missing or unexpected weights (no torch needed);
    with `head` (a fine-tuned model's output layer), the class it names instead;
    `pad_token_id`: the tokenizer's [PAD]. Returns the number of parameters written."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, value in tree.flatten(tree.unstack_layers(params)).items():
        if head and (
            not p.startswith("bert/") or (p.startswith("bert/pooler/") and not head.pooler)
        ):
            continue  # the output layer comes from `head`; no pooler where the class has none
        name, transpose = path_to_hf(p)
        value = np.asarray(value)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    tensors.update(head.tensors if head else {})
    weights = os.path.join(path, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors writes 0600: give it an ordinary file's mode
    values = bert_model.architecture(config)
    values.update(
        hidden_act=TO_HF_ACTIVATION[config.hidden_act],
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


def write_model_card(
    path: str,
    config: families.ModelConfig,
    num_params: int,
    facts: list[tuple[str, str]],
    head: HFHead | None = None,
    name: str = "",
) -> None:
    """`README.md`: the architecture (as the family describes it: `families.HfForm`), `facts`
    (tokenizer, data, steps, metrics, ...) and how to load the directory with transformers."""
    own = families.of(config)
    family = own.title
    rows = [
        (
            "architecture",
            f"{family}, {config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, feed-forward "
            f"{config.intermediate_size}, vocabulary {config.vocab_size}, "
            f"{config.max_position_embeddings} positions, " + own.hf_form.describe(config),
        ),
        ("parameters", f"{num_params:,}"),
        *facts,
    ]
    name = name or os.path.basename(os.path.normpath(path))  # what from_pretrained is given
    architecture = head.architecture if head else own.hf_form.pretraining_class
    what = head.description if head else own.hf_form.pretraining_heads
    text = "\n".join(
        [
            "---",
            "library_name: transformers",
            f"tags: [{family.lower()}, bertjax]",
            "---",
            f"# {name}",
            "",
            f"A {family} model ({what}) written by bertjax.",
            "",
            "| | |",
            "|---|---|",
            *[f"| {key} | {value} |" for key, value in rows],
            "",
            "```python",
            f"from transformers import AutoTokenizer, {architecture}",
            f'tokenizer = AutoTokenizer.from_pretrained("{name}")',
            f'model = {architecture}.from_pretrained("{name}")',
            "```",
            "",
        ]
    )
    with open(os.path.join(path, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)
