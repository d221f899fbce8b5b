"""Model families (`config.model.family`: "bert", the default, or "modernbert"): the one
interface through which the shared machinery (mesh, state, steps, data, checkpoints, tasks,
interop) meets a model. Each family is a `Family` registered here (`register`), found by
name (`get`) or by its config (`of`); BERT's is `bertjax.families.bert`, ModernBERT's
`bertjax.families.modernbert`. Shared code asks the family, it never branches on it."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax

from bertjax.errors import ConfigError
from bertjax.models.family_interface import (
    Family as Family,
    FinetuneSource as FinetuneSource,
    HeadOptions as HeadOptions,
    HfForm as HfForm,
    ModelConfig as ModelConfig,
    Params as Params,
    Report as Report,
    TaskHead as TaskHead,
    TfForm as TfForm,
)

DEFAULT = "bert"  # the family of a `model` section that names none (BERT's configs, records)
_BUILTIN = ("bertjax.families.bert", "bertjax.families.modernbert")


_FAMILIES: dict[str, Family[Any]] = {}
_BY_CLASS: dict[type, Family[Any]] = {}


def register(family: Family) -> Family:
    """Makes `family` known by its name and config class (again: replaced)."""
    _FAMILIES[family.name] = family
    _BY_CLASS[family.config_class] = family
    return family


def _load_builtin() -> None:
    for module in _BUILTIN:
        importlib.import_module(module)


def names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(_FAMILIES)


def get(name: str) -> Family:
    """The family registered as `name`; ConfigError (one line) if none is (a config or a
    checkpoint's record naming a family this process does not know)."""
    _load_builtin()
    if name not in _FAMILIES:
        raise ConfigError(
            f"model family {name!r} is not one of "
            f"{', '.join(map(repr, _FAMILIES))}: a family must be registered "
            "(bertjax.models.families.register) before its configs or checkpoints are read"
        )
    return _FAMILIES[name]


def of(config: ModelConfig | nn.Module) -> Family:
    """The family of a model config (or of a model: its `config`)."""
    _load_builtin()
    found = getattr(config, "config", config)
    for cls in type(found).__mro__:
        if cls in _BY_CLASS:
            return _BY_CLASS[cls]
    raise TypeError(f"{type(found).__name__} is no registered family's model config")


def by_hf_type(model_type: str) -> Family:
    """The family whose transformers `model_type` is `model_type`; BERT's for any other (its
    reader names what it does not support)."""
    _load_builtin()
    return next(
        (f for f in _FAMILIES.values() if f.hf and f.hf.model_type == model_type),
        _FAMILIES[DEFAULT],
    )


def tf_form() -> TfForm[Any]:
    """The Google TF form, of the family whose checkpoints it holds (BERT's)."""
    _load_builtin()
    return next(f.tf for f in _FAMILIES.values() if f.tf)


def hf_forms() -> tuple[HfForm[Any], ...]:
    """Every registered family's transformers form."""
    _load_builtin()
    return tuple(f.hf for f in _FAMILIES.values() if f.hf)


def family(model: Mapping[str, Any]) -> str:
    """The family a config's `model` section (or a record) names ("bert" when it names none)."""
    return model.get("family", DEFAULT)


def check(model: Mapping[str, Any], prefix: str = "model.", flag: str = "--config.") -> None:
    """ValueError (one line) for an unknown family or a field its config cannot build."""
    name, known = family(model), names()
    if name not in known:
        raise ValueError(
            f"{prefix}family={name!r} is not one of "
            f"{', '.join(map(repr, known))}; set {flag}{prefix}family"
        )
    own = get(name)
    fields = {f.name for f in dataclasses.fields(own.config_class)}
    for other in _FAMILIES.values():
        foreign = sorted(
            set(model) & ({f.name for f in dataclasses.fields(other.config_class)} - fields)
        )
        if foreign:
            raise ValueError(
                f"{prefix}family={name!r} but the {prefix.rstrip('.')} section "
                f"holds {other.title}'s fields ({', '.join(foreign[:3])}, ...): a "
                f"{own.title} run starts from a {own.title} config, {own.configs}"
            )
    own.check(dict(model), prefix, flag)


def model_config(model: Mapping[str, Any]) -> Any:
    """The family's config class built from a config's `model` section."""
    check(model)
    return get(family(model)).config_class.from_dict(dict(model))


def from_record(values: Mapping[str, Any]) -> Any:
    """The model config a record (`as_record`, `recorded_fields`) names, unchecked."""
    return get(family(values)).config_class.from_dict(dict(values))


def recorded_fields(config: ModelConfig) -> dict[str, Any]:
    """What a checkpoint records of a run's model (a resume must match it)."""
    return of(config).recorded_fields(config)


def name_of(config: ModelConfig) -> str:
    """The family name of a model config."""
    return of(config).name


def architecture(config: ModelConfig) -> dict[str, Any]:
    """`{field: value}` of the fields a checkpoint fixes."""
    return of(config).architecture(config)


def as_record(config: ModelConfig) -> dict[str, Any]:
    """A model config's fields as a dict, naming its family where the family records it (so
    `family` and `from_record` read it back as the same family)."""
    values = dataclasses.asdict(config)
    own = of(config)
    return {"family": own.name, **values} if own.records_family else values


def pretrained_parts(config: ModelConfig) -> tuple[str, ...]:
    """The top-level parameters a fine-tuned model takes from a pretrained checkpoint."""
    return of(config).pretrained_parts


def optional_pretrained_parts(config: ModelConfig) -> tuple[str, ...]:
    """The `pretrained_parts` a checkpoint may lack, left at their initialisation."""
    return of(config).optional_parts


def head(kind: str, config: ModelConfig, num_labels: int, options: HeadOptions) -> nn.Module:
    """The fine-tuning model of a task `kind` ("classification", "tagging", "span") for
    `config`'s family; `options`: the task's (`features.TaskOptions`)."""
    own = of(config)
    if kind not in own.head_kinds:
        raise ValueError(
            f"a {own.title} model has no {kind} head; fine-tune it on a task of "
            f"kind {', '.join(map(repr, own.head_kinds))}"
        )
    return own.head(kind, config, num_labels, options)


def pretraining_model(config: ModelConfig) -> nn.Module:
    """The module pretraining trains."""
    return of(config).pretraining_model(config)


def example_inputs(model: nn.Module) -> tuple:
    """Inputs for `model.init` (any family's model with a `config`)."""
    return of(model).example_inputs(model)


def abstract_params(model: nn.Module, boxed: bool = False) -> Any:
    """The parameters of `model` (any family) as ShapeDtypeStructs, allocating nothing;
    `boxed` keeps flax's logical-axis boxes (for partition specs)."""
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), *example_inputs(model))["params"]
    )
    return params if boxed else nn.meta.unbox(params)


def scanned(config: ModelConfig) -> bool:
    """Whether `config`'s layers are stacked for `nn.scan` (its parameters `[layers, ...]`)."""
    return of(config).scanned(config)


def with_layout(config: ModelConfig, scan: bool) -> Any:
    """`config` with its layers stacked (`scan`) or unrolled (a family that never scans: as
    it is)."""
    return of(config).with_scanned(config, scan)
