"""Hugging Face `transformers` directories, whatever the family (no torch needed for
safetensors): the weight files read and written, activations' names, what a directory was
fine-tuned for, the model card. Each family's own form (names, config.json) is its `HfForm`
(`bertjax.families.bert_hf`, `.modernbert_hf`)."""

from __future__ import annotations

import os

import numpy as np

from bertjax.interop import tree
from bertjax.interop.finetuned import HFHead
from bertjax.models import families
from bertjax.runtime import files

HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


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
    except Exception as e:  # noqa: BLE001 (torch raises several types for damaged files)
        raise tree.ConversionError(f"cannot read {bin_path}: {e}") from None
    # numpy has no bfloat16: such tensors are widened to float32.
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in state.items()}


def finetuned_task(path: str) -> str:
    """What the Hugging Face model at `path` was fine-tuned for (its transformers class and
    labels), or "" for a pretrained model (a class of a family's `pretrained_classes`)."""
    values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
    architecture = (values.get("architectures") or [""])[0]
    if architecture in (
        "",
        *(name for form in families.hf_forms() for name in form.pretrained_classes),
    ):
        return ""
    labels = list((values.get("id2label") or {}).values())
    return architecture + (
        f" (labels {', '.join(map(str, labels))})"
        if not architecture.endswith("ForQuestionAnswering") and labels
        else ""
    )


def write_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
    """`model.safetensors` in the directory `path`, with an ordinary file's mode."""
    from safetensors.numpy import save_file

    weights = os.path.join(path, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights, 0o666 & ~umask)  # safetensors writes 0600: give it an ordinary file's mode


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
