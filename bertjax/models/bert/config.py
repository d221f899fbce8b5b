"""BERT's hyperparameters (Google's `bert_config.json` plus dtypes and layout switches), the
activations and the remat policies they name."""

from __future__ import annotations

import dataclasses
import functools
import json
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

import flax.linen as nn
import jax

from bertjax.models import attention

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class FromDict:
    """`from_dict` for a dataclass config: built from a dict, ignoring keys it does not know."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # (set by @dataclass on the subclass)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


@dataclasses.dataclass(frozen=True)
class BertConfig(FromDict):
    """Google's `bert_config.json` fields plus compute/parameter dtypes and layout switches."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # "gelu" = exact erf (released checkpoints); "gelu_tanh"; "relu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"  # compute dtype; "bfloat16" on TPU/GPU
    param_dtype: str = "float32"
    scan_layers: bool = False  # nn.scan over layers: faster compiles, stacked [layers, ...] params
    remat_policy: str = "none"  # one of REMAT_POLICIES
    # One of attention.ATTENTION_IMPLS; "auto" picks per backend when the model is traced.
    attention_impl: str = "auto"
    # The MLM output projection runs on the vocabulary padded to a multiple of this (e.g. 128
    # for aligned GPU/TPU matmuls); parameters and logits keep vocab_size. 1 = no padding.
    vocab_pad_multiple: int = 1

    def __post_init__(self) -> None:
        check(dataclasses.asdict(self))

    @classmethod
    def from_json_file(cls, path: str) -> BertConfig:
        """Reads Google's `bert_config.json`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def resolved_attention_impl(self, backend: str | None = None) -> str:
        """The implementation training uses on `backend` (default: the target platform)."""
        return attention.resolve_impl(
            self.attention_impl,
            self.dtype,
            self.head_size,
            backend,
            self.attention_probs_dropout_prob,
        )


DTYPES = ("float32", "bfloat16", "float16")
# Sizes a model needs at least 1 of.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "vocab_pad_multiple",
)


def check(values: Mapping[str, Any], prefix: str = "", flag: str = "") -> None:
    """Raises ValueError for the first of BertConfig's fields in `values` (absent ones at
    their defaults) that cannot build a model, in one line naming the field(s) and the fix.
    Names are written `{prefix}{field}` and the fix's setting `{flag}{prefix}{field}` (e.g.
    prefix "model.", flag "--config." for a pretraining config)."""
    fields = FieldChecks(BertConfig, values, prefix, flag)
    fields.sizes(SIZE_FIELDS)
    fields.heads_divide_hidden()
    fields.positive(("initializer_range", "layer_norm_eps"))
    fields.choices(
        (
            ("hidden_act", ACTIVATIONS),
            ("remat_policy", REMAT_POLICIES),
            ("attention_impl", attention.ATTENTION_IMPLS),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
        )
    )


class FieldChecks:
    """The checks a model config's fields share (BertConfig's, ModernBertConfig's): `values`
    over the class's defaults, each refusal one line naming `{prefix}{field}` and the setting
    `{flag}{prefix}{field}` that fixes it."""

    def __init__(self, cls: type, values: Mapping[str, Any], prefix: str, flag: str) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        self.value = {**defaults, **{k: v for k, v in values.items() if k in defaults}}
        self.prefix, self.flag = prefix, flag

    def name(self, field: str) -> str:
        return f"{self.prefix}{field}"

    def setting(self, field: str) -> str:
        return f"{self.flag}{self.prefix}{field}"

    def sizes(self, fields: tuple[str, ...]) -> None:
        for field in fields:
            if not isinstance(self.value[field], numbers.Integral) or self.value[field] < 1:
                raise ValueError(
                    f"{self.name(field)}={self.value[field]!r} is out of range: it "
                    f"must be an integer >= 1; set {self.setting(field)}"
                )

    def heads_divide_hidden(self) -> None:
        hidden, heads = self.value["hidden_size"], self.value["num_attention_heads"]
        if hidden % heads:
            near = sorted(
                (d for d in range(1, hidden + 1) if hidden % d == 0),
                key=lambda d: (abs(d - heads), d),
            )[:2]
            raise ValueError(
                f"{self.name('hidden_size')}={hidden} is not divisible by "
                f"{self.name('num_attention_heads')}={heads} (each head gets hidden_size / "
                f"num_attention_heads units): set {self.setting('num_attention_heads')} to a "
                f"divisor of {hidden} (e.g. {' or '.join(map(str, sorted(near)))}), or "
                f"{self.setting('hidden_size')} to a multiple of {heads}"
            )

    def positive(self, fields: tuple[str, ...]) -> None:
        for field in fields:
            value = self.value[field]
            number = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if not number or not value > 0 or value == float("inf"):
                raise ValueError(
                    f"{self.name(field)}={value!r} is out of range: it must be a "
                    f"number > 0; set {self.setting(field)}"
                )

    def choices(self, table: tuple[tuple[str, Any], ...]) -> None:
        for field, choices in table:
            if self.value[field] not in choices:
                raise ValueError(
                    f"{self.name(field)}={self.value[field]!r} is not one of "
                    f"{', '.join(map(repr, choices))}; set {self.setting(field)}"
                )


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
}
