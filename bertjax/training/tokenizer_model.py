"""The model fields a fresh ModernBERT run takes from its tokenizer file (`data.vocab_file`):
`pad_token_id` (the id its config names for [PAD], which an export's config.json carries) and
`vocab_size` where the model's table is smaller than the tokenizer. A field set
on the command line keeps its value, and one that contradicts the tokenizer is refused in one
line, before any data work. (A run from `train.init_checkpoint` takes the checkpoint's:
`init_architecture`.)"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from bertjax.data import tokenization
from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.models import families
from bertjax.runtime import console, files


def tokenizer_fields(
    model: Mapping[str, Any], tokenizer: tokenization.Tokenizer, explicit: Collection[str]
) -> dict[str, Any]:
    """The fields of `model` (the `model` section's values of a family whose config names the
    tokenizer's [PAD]) that `tokenizer` changes: the padding id, and a vocabulary too small
    for the tokenizer's ids; ConfigError for such a field that `explicit` (the dotted names
    set on the command line) sets."""
    wanted = {"pad_token_id": tokenizer.pad_id}
    if model["vocab_size"] < tokenizer.vocab_size:
        wanted["vocab_size"] = tokenizer.vocab_size
    contradicted = [
        f"--config.model.{name}={model[name]!r} (the tokenizer's: {value!r}"
        + (" tokens)" if name == "vocab_size" else ", its [PAD])")
        for name, value in wanted.items()
        if f"model.{name}" in explicit and model[name] != value
    ]
    if contradicted:
        raise ConfigError(
            f"{', '.join(contradicted)} contradicts the tokenizer: drop the override (the run "
            "takes the tokenizer's), or name the tokenizer it belongs to as "
            "--config.data.vocab_file"
        )
    return {name: value for name, value in wanted.items() if model[name] != value}


def model_of_tokenizer_file(
    model: Mapping[str, Any], data: DataSettings, explicit: Collection[str], tell: bool = True
) -> dict[str, Any]:
    """`tokenizer_fields` of the tokenizer `data.vocab_file` names (none without one, or
    where it is absent: preparation says so; none for a family whose config names no [PAD]),
    told in a line if `tell`."""
    if not families.get(families.family(model)).tokenizer_pad:
        return {}
    if not data.vocab_file or not files.exists(data.vocab_file):
        return {}
    tokenizer = tokenization.load_tokenizer(
        data.tokenizer, data.vocab_file, data.do_lower_case, data.strip_accents_option
    )
    changed = tokenizer_fields(model, tokenizer, explicit)
    if changed and tell:
        console.chief_print(
            f"The model of tokenizer {data.vocab_file}: "
            + ", ".join(f"{name}={value}" for name, value in changed.items())
            + " (the config's replaced)"
        )
    return changed
