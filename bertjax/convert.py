"""Checkpoint interop: Google TF checkpoints, Hugging Face checkpoints and bertjax (Orbax)
checkpoints to and from bertjax parameters.

    python -m bertjax.convert uncased_L-12_H-768_A-12 bert_base_bertjax      # TF -> bertjax
    python -m bertjax.convert bert_base_bertjax bert_base_hf                 # bertjax -> HF
    python -m bertjax.convert hf_dir out.ckpt --to=tf                        # HF -> TF

Parameters are nested dicts of numpy arrays with Google's names (`bert/encoder/layer_0/...`,
`predictions/...`, `seq_relationship/...`; LayerNorm `scale`/`bias`), unrolled layers; a
scanned model's stacked `encoder/layers` is converted with `stack_layers`/`unstack_layers`.
Google's names map one to one (`cls/` dropped, `gamma`/`beta` -> `scale`/`bias`), Hugging
Face's by renaming and transposing Dense kernels ([out, in] in PyTorch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from bertjax import checkpoint
from bertjax.interop import tf as tf_checkpoint
from bertjax.model import BertConfig, BertForPreTraining

FORMATS = ("tf", "hf", "bertjax")
# Fields that change what the weights compute; a checkpoint and a run must agree on them.
ARCHITECTURE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size", "hidden_act", "max_position_embeddings",
                       "type_vocab_size", "layer_norm_eps")
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                  "relu": "relu"}
TO_HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Hugging Face tensors that duplicate (tie) another one, and buffers that are not weights.
HF_TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
           "cls.predictions.decoder.bias": "cls.predictions.bias"}
HF_BUFFERS = ("bert.embeddings.position_ids",)
LAYER_PATH = re.compile(r"^bert/encoder/layer_(\d+)/(.*)$")


class ConversionError(ValueError):
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
        lines = [f"{self.source}: {self.format} checkpoint, {self.found} tensors; "
                 f"{self.mapped} mapped to bertjax parameters, {len(self.skipped)} skipped"]
        reasons: dict[str, list[str]] = {}
        for name, reason in self.skipped.items():
            reasons.setdefault(reason, []).append(name)
        for reason, names in sorted(reasons.items()):
            lines.append(f"  skipped ({reason}): {_few(names)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# Parameter trees.


def abstract_params(config: BertConfig) -> Any:
    """ShapeDtypeStructs of BertForPreTraining's parameters, in `config`'s layer layout."""
    model = BertForPreTraining(config)
    ids = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(
        lambda: nn.meta.unbox(model.init(jax.random.PRNGKey(0), ids, ids, ids, ids)["params"]))


def param_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """`{path: shape}` of BertForPreTraining's parameters, unrolled layers."""
    tree = abstract_params(dataclasses.replace(config, scan_layers=False))
    return {path: x.shape for path, x in flatten(tree).items()}


def flatten(params: Any) -> dict[str, Any]:
    return traverse_util.flatten_dict(params, sep="/")


def unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    return traverse_util.unflatten_dict(flat, sep="/")


def stack_layers(params: dict[str, Any]) -> dict[str, Any]:
    """Unrolled `encoder/layer_{i}/...` -> scanned `encoder/layers/...` (leading layer axis)."""
    flat, per_layer = {}, {}
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
            rest = path[len("bert/encoder/layers/"):]
            for i, layer_value in enumerate(np.asarray(value)):
                flat[f"bert/encoder/layer_{i}/{rest}"] = layer_value
        else:
            flat[path] = value
    return unflatten(flat)


def _is_model_name(path: str) -> bool:
    """Whether a (bertjax-style) path belongs to BERT itself, so a stray one is an error."""
    return path.startswith(("bert/", "predictions/", "seq_relationship/"))


