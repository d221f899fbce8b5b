"""The model-family interface: `Family`, what shared code needs of one model family (T5X's
BaseModel style: class attributes and methods), its checkpoint forms (`HfForm`, `TfForm`) and
what a family reads of its callers' values. `families` registers and finds them."""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import flax.linen as nn
import jax
from jax.typing import ArrayLike

from bertjax.models.layers import losses


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


class Report(Protocol):
    """What a checkpoint reader tells of what it found and did (`interop.tree.LoadReport`)."""

    source: str
    format: str
    found: int
    mapped: int
    skipped: dict[str, str]


class TaskHead(Protocol):
    """A fine-tuned model's output layer in transformers' form (`interop.finetuned.HFHead`)."""

    @property
    def architecture(self) -> str: ...

    @property
    def tensors(self) -> Mapping[str, Any]: ...

    @property
    def config(self) -> Mapping[str, Any]: ...

    @property
    def pooler(self) -> bool: ...


Config = TypeVar("Config", bound=ModelConfig)  # a family's model config class
Params = Mapping[str, Any]  # a model's parameter tree


class HfForm(abc.ABC, Generic[Config]):
    """A family's transformers form: how `convert` and `pretrained` read and write it."""

    model_type: str  # config.json's `model_type`
    class_prefix: str  # "Bert": its task classes are `{prefix}ForSequenceClassification`...
    pretraining_class: str  # the class a pretrained export loads as
    pretraining_heads: str  # what that class adds to the encoder, for the model card
    pretrained_classes: tuple[str, ...]  # its classes that hold no fine-tuned task
    output_layer_names: bool = True  # a task's output layer renamed to transformers' Linear
    sequence_pooler: bool = True  # its sequence classifier (and bare encoder) has BERT's pooler

    @abc.abstractmethod
    def read(self, path: str, report: Report | None = None) -> tuple[Config, dict[str, Any]]:
        """`(config, numpy params)` of the transformers directory at `path`."""

    @abc.abstractmethod
    def config(self, values: dict[str, Any], where: str) -> Config:
        """The model config of a `config.json`'s values (`where`: for messages)."""

    @abc.abstractmethod
    def write(
        self,
        config: Config,
        params: dict[str, Any],
        path: str,
        head: TaskHead | None = None,
        pad_token_id: int = 0,
    ) -> int:
        """Writes the directory (with `head`: a fine-tuned model's class); the parameters
        written."""

    @abc.abstractmethod
    def describe(self, config: Config) -> str:
        """The model card's architecture row after the sizes."""


class TfForm(abc.ABC, Generic[Config]):
    """A family's Google TF form: a tensor bundle with its config file beside it."""

    config_file: str  # the config beside the bundle: "bert_config.json"

    @abc.abstractmethod
    def read(self, path: str, report: Report | None = None) -> tuple[Config, dict[str, Any]]:
        """`(config, numpy params)` of the checkpoint at `path` (a directory or a prefix)."""

    @abc.abstractmethod
    def config(self, directory: str) -> Config:
        """The model config of `config_file` in `directory`."""

    @abc.abstractmethod
    def write(self, config: Config, params: dict[str, Any], path: str) -> None:
        """Writes the checkpoint directory at `path`."""


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
    hf: HfForm[Config] | None = None  # its transformers form, if any
    tf: TfForm[Config] | None = None  # its Google TF form, if any

    @abc.abstractmethod
    def check(self, values: Mapping[str, Any], prefix: str, flag: str) -> None:
        """A `model` section its config cannot build: ValueError (one line)."""

    @abc.abstractmethod
    def recorded_fields(self, config: Config) -> dict[str, Any]:
        """What a checkpoint records of a run's model (a resume must match it)."""

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
        self, config: Config, objective: str, next_sentence_prediction: bool
    ) -> None:
        """A pretraining run (its model, `train.objective`, `train.next_sentence_prediction`)
        it cannot train: ConfigError."""

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
    def hf_form(self) -> HfForm[Config]:
        """`hf`, where the caller knows the family has a transformers form."""
        if self.hf is None:
            raise TypeError(f"{self.title} has no transformers form")
        return self.hf

    @property
    def tf_form(self) -> TfForm[Config]:
        """`tf`, where the caller knows the family has a Google TF form."""
        if self.tf is None:
            raise TypeError(f"{self.title} has no Google TF form")
        return self.tf
