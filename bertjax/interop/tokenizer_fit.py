"""Whether a tokenizer's ids are a checkpoint's (`problem`): the one test every entry point
(train, finetune, extract_features, probe) applies to the tokenizer it resolved
(`pretrained.tokenizer_of`), for bertjax, Hugging Face and Google checkpoints alike, before
any data work; and whether a checkpoint directory holds a tokenizer at all (`files_beside`)."""

from __future__ import annotations

import os

from bertjax.data import tokenization
from bertjax.interop import hf_tokenizer, native
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