def _collect(tensors: dict[str, np.ndarray], config: BertConfig, where: str,
             report: LoadReport) -> dict[str, Any]:
    """Checks mapped tensors against the shapes `config` implies; returns the param tree."""
    expected = param_shapes(config)
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if missing or unknown:
        raise ConversionError(
            f"{where}: the weights do not match its config ({_describe(config)}): "
            + (f"missing {_few(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"not in a model of that config: {_few(unknown)}" if unknown else ""))
    for path, shape in expected.items():
        if tensors[path].shape != shape:
            raise ConversionError(f"{where}: weight {path} has shape {tensors[path].shape}, but "
                                  f"the config ({_describe(config)}) implies {shape}")
    report.mapped = len(tensors)
    return unflatten(tensors)


def _describe(config: BertConfig) -> str:
    return ", ".join(f"{f}={getattr(config, f)}" for f in ARCHITECTURE_FIELDS[:5])


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


def check_vocab_file(directory: str, config: BertConfig) -> None:
    """A `vocab.txt` next to a checkpoint must have one line per embedding row."""
    path = os.path.join(directory, "vocab.txt")
    if not os.path.isfile(path):
        return
    with open(path, "rb") as f:
        lines = f.read().count(b"\n")
    if lines != config.vocab_size:
        raise ConversionError(f"{path} has {lines} tokens but the checkpoint's vocab_size is "
                              f"{config.vocab_size}: the vocab does not belong to these weights")


# ---------------------------------------------------------------------------
# Google TF checkpoints.


def _tf_to_path(name: str) -> str:
    path = re.sub(r"LayerNorm/gamma$", "LayerNorm/scale", name.removeprefix("cls/"))
    return re.sub(r"LayerNorm/beta$", "LayerNorm/bias", path)


def _path_to_tf(path: str) -> str:
    name = "cls/" + path if path.startswith(("predictions/", "seq_relationship/")) else path
    name = re.sub(r"LayerNorm/scale$", "LayerNorm/gamma", name)
    return re.sub(r"LayerNorm/bias$", "LayerNorm/beta", name)


def _tf_skip_reason(name: str) -> str | None:
    if name.endswith(("/adam_m", "/adam_v")):
        return "optimizer slot"
    if name == "global_step":
        return "training step counter"
    if not _is_model_name(_tf_to_path(name)):
        return "not a BertForPreTraining variable"
    return None


def _read_config(path: str, what: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConversionError(f"{path} not found: a {what} checkpoint needs its config next to "
                              "the weights")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, OSError) as e:
        raise ConversionError(f"cannot read {path}: {e}") from None


def load_tf(path: str, report: LoadReport | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads a Google BERT TF checkpoint: a directory with `bert_config.json` and
    `bert_model.ckpt.*` (or a checkpoint prefix with `bert_config.json` beside it)."""
    report = report if report is not None else LoadReport()
    try:
        prefix = tf_checkpoint.resolve_prefix(path)
        reader = tf_checkpoint.BundleReader(prefix)
        directory = os.path.dirname(prefix)
        config_file = os.path.join(directory, "bert_config.json")
        config = BertConfig.from_dict(_read_config(config_file, "Google"))
        report.source, report.format, report.found = path, "Google TF", len(reader.entries)
        tensors = {}
        for name in reader.entries:
            reason = _tf_skip_reason(name)
            if reason:
                report.skipped[name] = reason
            else:
                tensors[_tf_to_path(name)] = reader.read(name)
    except tf_checkpoint.CheckpointFormatError as e:
        raise ConversionError(str(e)) from None
    params = _collect(tensors, config, prefix, report)
    check_vocab_file(directory, config)
    return config, params


def save_tf(config: BertConfig, params: dict[str, Any], path: str) -> None:
    """Writes a Google-style TF checkpoint directory: `bert_config.json`, `bert_model.ckpt.*`."""
    os.makedirs(path, exist_ok=True)
    tensors = {_path_to_tf(p): np.asarray(v) for p, v in flatten(unstack_layers(params)).items()}
    tf_checkpoint.write_bundle(os.path.join(path, "bert_model.ckpt"), tensors)
    _write_json(os.path.join(path, "bert_config.json"),
                {f.name: getattr(config, f.name) for f in dataclasses.fields(BertConfig)
                 if f.name in ARCHITECTURE_FIELDS + ("hidden_dropout_prob",
                                                     "attention_probs_dropout_prob",
                                                     "initializer_range")})


# ---------------------------------------------------------------------------
# Hugging Face checkpoints.


def _path_to_hf(path: str) -> tuple[str, bool]:
    """The Hugging Face name of a bertjax path, and whether the tensor is transposed."""
    special = {"predictions/output_bias": "cls.predictions.bias",
               "seq_relationship/output_weights": "cls.seq_relationship.weight",
               "seq_relationship/output_bias": "cls.seq_relationship.bias"}
    if path in special:
        return special[path], False
    name = re.sub(r"^(predictions|seq_relationship)/", r"cls/\1/", path)
    name = re.sub(r"encoder/layer_(\d+)/", r"encoder/layer/\1/", name)
    transpose = name.endswith("/kernel")
    name = re.sub(r"/(kernel|scale)$", "/weight", name)
    if name.endswith("_embeddings"):
        name += "/weight"
    return name.replace("/", "."), transpose


def _hf_config(values: dict[str, Any], where: str) -> BertConfig:
    if values.get("model_type", "bert") != "bert":
        raise ConversionError(f"{where}: model_type={values['model_type']!r}; only BERT is "
                              "supported")
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(f"{where}: position_embedding_type="
                              f"{values['position_embedding_type']!r}; only 'absolute' is BERT's")
    if values.get("is_decoder") or values.get("add_cross_attention"):
        raise ConversionError(f"{where}: decoder/cross-attention BERT is not supported")
    act = values.get("hidden_act", "gelu")
    if act not in HF_ACTIVATIONS:
        raise ConversionError(f"{where}: hidden_act={act!r}; supported: {sorted(HF_ACTIVATIONS)}")
    return BertConfig.from_dict({**values, "hidden_act": HF_ACTIVATIONS[act]})


def _read_hf_tensors(directory: str) -> dict[str, np.ndarray]:
    """All tensors of a HF model directory: safetensors (single or sharded) or, with torch,
    `pytorch_model.bin`."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    def load(name: str) -> dict[str, np.ndarray]:
        path = os.path.join(directory, name)
        try:
            return load_file(path)
        except (SafetensorError, OSError) as e:
            raise ConversionError(f"cannot read {path} ({e}): the file is missing, truncated or "
                                  "not safetensors; download it again") from None

    if os.path.isfile(os.path.join(directory, "model.safetensors")):
        return load("model.safetensors")
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        shards = sorted(set(_read_config(index_path, "sharded")["weight_map"].values()))
        return {k: v for shard in shards for k, v in load(shard).items()}
    bin_path = os.path.join(directory, "pytorch_model.bin")
    if os.path.isfile(bin_path):
        try:
            import torch
        except ImportError:
            raise ConversionError(f"{bin_path} needs PyTorch to read (pip install torch==2.13.0), "
                                  "or convert it to model.safetensors") from None
        try:
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for damaged files
            raise ConversionError(f"cannot read {bin_path}: {e}") from None
        # numpy has no bfloat16: such tensors are widened to float32.
        return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy()
                for k, v in state.items()}
    raise ConversionError(f"{directory}: no Hugging Face weights ({', '.join(HF_WEIGHT_FILES)})")


def load_hf(path: str, report: LoadReport | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads a Hugging Face BERT directory (`config.json` + `model.safetensors`, sharded
    safetensors, or `pytorch_model.bin` when torch is installed)."""
    report = report if report is not None else LoadReport()
    config = _hf_config(_read_config(os.path.join(path, "config.json"), "Hugging Face"), path)
    tensors = _read_hf_tensors(path)
    if tensors and not any(k.startswith("bert.") for k in tensors):  # saved from BertModel
        tensors = {"bert." + k: v for k, v in tensors.items()}
    # Old checkpoints name LayerNorm parameters gamma/beta.
    tensors = {re.sub(r"LayerNorm\.beta$", "LayerNorm.bias",
                      re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)): v
               for k, v in tensors.items()}
    report.source, report.format, report.found = path, "Hugging Face", len(tensors)
    by_hf_name = {_path_to_hf(p)[0]: p for p in param_shapes(config)}
    mapped = {}
    for name, value in tensors.items():
        if name in by_hf_name:
            path_, transpose = by_hf_name[name], _path_to_hf(by_hf_name[name])[1]
            mapped[path_] = np.ascontiguousarray(value.T) if transpose else value
        elif name in HF_TIED:
            tied_to = tensors.get(HF_TIED[name])
            if tied_to is not None and not np.array_equal(value, tied_to):
                raise ConversionError(f"{path}: {name} differs from {HF_TIED[name]}; bertjax "
                                      "ties them as the original BERT does, so it cannot hold "
                                      "these weights")
            report.skipped[name] = f"tied to {HF_TIED[name]}"
        elif name in HF_BUFFERS:
            report.skipped[name] = "buffer, not a weight"
        elif name.startswith(("bert.", "cls.")):
            mapped[name] = value  # reported by _collect as not fitting the config
        else:
            report.skipped[name] = "not a BertForPreTraining weight"
    params = _collect(mapped, config, path, report)
    check_vocab_file(path, config)
    return config, params


def save_hf(config: BertConfig, params: dict[str, Any], path: str) -> None:
    """Writes `config.json` + `model.safetensors` that `transformers.BertForPreTraining
    .from_pretrained(path)` loads with no missing or unexpected weights (no torch needed)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for p, value in flatten(unstack_layers(params)).items():
        name, transpose = _path_to_hf(p)
        value = np.asarray(value)
        tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    values = {f: getattr(config, f) for f in ARCHITECTURE_FIELDS}
    values.update(hidden_act=TO_HF_ACTIVATION[config.hidden_act],
                  hidden_dropout_prob=config.hidden_dropout_prob,
                  attention_probs_dropout_prob=config.attention_probs_dropout_prob,
                  initializer_range=config.initializer_range, model_type="bert",
                  architectures=["BertForPreTraining"], tie_word_embeddings=True, pad_token_id=0)
    _write_json(os.path.join(path, "config.json"), values)


def _write_json(path: str, values: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")


# ---------------------------------------------------------------------------
# bertjax (Orbax) checkpoints.


def _bertjax_directory(path: str) -> str:
    """A workdir holds its checkpoints in `checkpoints/`; accept both."""
    inner = os.path.join(path, "checkpoints")
    return inner if os.path.isdir(inner) else path


def _bertjax_config(directory: str) -> BertConfig:
    meta = checkpoint.read_meta(directory)
    if "config" in meta:  # a training run: the full model config
        return BertConfig.from_dict(json.loads(meta["config"])["model"])
    return BertConfig.from_dict(meta["model"])


def load_bertjax(path: str, report: LoadReport | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Reads the parameters of the latest bertjax checkpoint in a checkpoint directory or
    workdir onto the host (numpy), with unrolled layers."""
    report = report if report is not None else LoadReport()
    directory = _bertjax_directory(path)
    config = _bertjax_config(directory)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
                            abstract_params(config))
    restored = checkpoint.restore_params(directory, abstract)
    params = unstack_layers(jax.tree.map(np.asarray, restored))
    report.source, report.format = path, "bertjax"
    report.found = report.mapped = len(flatten(params))
    return dataclasses.replace(config, scan_layers=False), params


def save_bertjax(config: BertConfig, params: dict[str, Any], path: str) -> None:
    """Writes a params-only bertjax checkpoint that `train.init_checkpoint` (and `load_pretrained`)
    reads, in the layer layout of `config.scan_layers`."""
    params = unstack_layers(params)
    if config.scan_layers:
        params = stack_layers(params)
    checkpoint.save_params(path, params, {"model": dataclasses.asdict(config)})


# ---------------------------------------------------------------------------
# Format detection, run checks, CLI.


def detect_format(path: str) -> str:
    """'tf', 'hf' or 'bertjax', from the files at `path`."""
    if os.path.isfile(path + ".index") or path.endswith(".index"):
        return "tf"
    if os.path.isdir(path):
        names = set(os.listdir(path))
        if "config.json" in names and names & set(HF_WEIGHT_FILES):
            return "hf"
        if any(n.endswith(".index") for n in names):
            return "tf"
        if "checkpoints" in names or any(n.isdigit() for n in names):
            return "bertjax"
    if not os.path.exists(path):
        raise ConversionError(f"{path} does not exist")
    raise ConversionError(
        f"cannot tell the checkpoint format of {path}: expected a Google TF checkpoint "
        "(bert_config.json + bert_model.ckpt.index/.data-*), a Hugging Face directory "
        "(config.json + model.safetensors or pytorch_model.bin) or a bertjax checkpoint directory")


LOADERS = {"tf": load_tf, "hf": load_hf, "bertjax": load_bertjax}
SAVERS = {"tf": save_tf, "hf": save_hf, "bertjax": save_bertjax}


def load_pretrained(path: str,
                    report: LoadReport | None = None) -> tuple[BertConfig, dict[str, Any]]:
    """Loads any supported checkpoint (format detected) as `(config, numpy params)`."""
    return LOADERS[detect_format(path)](path, report)


def check_architecture(found: BertConfig, run: BertConfig, where: str) -> None:
    """Refuses a checkpoint whose architecture differs from the run's model config."""
    diffs = [f"{f}: checkpoint {getattr(found, f)!r}, config.model {getattr(run, f)!r}"
             for f in ARCHITECTURE_FIELDS if getattr(found, f) != getattr(run, f)]
    if diffs:
        raise ConversionError(f"init_checkpoint {where} does not fit the model config:\n  "
                              + "\n  ".join(diffs)
                              + "\nSet config.model.* to the checkpoint's values.")


def init_params(path: str, run_config: BertConfig, abstract: Any) -> Any:
    """Parameters from `path` (any format) for a run of `run_config`, placed on the shardings
    of the abstract params `abstract`; what `train.init_checkpoint` uses."""
    if detect_format(path) == "bertjax":
        found = _bertjax_config(_bertjax_directory(path))
        check_architecture(found, run_config, path)
        if found.scan_layers == run_config.scan_layers:  # read straight into the shards
            return checkpoint.restore_params(_bertjax_directory(path), abstract)
    found, params = load_pretrained(path)
    check_architecture(found, run_config, path)
    if run_config.scan_layers:
        params = stack_layers(params)
    return jax.tree.map(lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding),
                        params, abstract)


def checkpoint_case(path: str) -> bool | None:
    """True/False if a path names an uncased/cased model (Google's `uncased_L-12_H-768_A-12`,
    `multi_cased_...`, HF's `bert-base-cased`), None if it does not say."""
    for part in reversed(os.path.normpath(os.path.abspath(path)).split(os.sep)):
        match = re.search(r"(?:^|[^a-z])(uncased|cased)(?:$|[^a-z])", part.lower())
        if match:
            return match.group(1) == "uncased"
    return None


def validate_case(path: str, do_lower_case: bool, vocab_file: str = "") -> None:
    """Google's `validate_case_matches_checkpoint`: an uncased model with a cased tokenizer
    (or the reverse) trains on text it never saw. Also refuses lower-casing with a vocab
    that holds upper-case tokens (those could never be produced)."""
    lowered = checkpoint_case(path)
    if lowered is not None and lowered != do_lower_case:
        kind = "an uncased" if lowered else "a cased"
        raise ConversionError(
            f"init_checkpoint {path} is {kind} model but data.do_lower_case={do_lower_case}; "
            f"set --config.data.do_lower_case={lowered}")
    if do_lower_case and vocab_file and vocab_file.endswith(".txt"):
        with open(vocab_file, encoding="utf-8", errors="replace") as f:
            upper = sum(1 for t in f if not t.startswith("[") and t.strip().lower() != t.strip())
        if upper > 100:
            raise ConversionError(
                f"{vocab_file} is a cased vocab ({upper} tokens with upper-case letters) but "
                "data.do_lower_case=True would never produce them; set "
                "--config.data.do_lower_case=False")


def check_run_tokenizer(path: str, data_config: Any, tokenizer_vocab_size: int,
                        model_vocab_size: int) -> None:
    """A run from a pretrained checkpoint must tokenize as the checkpoint was trained: the
    same vocabulary size and, for WordPiece, the same casing."""
    if tokenizer_vocab_size != model_vocab_size:
        raise ConversionError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but config.model.vocab_size (and "
            f"init_checkpoint {path}) has {model_vocab_size}; use the checkpoint's vocab file")
    if data_config.tokenizer == "wordpiece":
        validate_case(path, data_config.do_lower_case, data_config.vocab_file)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bertjax.convert",
        description="Convert BERT checkpoints between Google TF, Hugging Face and bertjax.")
    parser.add_argument("src", help="source checkpoint (format detected)")
    parser.add_argument("dst", help="output directory")
    parser.add_argument("--to", choices=FORMATS, default=None,
                        help="output format; default: bertjax for TF/HF sources, hf for bertjax")
    parser.add_argument("--scan_layers", action="store_true",
                        help="bertjax output with stacked (scanned) layers")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    try:
        source_format = detect_format(args.src)
        target = args.to or ("hf" if source_format == "bertjax" else "bertjax")
        report = LoadReport()
        config, params = LOADERS[source_format](args.src, report)
        print(report.summary(), flush=True)
        if target == "bertjax":
            config = dataclasses.replace(config, scan_layers=args.scan_layers)
        SAVERS[target](config, params, args.dst)
    except (ConversionError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    source_dir = args.src if os.path.isdir(args.src) else os.path.dirname(args.src)
    vocab = os.path.join(source_dir, "vocab.txt")
    if target != "bertjax" and os.path.isfile(vocab):
        shutil.copy(vocab, os.path.join(args.dst, "vocab.txt"))
    print(f"wrote {target} checkpoint {args.dst} ({report.mapped} tensors, "
          f"{time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
