"""Model families a pretraining run can train (`config.model.family`): "bert" (the default,
`bertjax.model`) or "modernbert" (`bertjax.modernbert`). The one place that maps a config's
`model` section to its config class, its pretraining module and the fields a checkpoint
records; the rest of the machinery (mesh, state, steps, data, checkpoints) is shared."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax.linen as nn
import jax

from bertjax import bert_config, modernbert, modernbert_config
from bertjax import model as bert_model
from bertjax.model import BertConfig, BertForPreTraining
from bertjax.modernbert_config import ModernBertConfig

FAMILIES = ("bert", "modernbert")
ModelConfig = BertConfig | ModernBertConfig
NAMES = {"bert": "BERT", "modernbert": "ModernBERT"}
# The config files whose `model` section each family's runs start from.
CONFIGS = {"bert": "configs/tiny.py, configs/base.py or configs/large.py",
           "modernbert": "configs/modernbert_tiny.py, configs/modernbert_base.py or "
                         "configs/modernbert_large.py"}
_FIELDS = {"bert": {f.name for f in dataclasses.fields(BertConfig)},
           "modernbert": {f.name for f in dataclasses.fields(ModernBertConfig)}}


def family(model: Mapping[str, Any]) -> str:
    """The family a config's `model` section names ("bert" when it names none)."""
    return model.get("family", "bert")


def check(model: Mapping[str, Any], prefix: str = "model.", flag: str = "--config.") -> None:
    """ValueError (one line) for an unknown family or a field its config cannot build."""
    name = family(model)
    if name not in FAMILIES:
        raise ValueError(f"{prefix}family={name!r} is not one of "
                         f"{', '.join(map(repr, FAMILIES))}; set {flag}{prefix}family")
    other = "bert" if name == "modernbert" else "modernbert"
    foreign = sorted(set(model) & (_FIELDS[other] - _FIELDS[name]))
    if foreign:
        raise ValueError(f"{prefix}family={name!r} but the {prefix.rstrip('.')} section holds "
                         f"{NAMES[other]}'s fields ({', '.join(foreign[:3])}, ...): a "
                         f"{NAMES[name]} run starts from a {NAMES[name]} config, "
                         f"{CONFIGS[name]}")
    (modernbert_config.check if name == "modernbert" else bert_config.check)(
        dict(model), prefix, flag)


def model_config(model: Mapping[str, Any]) -> ModelConfig:
    """The family's config class built from a config's `model` section."""
    check(model)
    cls = ModernBertConfig if family(model) == "modernbert" else BertConfig
    return cls.from_dict(dict(model))


def recorded_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the model (a resume must match it): its architecture and
    storage fields, and for ModernBERT the family and the padding id (BERT's record is as
    before families)."""
    if family(model) == "modernbert":
        config = model_config(model)
        return {"family": "modernbert", **modernbert_config.architecture(config),
                "pad_token_id": config.pad_token_id,  # (what an export's embeddings name)
                "param_dtype": config.param_dtype}
    return {name: model[name] for name in bert_model.ARCHITECTURE_FIELDS
            + bert_model.STORAGE_FIELDS}


def is_modernbert(config: ModelConfig) -> bool:
    return isinstance(config, ModernBertConfig)


def name_of(config: ModelConfig) -> str:
    """The family of a model config ("bert" or "modernbert")."""
    return "modernbert" if is_modernbert(config) else "bert"


def architecture(config: ModelConfig) -> dict[str, Any]:
    """`{field: value}` of the fields a checkpoint fixes: its family's ARCHITECTURE_FIELDS."""
    return (modernbert_config.architecture if is_modernbert(config)
            else bert_model.architecture)(config)


def as_record(config: ModelConfig) -> dict[str, Any]:
    """A model config's fields as a dict, with `family` for ModernBERT (so `family` and
    `model_config` read it back as the same family)."""
    values = dataclasses.asdict(config)
    return {"family": "modernbert", **values} if is_modernbert(config) else values


def pretrained_parts(config: ModelConfig) -> tuple[str, ...]:
    """The top-level parameters a fine-tuned model takes from a pretrained checkpoint: BERT's
    encoder (`bert`); ModernBERT's encoder and its prediction head (`model`, `head`), as
    transformers' ModernBertFor... classes load them from a ModernBertForMaskedLM."""
    return ("model", "head") if is_modernbert(config) else ("bert",)


def optional_pretrained_parts(config: ModelConfig) -> tuple[str, ...]:
    """The `pretrained_parts` a checkpoint may lack, left at their initialisation: ModernBERT's
    prediction head, which a bare transformers ModernBertModel does not hold (transformers'
    ModernBertFor... classes initialise it then too)."""
    return ("head",) if is_modernbert(config) else ()


def pretraining_model(config: ModelConfig) -> nn.Module:
    """The module pretraining trains: BertForPreTraining (MLM + NSP heads) or
    ModernBertForMaskedLM (MLM only)."""
    return modernbert.ModernBertForMaskedLM(config) if is_modernbert(config) \
        else BertForPreTraining(config)


def example_inputs(model: nn.Module) -> tuple:
    """Inputs for `model.init` (either family)."""
    if isinstance(model, (modernbert.ModernBertForMaskedLM, modernbert.ModernBertModel)):
        # (128 tokens where the model allows them: TPU's Pallas kernel, which "auto" picks
        # for this family's dropout-free attention, takes multiples of 128 only)
        return modernbert.example_inputs(min(128, model.config.max_position_embeddings))
    return bert_model.example_inputs(model)


def abstract_params(model: nn.Module, boxed: bool = False) -> Any:
    """The parameters of `model` (either family) as ShapeDtypeStructs, allocating nothing;
    `boxed` keeps flax's logical-axis boxes (for partition specs)."""
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), *example_inputs(model))["params"])
    return params if boxed else nn.meta.unbox(params)
