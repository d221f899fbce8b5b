"""A pretrained checkpoint's parameters for a model: `load_pretrained` checks the checkpoint's
family and architecture against the model config and places its weights like the model's
abstract parameters (a bertjax checkpoint in the same layer layout read straight into the
shards); `load_encoder` builds a family's encoder with them and the checkpoint's tokenizer.
Which checkpoint and format, architecture and tokenizer: `pretrained`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import numpy as np
from absl import logging

from bertjax.checkpoints import checkpoint
from bertjax.data import tokenization
from bertjax.interop import native, pretrained, tree
from bertjax.interop.tree import ConversionError
from bertjax.models import families


def other_family(found: families.ModelConfig, run_family: str, where: str) -> str:
    """The refusal of a checkpoint whose family is not the run's, naming the configs of
    the checkpoint's family."""
    found_family = families.of(found)
    return (
        f"init_checkpoint {where} holds a {found_family.title} model but the "
        f"run's model is {families.get(run_family).title}: start from a "
        f"{found_family.title} config, {found_family.configs}"
    )


def check_architecture(found: families.ModelConfig, run: families.ModelConfig, where: str) -> None:
    """Refuses a checkpoint whose architecture differs from the run's model config (or of
    another family: a ModernBERT one for a BERT run, or the reverse)."""
    if families.name_of(found) != families.name_of(run):
        raise ConversionError(other_family(found, families.name_of(run), where))
    diffs = [
        f"{f}: checkpoint {value!r}, config.model {getattr(run, f)!r}"
        for f, value in families.architecture(found).items()
        if value != getattr(run, f)
    ]
    if diffs:
        raise ConversionError(
            f"init_checkpoint {where} does not fit the model config:\n  "
            + "\n  ".join(diffs)
            + "\nSet config.model.* to the checkpoint's values."
        )


def load_pretrained(
    path: str,
    abstract_params: dict[str, Any],
    model_config: families.ModelConfig,
    reuse: bool = False,
    optional: tuple[str, ...] = (),
) -> Any:
    """The parameters of the checkpoint at `path` (any format) for a model of `model_config`,
    placed like `abstract_params`: the whole BertForPreTraining (ModernBertForMaskedLM) tree
    (pretraining from a checkpoint) or some of its top-level entries (`{"bert": ...}`, for
    ModernBERT `{"model": ..., "head": ...}`: a fine-tuned model's encoder). A bertjax
    checkpoint in the same layer layout is read straight into the shards. `reuse` keeps the
    last checkpoint read on the host for the next call (fine-tuning seeds). Entries named in
    `optional` may be absent from the checkpoint: they are left out of the result (the caller
    keeps its fresh ones) and logged."""
    source_format = pretrained.detect_format(path)
    if source_format == "bertjax":
        directory = native.checkpoint_dir(path)
        found = native.config_of(directory)
        check_architecture(found, model_config, path)
        if families.scanned(found) == families.scanned(model_config):
            held = set(checkpoint.stored_params(directory))
            return checkpoint.restore_params(
                directory, _held(abstract_params, held, optional, path)
            )
    logging.info("Initialising parameters from %s (%s checkpoint)", path, source_format)
    found, params = pretrained.read_once(path) if reuse else pretrained.read(path)
    check_architecture(found, model_config, path)
    wanted = _held(abstract_params, set(params), optional, path)
    if families.scanned(model_config):
        params = tree.stack_layers(params)
    return jax.tree.map(
        lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding),
        {name: params[name] for name in wanted},
        wanted,
    )


def _held(
    abstract_params: dict[str, Any], held: set[str], optional: tuple[str, ...], path: str
) -> dict[str, Any]:
    """The entries of `abstract_params` that the checkpoint at `path` holds (`held`: its
    top-level names); refused where it lacks one that is not `optional` (those are logged)."""
    absent = set(abstract_params) - held
    missing = sorted(absent - set(optional))
    if missing:
        raise ConversionError(
            f"init_checkpoint {path} has no {', '.join(missing)} parameters "
            "(a fine-tuned model holds its encoder and a task's output layer; "
            "a bare encoder, no pretraining head): start from a pretraining "
            "checkpoint"
        )
    for name in sorted(absent):
        logging.warning(
            "init_checkpoint %s has no %s parameters: they start from their "
            "random initialisation, as transformers does",
            path,
            name,
        )
    return {name: abstract for name, abstract in abstract_params.items() if name in held}


def pretraining_heads(
    params: dict[str, Any], model_config: families.ModelConfig
) -> tuple[str, ...]:
    """The top-level entries of a pretraining model's `params` outside its encoder: the heads
    (BERT's `predictions` and `seq_relationship`, ModernBERT's `head` and decoder bias) that a
    bare encoder or a fine-tuned model does not hold."""
    scope = families.of(model_config).encoder_scope
    return tuple(name for name in params if name != scope)


def fresh_heads_line(path: str, names: list[str]) -> str:
    """The line that says which pretraining heads start fresh from a checkpoint without them."""
    return (
        f"init_checkpoint {path} has no {', '.join(names)} parameters (a bare encoder or a "
        "fine-tuned model): fresh pretraining heads, initialised as the original initialises "
        "them, the masked-LM output tied to the word embeddings"
    )


def abstract_params_on_one_device(model: nn.Module) -> Any:
    """The model's parameter shapes, placed on the first device (a restore target)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        families.abstract_params(model),
    )


def load_encoder(
    source: pretrained.Source, random_init: bool = False, seed: int = 0
) -> tuple[nn.Module, dict, tokenization.Tokenizer]:
    """The family's encoder (`Family.encoder`: BertModel, ModernBertModel) with the
    checkpoint's parameters on one device, and the tokenizer; `random_init`: the checkpoint's
    architecture and tokenizer, fresh weights."""
    pretrain = pretrained.pretraining_run(source)
    model_config = pretrained.model_config_of(source, pretrain)
    family = families.of(model_config)
    tokenizer = pretrained.tokenizer_of(source, pretrain)  # (checked before any weight is read)
    model = family.encoder(model_config)
    name = family.encoder_scope
    if random_init:
        params = model.init(jax.random.PRNGKey(seed), *families.example_inputs(model))["params"]
        params = nn.meta.unbox(params)
    else:
        params = load_pretrained(
            source.init_checkpoint, {name: abstract_params_on_one_device(model)}, model_config
        )[name]
    return model, params, tokenizer
