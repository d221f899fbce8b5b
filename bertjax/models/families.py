"""Model families (`config.model.family`: "bert", the default, or "modernbert"): the one
interface through which the shared machinery (mesh, state, steps, data, checkpoints, tasks,
interop) meets a model. Each family is a `Family` registered here (`register`), found by
name (`get`) or by its config (`of`); BERT's is `bertjax.families.bert`, ModernBERT's
`bertjax.families.modernbert`. Shared code asks the family, it never branches on it."""

from __future__ import annotations

import abc
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import flax.linen as nn
import jax
from jax.typing import ArrayLike

from bertjax.errors import ConfigError
from bertjax.models.layers import losses

DEFAULT = "bert"  # the family of a `model` section that names none (BERT's configs, records)
_BUILTIN = ("bertjax.families.bert", "bertjax.families.modernbert")


class ModelConfig(Protocol):
    """What shared code reads of any family's model config (a frozen dataclass, hashable: its
    fields read-only, hence properties here)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def vocab_size(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...

    @property
    def num_attention_heads(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def param_dtype(self) -> str: ...

    @property
    def remat_policy(self) -> str: ...

    @property
    def attention_impl(self) -> str: ...

    @property
    def head_size(self) -> int: ...

    @property
    def attention_probs_dropout_prob(self) -> float: ...

    def __hash__(self) -> int: ...

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Any: ...


class HeadOptions(Protocol):
    """What a task's head reads of its options (`tasks.features.TaskOptions`)."""

    @property
    def causal_attention(self) -> bool: ...

    @property
    def feature_based(self) -> bool: ...

    @property
    def lstm_size(self) -> int: ...


class FinetuneSource(Protocol):
    """What a family reads of a fine-tuning run's model source (`interop.pretrained.Source`)."""

    @property
    def init_checkpoint(self) -> str: ...

    @property
    def model_config(self) -> str: ...

    @property
    def dtype(self) -> str: ...

    @property
    def hidden_dropout_prob(self) -> float: ...

    @property
    def attention_probs_dropout_prob(self) -> float: ...

    @property
    def classifier_pooling(self) -> str: ...

    @property
    def vocab_flag(self) -> str: ...


Config = TypeVar("Config", bound=ModelConfig)  # a family's model config class
Params = Mapping[str, Any]  # a model's parameter tree


@dataclasses.dataclass(frozen=True)
class HfForm:
    """A family's transformers form: how `convert` and `pretrained` read and write it."""

    model_type: str  # config.json's `model_type`
    read: Callable[..., tuple[Any, dict[str, Any]]]  # (path, report) -> (config, params)
    config: Callable[[dict[str, Any], str], Any]  # (config.json's values, where) -> config
    write: Callable[..., int]  # (config, params, path, head, pad_token_id) -> parameters
    class_prefix: str  # "Bert": its task classes are `{prefix}ForSequenceClassification`...
    pretraining_class: str  # the class a pretrained export loads as
    pretraining_heads: str  # what that class adds to the encoder, for the model card
    describe: Callable[[Any], str]  # the model card's architecture row after the sizes
    output_layer_names: bool = True  # a task's output layer renamed to transformers' Linear
    sequence_pooler: bool = True  # its sequence classifier has BERT's pooler


