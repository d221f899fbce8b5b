"""Whether a tokenizer's ids are a checkpoint's (`problem`): the one test every entry point
(train, finetune, extract_features, probe) applies to the tokenizer it resolved
(`pretrained.tokenizer_of`), for bertjax, Hugging Face and Google checkpoints alike, before
any data work; whether a checkpoint directory holds a tokenizer at all (`files_beside`); and
whether WordPiece's casing is the checkpoint's (`validate_case`, from its name)."""

from __future__ import annotations

import os
import re

from bertjax.data import tokenization
from bertjax.interop import hf_tokenizer, native
from bertjax.interop.tree import ConversionError
from bertjax.runtime import files


def files_beside(path: str) -> bool:
    """Whether the checkpoint at `path` (a directory, or a TF checkpoint prefix) has a
    tokenizer file beside it: `vocab.txt`, a SentencePiece model, `tokenizer.json` or
    bertjax's `bertjax_tokenizer.json`."""
    directory = path if files.isdir(path) else os.path.dirname(path)
    names = (
        "vocab.txt",
        *hf_tokenizer.SENTENCEPIECE_FILES,
        "tokenizer.json",
        native.TOKENIZER_FILE,
    )
    return any(files.isfile(os.path.join(directory, name)) for name in names)


def problem(
    tokenizer: tokenization.Tokenizer,
    what: str,
    own: tokenization.Tokenizer | None,
    fingerprint: str | None,
    embedding_rows: int | None,
    path: str,
    flag: str,
) -> str:
    """Why `tokenizer` (`what`: how the line names it) does not fit the checkpoint at `path`,
    in one line ("" where it does): its ids must be are the checkpoint's: the `fingerprint` a bertjax run recorded, if any;
    else the same token at each of its ids as `own` (the checkpoint's tokenizer, where it has
    one: a smaller vocabulary that is a prefix of it fits); and no more ids than the
    checkpoint's `embedding_rows` (which may exceed the tokenizer's: padded tables). `flag`:
    the entry point's flag for another tokenizer."""
    fix = f"drop {flag} to take the checkpoint's own tokenizer, or pass {flag}=PATH to it"
    if fingerprint and tokenizer.fingerprint() != fingerprint:
        return (
            f"{what} is not the tokenizer init_checkpoint={path!r} was pretrained with "
            f"(fingerprint {tokenizer.fingerprint()[:12]}, checkpoint {fingerprint[:12]}); "
            f"pass {flag}=PATH to that run's vocabulary or .model file (with its "
            "do_lower_case)"
        )
    if own is not None and tokenizer.fingerprint() != own.fingerprint():
        differs = _first_difference(tokenizer, own)
        if differs:
            return f"{what} is not the tokenizer of init_checkpoint {path}: {differs}; {fix}"
    if embedding_rows is not None and tokenizer.vocab_size > embedding_rows:
        return (
            f"{what} has {tokenizer.vocab_size} tokens but init_checkpoint {path} has "
            f"{embedding_rows} embedding rows: its ids do not fit the checkpoint; {fix}"
        )
    return ""


def _first_difference(tokenizer: tokenization.Tokenizer, own: tokenization.Tokenizer) -> str:
    """Where `tokenizer`'s id-to-token map leaves `own`'s ("" where it agrees with it, or with
    its first ids), in words."""
    if tokenizer.vocab_size > own.vocab_size:
        return f"it has {tokenizer.vocab_size} tokens, the checkpoint's tokenizer {own.vocab_size}"
    ids = range(tokenizer.vocab_size)
    for i, (mine, theirs) in enumerate(
        zip(tokenizer.convert_ids_to_tokens(ids), own.convert_ids_to_tokens(ids))
    ):
        if mine != theirs:
            return f"its id {i} is {mine!r}, the checkpoint's {theirs!r}"
    return ""


def checkpoint_case(path: str) -> bool | None:
    """True/False if a path names an uncased/cased model (Google's `uncased_L-12_H-768_A-12`,
    `multi_cased_...`, HF's `bert-base-cased`), None if it does not say."""
    for part in reversed(os.path.normpath(os.path.abspath(path)).split(os.sep)):
        match = re.search(r"(?:^|[^a-z])(uncased|cased)(?:$|[^a-z])", part.lower())
        if match:
            return match.group(1) == "uncased"
    return None


def validate_case(
    path: str,
    do_lower_case: bool,
    vocab_file: str = "",
    case_flag: str = "--config.data.do_lower_case",
) -> None:
    """Google's `validate_case_matches_checkpoint`: an uncased model with a cased tokenizer
    (or the reverse) trains on text it never saw. Also refuses lower-casing with a vocab
    that holds upper-case tokens (those could never be produced). `case_flag`: the entry
    point's flag for do_lower_case, named in the messages."""
    field = case_flag.removeprefix("--config.").removeprefix("--")
    lowered = checkpoint_case(path)
    if lowered is not None and lowered != do_lower_case:
        kind = "an uncased" if lowered else "a cased"
        raise ConversionError(
            f"init_checkpoint {path} is {kind} model but {field}={do_lower_case}; "
            f"set {case_flag}={lowered}"
        )
    if do_lower_case and vocab_file and vocab_file.endswith(".txt"):
        with files.open(vocab_file, encoding="utf-8", errors="replace") as f:
            upper = sum(1 for t in f if not t.startswith("[") and t.strip().lower() != t.strip())
        if upper > 100:
            raise ConversionError(
                f"{vocab_file} is a cased vocab ({upper} tokens with upper-case letters) but "
                f"{field}=True would never produce them; set {case_flag}=False"
            )
