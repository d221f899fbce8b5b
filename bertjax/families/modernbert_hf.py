"""ModernBERT's Hugging Face form (`families.HfForm`): `transformers` ModernBERT directories
<-> bertjax ModernBERT parameters (no torch needed for safetensors), parallel to `bert_hf`: names mapped, Linear weights
transposed ([out, in] in PyTorch), the fused Wqkv / Wi weights split into their parts
(`bertjax.models.modernbert.model._SplitDense`), the decoder weight tied to the token embeddings checked,
not stored twice."""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from bertjax.interop import hf, tree
from bertjax.models import families
from bertjax.models.modernbert import model as modernbert
from bertjax.models.modernbert.config import ModernBertConfig

HF_TIED = {"decoder.weight": "model.embeddings.tok_embeddings.weight"}
FINETUNED_CLASSES = (
    "ModernBertForSequenceClassification",
    "ModernBertForTokenClassification",
    "ModernBertForQuestionAnswering",
    "ModernBertForMultipleChoice",
)
ROPE_TYPES = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}

MODEL_TYPE = "modernbert"  # config.json's `model_type` of this form


def path_to_hf(path: str) -> tuple[str, str]:
    """The transformers name of a bertjax ModernBERT path, and how the tensor converts:
    "copy", "linear" (transposed) or "split" (a `[H, parts, F]` kernel or `[parts, F]` bias
    of transformers' fused `[parts * F, H]` weight or `[parts * F]` bias)."""
    name = re.sub(r"/layer_(\d+)/", r"/layers/\1/", path)
    kind = (
        "split"
        if re.search(r"/(Wqkv|Wi)/", name)
        else "linear"
        if name.endswith("/kernel")
        else "copy"
    )
    name = re.sub(r"/(kernel|scale)$", "/weight", name)
    if name.endswith("/tok_embeddings"):
        name += "/weight"
    return name.replace("/", "."), kind


def to_hf(value: np.ndarray, kind: str) -> np.ndarray:
    """A bertjax tensor in transformers' layout (see `path_to_hf`)."""
    if kind == "split":
        value = value.reshape(value.shape[0], -1).T if value.ndim == 3 else value.reshape(-1)
    elif kind == "linear":
        value = value.T
    return np.ascontiguousarray(value)


def from_hf(value: np.ndarray, kind: str, shape: tuple[int, ...]) -> np.ndarray:
    """A transformers tensor in bertjax's layout `shape` (the inverse of `to_hf`); a tensor
    whose size does not fit is returned as it is, for `tree.collect` to report."""
    if kind == "linear" and value.ndim == 2:
        value = value.T
    elif kind == "split" and value.size == int(np.prod(shape)):
        value = value.T.reshape(shape) if value.ndim == 2 else value.reshape(shape)
    return np.ascontiguousarray(value)


def param_shapes(config: ModernBertConfig) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of ModernBertForMaskedLM's parameters for `config`."""
    model = modernbert.ModernBertForMaskedLM(config)
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), *modernbert.example_inputs())["params"]
    )
    return {path: x.shape for path, x in tree.flatten(nn.meta.unbox(params)).items()}


def global_every(layer_types: list[str], where: str) -> int:
    """transformers' `layer_types` as bertjax's `global_attn_every_n_layers` n (layer i global
    when i % n == 0), refusing any other pattern."""
    for n in range(1, len(layer_types) + 1):
        if layer_types == [
            "sliding_attention" if i % n else "full_attention" for i in range(len(layer_types))
        ]:
            return n
    raise tree.ConversionError(
        f"{where}: layer_types={layer_types} is not a global layer every "
        "n layers from layer 0, the only pattern bertjax supports"
    )