class Family(abc.ABC, Generic[Config]):
    """Everything shared code needs of one model family, T5X's BaseModel style: a subclass
    sets the class attributes and implements the abstract methods (`bertjax.families.bert`);
    `register(Subclass())` makes it known."""

    name: str  # `model.family`
    title: str  # for messages: "BERT"
    configs: str  # the config files whose `model` section its runs start from
    config_class: type[Config]  # a frozen dataclass with `from_dict`
    encoder_scope: str  # the encoder's top-level parameter name inside every model
    head_kinds: tuple[str, ...] = ("classification", "tagging", "span")  # its task heads
    pretraining_rules: tuple = ()  # validate's (field, check, message) rules of its section
    pretrained_parts: tuple[str, ...] = ()  # what fine-tuning takes from a pretrained model
    optional_parts: tuple[str, ...] = ()  # the pretrained_parts a checkpoint may lack
    records_family: bool = True  # its records name `family` (BERT's are as before families)
    token_type_ids: bool = True  # its inputs have segments (tokenizer exports name them)
    tokenizer_pad: bool = False  # its config names the tokenizer's [PAD] id (`pad_token_id`)
    probes: bool = False  # bertjax.probe reads its layers
    hf: HfForm | None = None  # its transformers form, if any

    @abc.abstractmethod
    def check(self, values: Mapping[str, Any], prefix: str, flag: str) -> None:
        """A `model` section its config cannot build: ValueError (one line)."""

    @abc.abstractmethod
    def recorded_fields(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """What a checkpoint records of the `model` section (a resume must match it)."""

    @abc.abstractmethod
    def architecture(self, config: Config) -> dict[str, Any]:
        """The fields a checkpoint fixes."""

    @abc.abstractmethod
    def pretraining_model(self, config: Config) -> nn.Module:
        """The module pretraining trains."""

    @abc.abstractmethod
    def encoder(self, config: Config) -> nn.Module:
        """The bare encoder (features, probes)."""

    @abc.abstractmethod
    def example_inputs(self, model: nn.Module) -> tuple:
        """Inputs for `model.init`."""

    @abc.abstractmethod
    def forward(
        self,
        model: nn.Module,
        params: Params,
        batch: Mapping[str, jax.Array],
        mask: jax.Array,
        deterministic: bool,
        rngs: dict[str, Any] | None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """`(mlm logits, nsp logits or None)` of its pretraining model on `batch`."""

    @abc.abstractmethod
    def pretraining_loss(
        self,
        outputs: tuple[jax.Array, jax.Array | None],
        batch: Mapping[str, jax.Array],
        denominators: Mapping[str, Any] | None = None,
        next_sentence_prediction: bool = True,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`(loss, metric sums)` of `forward`'s outputs on `batch`: the sums add up over
        micro-batches, steps and hosts (`objectives.summarize` makes them means);
        `denominators`: `loss_denominators` of the whole optimizer batch (default: `batch`'s),
        so that micro-batch losses add up to its loss."""

    def loss_denominators(self, batch: Mapping[str, jax.Array]) -> dict[str, Any]:
        """What `pretraining_loss` divides by, of a whole optimizer batch: its masked-LM
        weights."""
        return {"mlm_weights": losses.mlm_weight_total(batch)}

    @abc.abstractmethod
    def all_layers(
        self,
        encoder: nn.Module,
        params: Params,
        input_ids: ArrayLike,
        segment_ids: ArrayLike,
        input_mask: ArrayLike,
    ) -> jax.Array:
        """Every layer's output of the encoder, `[N, B, L, H]`."""

    @abc.abstractmethod
    def head(self, kind: str, config: Config, num_labels: int, options: HeadOptions) -> nn.Module:
        """The fine-tuning model of a task `kind` (one of `head_kinds`)."""

    @abc.abstractmethod
    def flops(self, config: Config, seq_length: int, predictions: int) -> int:
        """Training FLOPs per sequence."""

    @abc.abstractmethod
    def check_pretraining(
        self, model: Mapping[str, Any], objective: str, next_sentence_prediction: bool
    ) -> None:
        """A pretraining run (`model` section, `train.objective`, `train
        .next_sentence_prediction`) it cannot train: ConfigError."""

    @abc.abstractmethod
    def finetune_config(self, values: dict[str, Any], source: FinetuneSource) -> Config:
        """The fine-tuning model config of architecture `values` and a `pretrained.Source`."""

    @abc.abstractmethod
    def finetune_problem(self, options: object, init_checkpoint: str) -> str | None:
        """The refusal of a fine-tuning option it has no use for (None: none)."""

    def check_export(
        self,
        config: Config,
        params: dict[str, Any],
        src: str,
        source_format: str,
        target: str,
        scan_layers: bool,
    ) -> None:
        """A conversion it refuses: ConversionError (none by default)."""
        return None

    def encoder_only(self, params: dict[str, Any]) -> bool:
        """Whether `params` hold its encoder alone (no heads at all)."""
        return False

    def scanned(self, config: Config) -> bool:
        """Whether `config`'s layers are stacked (scanned)."""
        return False

    def with_scanned(self, config: Config, scanned: bool) -> Config:
        """`config` in that layer layout (a family that never scans: as it is)."""
        return config

    def pad_id(self, config: Config) -> int | None:
        """The tokenizer's [PAD] id its config names (a `tokenizer_pad` family's)."""
        return None

    def with_pad_id(self, config: Config, pad_id: int) -> Config:
        """The config naming `pad_id` as the [PAD] id."""
        return config

    @property
    def hf_form(self) -> HfForm:
        """`hf`, where the caller knows the family has a transformers form."""
        if self.hf is None:
            raise TypeError(f"{self.title} has no transformers form")
        return self.hf


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


def recorded_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of the model (a resume must match it)."""
    return get(family(model)).recorded_fields(model)


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
