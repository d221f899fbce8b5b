"""`config.data` as typed, frozen settings, built once at an entry point (`DataSettings.of`):
its choices checked there, in one line naming the `--config.data.FIELD` to set, and what the
data layer derives from them (the mask mix, dynamic masking, accent stripping) computed there.
`typed` builds any config section's settings class the same way (bertjax.training.settings: train,
long_phase).

The fields keep the config's names, types and defaults (configs/base.py documents each one);
validate.py checks their ranges before the conversion.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol, TypeVar

from bertjax.data import corpora, masking
from bertjax.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """The pretraining data's settings (`config.data`, same field names)."""

    source: str  # one of corpora.names() (the registered corpus sources)
    input_files: str  # comma-separated paths or globs
    text_format: Literal["auto", "lines", "paragraphs"]
    tfds_name: str
    tfds_split: str
    tfds_data_dir: str
    tfds_text_key: str
    tokenizer: Literal["wordpiece", "sentencepiece", "bpe"]
    vocab_file: str
    sentencepiece_vocab_size: int  # tokens
    do_lower_case: bool
    strip_accents: Literal["auto", "true", "false"]
    max_seq_length: int  # tokens, first phase
    max_predictions_per_seq: int  # first phase
    masked_lm_prob: float  # fraction of tokens
    mask_token_prob: float  # probability
    random_token_prob: float  # probability
    short_seq_prob: float  # probability
    dupe_factor: int
    masking: Literal["static", "dynamic"]
    whole_word_mask: bool
    packing: bool
    packing_max_instances: int
    eval_fraction: float
    shard_bytes: int  # bytes of text per shard
    num_workers: int  # 0 = one per CPU core
    prepared_dir: str  # data made by `python -m bertjax.prepare`; empty = prepare here
    cache_dir: str  # where data is prepared; empty = WORKDIR/data
    seed: int  # instances, masks and order

    @classmethod
    def of(cls, data: Mapping[str, Any], recorded: bool = False) -> DataSettings:
        """The settings of `data` (config.data); DataError naming the field if a choice is not
        one of its values or the mask mix is not one. `recorded`: `data` is a config an older
        run recorded, whose missing fields take their type's empty value (a choice's first)."""
        settings = typed(
            cls,
            data,
            "data",
            DataError,
            recorded,
            case_free=("strip_accents",),
            registered={"source": corpora.names()},
        )
        try:
            masking.check_mask_mix(*settings.mask_mix)
        except ValueError as e:
            raise DataError(f"data.{e}") from e
        return settings

    @property
    def mask_mix(self) -> tuple[float, float]:
        """`(mask_token_prob, random_token_prob)`: of the chosen tokens, the share replaced by
        [MASK] and by a random token."""
        return (self.mask_token_prob, self.random_token_prob)

    @property
    def dynamic(self) -> bool:
        """Masks drawn by the loader each epoch (`masking=dynamic`), not stored when prepared."""
        return self.masking == "dynamic"

    @property
    def strip_accents_option(self) -> bool | None:
        """`strip_accents`: None for "auto" (follows do_lower_case, the original), else the bool."""
        value = str(self.strip_accents).lower()
        return None if value == "auto" else value == "true"

    def items(self) -> list[tuple[str, Any]]:
        """`(field, value)` in the config's order."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


class _Dataclass(Protocol):
    """Any dataclass (what `dataclasses.fields` takes)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


T = TypeVar("T", bound=_Dataclass)


def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The fields of the settings class `cls` that name one of a few choices, read off their
    Literal types."""
    return {
        name: typing.get_args(kind)
        for name, kind in typing.get_type_hints(cls).items()
        if typing.get_origin(kind) is Literal
    }


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
    default, else their type's empty value (a choice's first)."""
    hints, allowed = typing.get_type_hints(cls), {**choices(cls), **(registered or {})}

    def missing(field: dataclasses.Field) -> Any:
        if field.default is not dataclasses.MISSING:
            return field.default
        return allowed[field.name][0] if field.name in allowed else hints[field.name]()

    settings = cls(
        **{
            f.name: values[f.name] if f.name in values or not recorded else missing(f)
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