def hf_config(values: dict[str, Any], where: str) -> ModernBertConfig:
    """The ModernBertConfig of a transformers `config.json` (v5's `layer_types` and
    `rope_parameters`, or v4's `global_attn_every_n_layers` and rope thetas)."""
    if values.get("model_type") != MODEL_TYPE:
        raise tree.ConversionError(
            f"{where}: model_type={values.get('model_type')!r}; expected {MODEL_TYPE!r}"
        )
    values = dict(values)
    if values.get("layer_types"):
        values["global_attn_every_n_layers"] = global_every(values["layer_types"], where)
    for layer_type, field in ROPE_TYPES.items():
        rope = (values.get("rope_parameters") or {}).get(layer_type) or {}
        if rope.get("rope_type", "default") != "default":
            raise tree.ConversionError(
                f"{where}: rope_parameters.{layer_type}.rope_type="
                f"{rope['rope_type']!r}; only 'default' RoPE is supported"
            )
        if "rope_theta" in rope:
            values[field] = rope["rope_theta"]
    for field in ("hidden_activation", "classifier_activation"):
        act = values.get(field, "gelu")
        if act not in hf.HF_ACTIVATIONS:
            raise tree.ConversionError(
                f"{where}: {field}={act!r}; supported: {sorted(hf.HF_ACTIVATIONS)}"
            )
        values[field] = hf.HF_ACTIVATIONS[act]
    if values.get("pad_token_id") is None:
        values.pop("pad_token_id", None)
    try:
        return ModernBertConfig.from_dict(values)
    except ValueError as e:
        raise tree.ConversionError(f"{where}: {e}") from None


def load_hf(  # noqa: C901, PLR0912 (each checkpoint form and class in turn)
    path: str, report: families.Report | None = None
) -> tuple[ModernBertConfig, dict[str, Any]]:
    """Reads a transformers ModernBERT directory (`config.json` + `model.safetensors`, sharded
    safetensors, or `pytorch_model.bin` with torch): ModernBertForMaskedLM's parameters; of a
    fine-tuned `ModernBertFor...` class, its encoder and prediction head (`model`, `head`:
    what a fine-tuning run takes), its output layer skipped; of a bare ModernBertModel (no
    prediction head), its encoder (`model`) alone."""
    report = report if report is not None else tree.LoadReport()
    values = tree.read_json_config(os.path.join(path, "config.json"), "Hugging Face")
    config = hf_config(values, path)
    tensors = hf.read_tensors(path)
    report.source, report.format, report.found = path, "Hugging Face ModernBERT", len(tensors)
    shapes = param_shapes(config)
    if (values.get("architectures") or [""])[0] in FINETUNED_CLASSES:
        shapes = {p: shape for p, shape in shapes.items() if not p.startswith("decoder/")}
    if tensors and not any(name.startswith("model.") for name in tensors):  # ModernBertModel
        tensors = {f"model.{name}": value for name, value in tensors.items()}
        shapes = {p: shape for p, shape in shapes.items() if p.startswith("model/")}
    by_hf_name = {path_to_hf(p)[0]: p for p in shapes}
    mapped = {}
    for name, value in tensors.items():
        if name in by_hf_name:
            bertjax_path = by_hf_name[name]
            mapped[bertjax_path] = from_hf(value, path_to_hf(bertjax_path)[1], shapes[bertjax_path])
        elif name in HF_TIED:
            tied_to = tensors.get(HF_TIED[name])
            if tied_to is not None and not np.array_equal(value, tied_to):
                raise tree.ConversionError(
                    f"{path}: {name} differs from {HF_TIED[name]}; "
                    "bertjax ties them, so it cannot hold these weights"
                )
            report.skipped[name] = f"tied to {HF_TIED[name]}"
        elif name.startswith(("model.", "head.", "decoder.")):
            mapped[name] = value  # reported by _collect as not fitting the config
        elif name.startswith("classifier.") and not any(p.startswith("decoder/") for p in shapes):
            report.skipped[name] = "a task's output layer, not carried over"
        else:
            report.skipped[name] = "not a ModernBertForMaskedLM weight"
    missing = sorted(set(shapes) - set(mapped))
    if missing:
        raise tree.ConversionError(
            f"{path}: no {tree.few(missing)}: bertjax reads a "
            "ModernBertForMaskedLM directory (the encoder and its MLM head)"
        )
    unknown = sorted(set(mapped) - set(shapes))
    if unknown:
        raise tree.ConversionError(
            f"{path}: the weights do not match its config: not in a model "
            f"of that config: {tree.few(unknown)}"
        )
    for name, shape in shapes.items():
        if mapped[name].shape != shape:
            raise tree.ConversionError(
                f"{path}: weight {path_to_hf(name)[0]} does not fit the "
                f"config: bertjax needs {shape}, got {mapped[name].shape}"
            )
    report.mapped = len(mapped)
    return config, tree.unflatten(mapped)


