"""A Hugging Face `tokenizer.json` read as transformers' AutoTokenizer reads it: by the
`tokenizers` library, with the padding and truncation it may carry ignored (sentence-transformers
saves both turned on; transformers applies them only when a call asks), and a WordPiece one of
Google's form as bertjax's WordPiece (its vocabulary and casing: `wordpiece_vocab`)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from typing import NamedTuple

import tokenizers as tk

from bertjax.data.errors import DataError
from bertjax.data.wordpiece import CLS, SEP, SPECIAL_TOKENS, UNK, read_bytes
from bertjax.runtime import files

# tokenizer_config.json classes under which transformers applies a tokenizer.json as it is.
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


class Casing(NamedTuple):
    """How the WordPiece tokenizer of a `tokenizer.json` cases text, as transformers applies it."""

    do_lower_case: bool
    strip_accents: bool
    max_input_chars_per_word: int


def read(path: str) -> tuple[str, dict]:
    """The text and the parsed json of the tokenizer.json at `path`; DataError (one line) if it
    is not UTF-8 JSON with a model type."""
    try:
        text = read_bytes(path, "tokenizer.json").decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 (byte {e.start}), so not a tokenizer.json; pass "
            "the tokenizer.json as saved by the tokenizers library"
        ) from None
    try:
        spec = json.loads(text)
        spec["model"]["type"]
    except (ValueError, KeyError, TypeError):
        raise DataError(
            f"{path} is not a tokenizer.json (JSON with a model type); pass the "
            "tokenizer.json as saved by the tokenizers library"
        ) from None
    return text, spec


def library_tokenizer(text: str, path: str) -> tk.Tokenizer:
    """The `tokenizers` tokenizer of a tokenizer.json's `text` without its padding and
    truncation, as transformers encodes one text; DataError if the library cannot read it."""
    try:
        hf = tk.Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 (tokenizers raises plain Exception)
        raise DataError(
            f"{path} is not a tokenizer.json the tokenizers library reads ({e})"
        ) from None
    hf.no_padding()
    hf.no_truncation()
    return hf


def wordpiece_vocab(path: str) -> tuple[str, Casing]:
    """The vocabulary (a `vocab.txt` made from the json's, in id order) and casing of a
    WordPiece tokenizer.json of Google's form: BertNormalizer (cleaning text, splitting CJK),
    BertPreTokenizer, `##` pieces, [UNK], no added tokens but BERT's special ones and a
    `[CLS] A [SEP] B [SEP]` post-processor. Raises DataError naming what differs."""
    text, spec = read(path)
    model, normalizer = spec["model"], spec.get("normalizer") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        vocab = {}  # (not a WordPiece vocab: refused below, lacking the special tokens)
    tokens = sorted(vocab, key=lambda token: vocab[token])
    added = {t.get("content") for t in spec.get("added_tokens") or []} - set(SPECIAL_TOKENS)
    checks = [
        (
            normalizer.get("type") == "BertNormalizer"
            and normalizer.get("clean_text")
            and normalizer.get("handle_chinese_chars"),
            f"its normalizer is {normalizer.get('type')},"
            " not BertNormalizer with clean_text and handle_chinese_chars",
        ),
        (
            (spec.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer",
            "its pre_tokenizer is not BertPreTokenizer",
        ),
        (
            (model.get("continuing_subword_prefix"), model.get("unk_token")) == ("##", UNK),
            f"its pieces are not '##' continuations with {UNK}",
        ),
        (
            [vocab[t] for t in tokens] == list(range(len(tokens))),
            "its vocab's ids are not 0, 1, 2, ... (holes or repeats)",
        ),
        (
            all(t and t == t.strip() and "\n" not in t for t in tokens),
            "a token of its vocab is empty or has spaces around it",
        ),
        (
            set(SPECIAL_TOKENS) <= set(vocab),
            f"its vocab lacks {sorted(set(SPECIAL_TOKENS) - set(vocab))}",
        ),
        (not added, f"it adds tokens {sorted(added)[:3]} to its vocab's"),
    ]
    problems = [what for ok, what in checks if not ok]
    if not problems:
        problems = _template_problems(library_tokenizer(text, path), spec, tokens)
    if problems:
        raise DataError(
            f"{path} is a WordPiece tokenizer bertjax cannot reproduce: {'; '.join(problems)}"
        )
    vocab_txt = "".join(t + "\n" for t in tokens).encode("utf-8")
    return temporary_file("vocab.txt", vocab_txt), _casing(os.path.dirname(path), normalizer, model)


def _template_problems(hf: tk.Tokenizer, spec: dict, tokens: list[str]) -> list[str]:
    """What keeps the json's post-processor from giving BERT's `[CLS] A [SEP] B [SEP]` (segment
    0, then 1), found by encoding a pair; empty if it gives that."""
    ids = {t: i for i, t in enumerate(tokens)}
    a, b = (hf.encode(t, add_special_tokens=False).ids for t in ("a", "b"))
    pair = hf.encode("a", "b")
    if pair.ids == [ids[CLS], *a, ids[SEP], *b, ids[SEP]] and pair.type_ids == [0] * (
        len(a) + 2
    ) + [1] * (len(b) + 1):
        return []
    return [
        f"its post_processor ({(spec.get('post_processor') or {}).get('type')}) does not "
        f"give {CLS} A {SEP} B {SEP}"
    ]


def _casing(directory: str, normalizer: dict, model: dict) -> Casing:
    """The casing transformers' AutoTokenizer gives a WordPiece tokenizer.json: its own with
    the `tokenizer_class` bertjax exports; otherwise (BertTokenizer) `tokenizer_config.json`'s
    `do_lower_case` (default true) and `strip_accents`, and 100 characters a word. Raises
    DataError where that is not the json's own casing (which casing the model was trained
    with is then unknown)."""
    lower = bool(normalizer.get("lowercase"))
    strip = lower if normalizer.get("strip_accents") is None else bool(normalizer["strip_accents"])
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = _json_config(config_path) if files.isfile(config_path) else {}
    if config.get("tokenizer_class") in FAST_TOKENIZER_CLASSES:
        return Casing(lower, strip, model.get("max_input_chars_per_word", 100))
    config_lower = bool(config.get("do_lower_case", True))
    config_strip = (
        config_lower if config.get("strip_accents") is None else bool(config["strip_accents"])
    )
    chinese = config.get("tokenize_chinese_chars", True)
    if (config_lower, config_strip, chinese) != (lower, strip, True):
        raise DataError(
            f"{directory}'s tokenizer.json (lowercase {lower}, strip_accents {strip}) and "
            f"tokenizer_config.json (do_lower_case {config_lower}, strip_accents {config_strip}"
            f"{'' if chinese else ', tokenize_chinese_chars false'}{'' if config else ': absent'}"
            ", which transformers' BertTokenizer applies) disagree, so the casing the model was "
            "trained with is unknown; set do_lower_case and strip_accents in "
            "tokenizer_config.json to the model's"
        )
    return Casing(lower, strip, 100)


def _json_config(path: str) -> dict:
    """A JSON object file (tokenizer_config.json); DataError if it is not one."""
    try:
        config = json.loads(files.read_text(path))
    except (ValueError, OSError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if not isinstance(config, dict):
        raise DataError(f"{path} is not a JSON object")
    return config


def temporary_file(name: str, data: bytes) -> str:
    """A tokenizer file `name` holding `data`, deleted when the process ends."""
    directory = tempfile.mkdtemp(prefix="bertjax_tokenizer_")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path
