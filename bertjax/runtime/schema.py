"""Config sections as typed schemas: one frozen dataclass per section, where each field holds
its default, its unit, its allowed range and its doc in one place (`setting`).

configs/base.py builds the schema'd sections from their defaults (`section_config`) and the
other configs set values; an entry point types a section once (`typed`) after checking its
ranges (`out_of_range`). `reference` writes the sections as the table of
docs/configuration.md.

Dataclasses (not pydantic): the settings are plain frozen values that jit-free code reads
by attribute, the project already uses them everywhere, and the checks a config needs (a
range, a few choices, registered names) are a few lines here, with the one-line errors the
command line promises.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Protocol, TypeVar

import ml_collections


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric setting allows: `text` says it in a refusal, `test` checks it."""

    text: str
    test: Callable[[float], bool]

    def holds(self, value: object) -> bool:
        """`value` is a finite number (not a bool) that `test` accepts."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return number and math.isfinite(value) and self.test(value)  # type: ignore[arg-type]


POSITIVE = Range("> 0", lambda v: v > 0)
AT_LEAST_1 = Range(">= 1", lambda v: v >= 1)
AT_LEAST_0 = Range(">= 0", lambda v: v >= 0)
PROBABILITY = Range("between 0 and 1", lambda v: 0 <= v <= 1)
BELOW_1 = Range(">= 0 and < 1", lambda v: 0 <= v < 1)  # (a dropout rate of 1 drops everything)
# [CLS] A [SEP] B [SEP]: three special tokens and at least one token of each segment.
MIN_SEQ_LENGTH = 5
SEQ_LENGTH = Range(f">= {MIN_SEQ_LENGTH}", lambda v: v >= MIN_SEQ_LENGTH)


def setting(default: object, doc: str, unit: str = "", allowed: Range | None = None) -> Any:
    """A schema field: its `default` (the paper's recipe, BERT-base), what it is (`doc`), its
    `unit` and the numeric `allowed` range (None: any value of its type, or its choices)."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "unit": unit, "allowed": allowed}
    )


class Schema(Protocol):
    """Any dataclass (what `dataclasses.fields` takes)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


T = TypeVar("T", bound=Schema)


def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields of the settings class `cls` that name one of a few choices, read off their
    Literal types."""
    return {
        name: typing.get_args(kind)
        for name, kind in typing.get_type_hints(cls).items()
        if typing.get_origin(kind) is Literal
    }


def ranges(cls: type[Schema]) -> dict[str, Range]:
    """The fields of `cls` with a numeric range, in the section's order."""
    return {
        f.name: f.metadata["allowed"]
        for f in dataclasses.fields(cls)
        if f.metadata.get("allowed") is not None
    }


def out_of_range(
    cls: type[Schema], values: Mapping[str, Any], section: str, skip: tuple[str, ...] = ()
) -> str | None:
    """The one-line refusal of the first field of `values` (the config section `section`,
    typed by `cls`; "" for the fields at the config's top) outside its range, or None; the
    `skip` fields are not checked."""
    for name, allowed in ranges(cls).items():
        if name in values and name not in skip and not allowed.holds(values[name]):
            field = f"{section}.{name}" if section else name
            return (
                f"{field}={values[name]!r} is out of range: it must be {allowed.text}; "
                f"set --config.{field}"
            )
    return None


def defaults(cls: type[Schema]) -> dict[str, Any]:
    """Every field of `cls` at its default, in the schema's order."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def section_config(cls: type[Schema]) -> ml_collections.ConfigDict:
    """The config section of `cls` with every field at its default, in the schema's order
    (what configs/base.py starts from)."""
    return ml_collections.ConfigDict(defaults(cls))


def typed(
    cls: type[T],
    values: Mapping[str, Any],
    section: str,
    error: type[Exception],
    recorded: bool = False,
    case_free: tuple[str, ...] = (),
    registered: Mapping[str, tuple[str, ...]] | None = None,
) -> T:
    """The settings class `cls` (a frozen dataclass) from the config section `section`'s
    `values`; `error` naming the `--config.SECTION.FIELD` to set where a choice is not one of
    its values (compared exactly, but for the `case_free` fields: a truth value written as
    text in any case; the `registered` fields: one of the names a registry holds now).
    `recorded`: `values` is a section an older run recorded, whose missing fields take their
    default (every field of a schema has one)."""
    allowed = {**choices(cls), **(registered or {})}
    settings = cls(
        **{
            f.name: values[f.name] if f.name in values or not recorded else f.default
            for f in dataclasses.fields(cls)
        }
    )
    for field, options in allowed.items():
        value = getattr(settings, field)
        if (str(value).lower() if field in case_free else value) not in options:
            raise error(
                f"{section}.{field}={value!r} is not one of "
                f"{', '.join(map(repr, options))}; set --config.{section}.{field}"
            )
    return settings


def reference(sections: Mapping[str, type[Schema]], top: bool = False) -> str:
    """The schema'd `sections` (name -> class) as Markdown: one table per section, a row per
    field with its default, unit, range or choices, and doc. `top`: the fields stand at the
    config's top (a fine-tuning config's), each name a title."""
    out = []
    for name, cls in sections.items():
        heading = name if top else f"`{name}`"
        out += [f"## {heading}", "", "| field | default | unit | allowed | what it is |"]
        out.append("|---|---|---|---|---|")
        kinds = choices(cls)
        for f in dataclasses.fields(cls):
            allowed = f.metadata["allowed"]
            allowed_text = (
                allowed.text
                if allowed
                else ", ".join(f"`{c}`" for c in kinds[f.name])
                if f.name in kinds
                else ""
            )
            doc = f.metadata["doc"].replace("|", "\\|")
            out.append(
                f"| `{f.name if top else f'{name}.{f.name}'}` | `{f.default!r}` | "
                f"{f.metadata['unit']} | "
                f"{allowed_text} | {doc} |"
            )
        out.append("")
    return "\n".join(out)
