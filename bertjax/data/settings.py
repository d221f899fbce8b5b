"""`config.data` as typed, frozen settings, built once at an entry point (`DataSettings.of`):
its choices checked there, in one line naming the `--config.data.FIELD` to set, and what the
data layer derives from them (the mask mix, dynamic masking, accent stripping) computed there.

The fields keep the config's names, types and defaults (configs/base.py documents each one);
validate.py checks their ranges before the conversion.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal, Mapping

from bertjax.data import masking
from bertjax.data.errors import DataError


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """The pretraining data's settings (`config.data`, same field names)."""

    source: Literal["default", "text", "tfds"]
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
    def of(cls, data: Mapping[str, Any], recorded: bool = False) -> "DataSettings":
        """The settings of `data` (config.data); DataError naming the field if a choice is not
        one of its values or the mask mix is not one. `recorded`: `data` is a config an older
        run recorded, whose missing fields take their type's empty value (a choice's first)."""
        hints = typing.get_type_hints(cls)
        missing = lambda name: (typing.get_args(hints[name])[0] if name in CHOICES
                                else hints[name]())  # ("", 0, 0.0, False)
        settings = cls(**{f.name: data[f.name] if f.name in data or not recorded
                          else missing(f.name) for f in dataclasses.fields(cls)})
        for field, allowed in CHOICES.items():
            value = getattr(settings, field)
            if (str(value).lower() if field in CASE_FREE else value) not in allowed:
                raise DataError(f"data.{field}={value!r} is not one of "
                                f"{', '.join(map(repr, allowed))}; set --config.data.{field}")
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


# The fields that name one of a few choices, read off their Literal types; compared exactly,
# but for a truth value written as text in any case (True, true).
CHOICES = {name: typing.get_args(kind) for name, kind in
           typing.get_type_hints(DataSettings).items() if typing.get_origin(kind) is Literal}
CASE_FREE = {"strip_accents"}
