"""What every family's model config shares: the activations, remat policies and dtypes its
fields name, `from_dict`, and the field checks (each refusal one line naming the field)."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Self

import flax.linen as nn
import jax

from bertjax.models.layers import gelu

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": gelu.gelu,  # exact, the original's erf form (its backward keeps only its input)
    "gelu_tanh": functools.partial(nn.gelu, approximate=True),
    "relu": nn.relu,
}
DTYPES = ("float32", "bfloat16", "float16")


class FromDict:
    """`from_dict` for a dataclass config: built from a dict, ignoring keys it does not know."""

    __dataclass_fields__: ClassVar[dict[str, Any]]  # (set by @dataclass on the subclass)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


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
