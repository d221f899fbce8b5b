"""A Hugging Face BPE `tokenizer.json` (ModernBERT's: byte-level BPE) as a bertjax `Tokenizer`,
through the `tokenizers` library, so that fine-tuning, features and pretraining
(`data.tokenizer=bpe`) tokenize exactly as `transformers.AutoTokenizer` does. Its special
tokens are BERT's names ([CLS] [SEP] [MASK] [PAD] [UNK]), which ModernBERT's tokenizer.json defines.

Words tokenized alone (a CoNLL word, a SQuAD context word: `tokenize_word`) get the space
that precedes them in running text, as transformers' `is_split_into_words` with
`add_prefix_space` does, so a word's pieces are the ones it has inside a sentence."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

import numpy as np

from bertjax.data import hf_json
from bertjax.data.errors import DataError
from bertjax.data.wordpiece import CLS, MASK, PAD, SEP, UNK, check_id, file_fingerprint
from bertjax.runtime import files

BYTE_LEVEL_SPACE = "\u0120"  # "Ġ": byte-level BPE's piece for a space before a word


class BpeTokenizer:
    """The tokenizer of a BPE `tokenizer.json` (its normalizer, pre-tokenizer and merges; its
    padding and truncation ignored, as by transformers)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._text, spec = hf_json.read(path)
        if spec["model"]["type"] != "BPE":
            raise DataError(f"{path} is a {spec['model']['type']} tokenizer.json, not a BPE one")
        self._hf = hf_json.library_tokenizer(self._text, path)
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        specials = (PAD, UNK, CLS, SEP, MASK)
        found = {t: i for t in specials if (i := self._hf.token_to_id(t)) is not None}
        missing = [t for t in specials if t not in found]
        if missing:
            raise DataError(
                f"{path} lacks the special tokens {', '.join(missing)} "
                "that bertjax's tasks put around and into the text "
                "(ModernBERT's tokenizer.json has them)"
            )
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            found[t] for t in specials
        )

    def tokenize(self, text: str) -> list[str]:
        return self._hf.encode(text, add_special_tokens=False).tokens

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def tokenize_word(self, word: str) -> list[str]:
        """The pieces of `word` inside running text (after a space)."""
        return self.tokenize(" " + word)

    def encode_word(self, word: str) -> list[int]:
        """The ids of `word` inside running text (after a space)."""
        return self.encode(" " + word)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        ids = (self._hf.token_to_id(t) for t in tokens)
        return [self.unk_id if i is None else i for i in ids]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        # (the tokenizers stubs: None for an id out of range, which check_id refuses first)
        return [
            self._hf.id_to_token(check_id(i, self.vocab_size))  # type: ignore[misc]
            for i in ids
        ]

    def decode(self, ids: Iterable[int]) -> str:
        return self._hf.decode(list(ids))

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True for a byte-level piece that does not start a word (no
        leading `Ġ`); special and added tokens never continue one."""
        added = set(self._hf.get_added_tokens_decoder())
        mask = np.zeros(self.vocab_size, dtype=bool)
        for token, i in self._hf.get_vocab(with_added_tokens=True).items():
            mask[i] = i not in added and not token.startswith(BYTE_LEVEL_SPACE)
        return mask

    def special_ids(self) -> frozenset[int]:
        return frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))

    def json_text(self) -> str:
        """The tokenizer.json as read (what an export writes again)."""
        return self._text

    def fingerprint(self) -> str:
        """Sha256 hex of the tokenizer (its json, canonical: key order and spacing aside)."""
        canonical = json.dumps(json.loads(self._text), sort_keys=True, separators=(",", ":"))
        return file_fingerprint("bpe", canonical.encode("utf-8"), "")


def save(tokenizer: BpeTokenizer, directory: str, name: str = "tokenizer.json") -> list[str]:
    """Writes the tokenizer.json into `directory` as `name`; returns the names written."""
    with files.open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.write(tokenizer.json_text())
    return [name]
