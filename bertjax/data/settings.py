"""`config.data`'s schema and typed, frozen settings, built once at an entry point
(`DataSettings.of`): each field's default, unit, range and doc (bertjax.runtime.schema), its
choices checked in one line naming the `--config.data.FIELD` to set, and what the data layer
derives from them (the mask mix, dynamic masking, accent stripping) computed here.
validate.py checks the ranges before the conversion.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from bertjax.data import corpora, masking
from bertjax.data.errors import DataError
from bertjax.runtime import schema
from bertjax.runtime.schema import (
    AT_LEAST_0,
    AT_LEAST_1,
    PROBABILITY,
    SEQ_LENGTH,
    Range,
    setting,
)


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """The pretraining data's settings (`config.data`, same field names)."""

    source: str = setting(
        "text",
        "the corpus: one of corpora.names() (`default`: the embedded stdlib corpus, `text`: files,"
        " `tfds`: a TFDS dataset)",
    )
    input_files: str = setting("", "comma-separated paths or globs (source=text)")
    text_format: Literal["auto", "lines", "paragraphs"] = setting(
        "auto",
        "`lines`: a sentence per line, blank lines between documents (the original's); "
        "`paragraphs`; `auto`: told from the text",
    )
    tfds_name: str = setting("", 'e.g. "wikipedia/20230601.en" (source=tfds, array_record format)')
    tfds_split: str = setting("train", "the TFDS split")
    tfds_data_dir: str = setting("", "TFDS data_dir; empty = TFDS's default")
    tfds_text_key: str = setting("text", "the feature holding the text")
    tokenizer: Literal["wordpiece", "sentencepiece", "bpe"] = setting(
        "wordpiece", "`wordpiece` (Google's vocab.txt), `sentencepiece` or `bpe`"
    )
    vocab_file: str = setting(
        "",
        "vocab.txt, a SentencePiece .model or tokenizer.json (bpe); empty: train a SentencePiece "
        "model",
    )
    sentencepiece_vocab_size: int = setting(
        30522, "the vocabulary of a SentencePiece model the run trains", "tokens"
    )
    do_lower_case: bool = setting(True, "lower-case the input (uncased models)")
    strip_accents: Literal["auto", "true", "false"] = setting(
        "auto", "`auto` (= do_lower_case, the original's), `true` or `false`"
    )
    max_seq_length: int = setting(
        128, "tokens per sequence in the first phase", "tokens", SEQ_LENGTH
    )
    max_predictions_per_seq: int = setting(
        20, "masked positions per sequence in the first phase", "positions", AT_LEAST_1
    )
    masked_lm_prob: float = setting(
        0.15, "the fraction of tokens masked (chosen for prediction)", "fraction", PROBABILITY
    )
    mask_token_prob: float = setting(
        0.8,
        "of the chosen tokens, the fraction replaced by [MASK] (paper: 0.8; Table 8 ablates the "
        "mix)",
        "probability",
    )
    random_token_prob: float = setting(
        0.1,
        "of the chosen tokens, the fraction replaced by a random token (the rest keep theirs); "
        "mask_token_prob + this must be <= 1",
        "probability",
    )
    short_seq_prob: float = setting(
        0.1, "the probability of a shorter target length", "probability"
    )
    dupe_factor: int = setting(
        10, "copies of the corpus with different masks (static masking)", "copies", AT_LEAST_1
    )
    masking: Literal["static", "dynamic"] = setting(
        "static",
        "`static` (the original's: masked once when prepared) or `dynamic` (masked by the loader "
        "each epoch)",
    )
    whole_word_mask: bool = setting(False, "mask all pieces of a word together")
    packing: bool = setting(
        False,
        "deviation, off = the original: pack whole instances into rows of max_seq_length, each "
        "with its own positions, segment ids, [CLS] and NSP prediction (block-diagonal attention: "
        "an instance computes exactly what it does alone)",
    )
    packing_max_instances: int = setting(
        4, "instances per packed row at most (NSP slots per row)", "instances"
    )
    eval_fraction: float = setting(
        0.01, "the fraction of documents held out for evaluation", "fraction"
    )
    shard_bytes: int = setting(
        16 << 20,
        "text prepared at a time by one worker (bounds its memory); documents never span shards, "
        "NSP partners come from the same shard (docs/data-preparation.md)",
        "bytes",
        Range(">= 1024", lambda v: v >= 1024),
    )
    num_workers: int = setting(
        0, "processes preparing shards; 0 = one per CPU core", "processes", AT_LEAST_0
    )
    prepared_dir: str = setting(
        "", "read data made by `python -m bertjax.prepare --output=DIR`; empty = prepare it here"
    )
    cache_dir: str = setting(
        "",
        "where data is prepared (local disk); empty = WORKDIR/data (gs:// workdirs: a local "
        "temporary folder)",
    )
    seed: int = setting(12345, "the data seed (instances, masks, order); the original's default")

    @classmethod
    def of(cls, data: Mapping[str, Any], recorded: bool = False) -> DataSettings:
        """The settings of `data` (config.data); DataError naming the field if a choice is not
        one of its values or the mask mix is not one. `recorded`: `data` is a config an older
        run recorded, whose missing fields take their default."""
        settings = schema.typed(
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