def save_hf(
    config: ModernBertConfig,
    params: dict[str, Any],
    path: str,
    head: families.TaskHead | None = None,
) -> int:
    """Writes `config.json` + `model.safetensors` that `transformers.AutoModelForMaskedLM
    .from_pretrained(path)` loads as a ModernBertForMaskedLM with no missing or unexpected
    weights (no torch needed); with `head` (a fine-tuned model: `model`, `head` and
    `classifier` parameters), the `ModernBertFor...` class it names, with its label maps. The
    special tokens' ids are left to the tokenizer's files. Returns the number of parameters
    written."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, value in tree.flatten(params).items():
        name, kind = path_to_hf(p)
        tensors[name] = to_hf(np.asarray(value), kind)
    hf.write_safetensors(tensors, path)
    values = {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if k not in ("dtype", "param_dtype", "remat_policy", "attention_impl")
    }
    values.update(
        hidden_activation=hf.TO_HF_ACTIVATION[config.hidden_activation],
        classifier_activation=hf.TO_HF_ACTIVATION[config.classifier_activation],
        layer_types=[
            "full_attention" if config.is_global(i) else "sliding_attention"
            for i in range(config.num_hidden_layers)
        ],
        rope_parameters={
            layer_type: {"rope_type": "default", "rope_theta": getattr(config, field)}
            for layer_type, field in ROPE_TYPES.items()
        },
        model_type=MODEL_TYPE,
        architectures=[head.architecture if head else "ModernBertForMaskedLM"],
        tie_word_embeddings=head is None,
        **(head.config if head else {}),
        # Not transformers' defaults (ModernBERT-base's ids, outside a smaller vocabulary):
        # the tokenizer written beside the weights names its special tokens.
        bos_token_id=None,
        eos_token_id=None,
        cls_token_id=None,
        sep_token_id=None,
    )
    tree.write_json(os.path.join(path, "config.json"), values)
    return sum(int(np.size(v)) for v in tensors.values())


class ModernBertHf(families.HfForm[ModernBertConfig]):
    """ModernBertForMaskedLM and the ModernBertFor... task classes."""

    model_type = MODEL_TYPE
    class_prefix = "ModernBert"
    pretraining_class = "ModernBertForMaskedLM"
    pretraining_heads = "masked-LM head"
    pretrained_classes = ("ModernBertForMaskedLM", "ModernBertModel")
    output_layer_names = False
    sequence_pooler = False

    read = staticmethod(load_hf)
    config = staticmethod(hf_config)

    def write(
        self,
        config: ModernBertConfig,
        params: dict[str, Any],
        path: str,
        head: families.TaskHead | None = None,
        pad_token_id: int = 0,
    ) -> int:
        del pad_token_id  # (its config's own)
        return save_hf(config, params, path, head)

    def describe(self, config: ModernBertConfig) -> str:
        return (
            f"GeGLU ({hf.TO_HF_ACTIVATION[config.hidden_activation]}), global attention every "
            f"{config.global_attn_every_n_layers} layers, sliding windows of "
            f"{config.local_attention} tokens between"
        )
