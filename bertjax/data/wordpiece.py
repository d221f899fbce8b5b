"""Google BERT's tokenization, reproduced exactly: text cleaning, CJK splitting, lower-casing
and accent stripping, punctuation splitting (`basic_tokenize`), then greedy longest-match
WordPiece with `##` continuations (`WordPieceTokenizer`, from a Google vocab.txt)."""

from __future__ import annotations

import functools
import hashlib
import unicodedata
from collections.abc import Iterable

import numpy as np

from bertjax.data.errors import DataError
from bertjax.runtime import files

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)

# Google's "Chinese character" ranges: CJK ideographs only, so Hiragana,
# Katakana and Hangul stay whole words exactly as in the original.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
# BERT counts every non-alphanumeric printable ASCII char as punctuation,
# including "$", "^", "`" which Unicode files under symbols.
_ASCII_PUNCT_RANGES = ((33, 47), (58, 64), (91, 96), (123, 126))
WORDS_REMEMBERED = 1 << 18  # distinct words whose ids `encode` keeps (43 MB when full)


def to_text(text: str | bytes) -> str:
    """Return text as str; undecodable bytes become U+FFFD (later dropped)."""
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    return text


def read_bytes(path: str, what: str) -> bytes:
    """Read a whole file, failing with a one-line message that names it and what to do (a
    FileNotFoundError when it is absent, a DataError when it is empty)."""
    if not files.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path} (check the path)")
    data = files.read_bytes(path)
    if not data:
        raise DataError(
            f"{what} is empty: {path} (0 bytes: a failed download or copy?); "
            "name a complete file, or copy it again"
        )
    return data


def file_fingerprint(kind: str, data: bytes, options: str) -> str:
    """Hash kind, file bytes and options with separators so fields can't collide."""
    digest = hashlib.sha256()
    for part in (kind.encode(), data, options.encode()):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Google's BasicTokenizer.


def _is_whitespace(char: str) -> bool:
    """Tab/newline/CR count as whitespace even though Unicode calls them Cc."""
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char: str) -> bool:
    """Any Unicode "C*" category, except the whitespace controls."""
    if char in "\t\n\r":
        return False
    return unicodedata.category(char).startswith("C")


# Per-character predicates are cached: classifying the same few hundred
# distinct characters over and over dominates tokenization time otherwise.
@functools.cache
def _is_punctuation(char: str) -> bool:
    """BERT's punctuation: non-alphanumeric printable ASCII, or Unicode "P*"."""
    cp = ord(char)
    if any(lo <= cp <= hi for lo, hi in _ASCII_PUNCT_RANGES):
        return True
    return unicodedata.category(char).startswith("P")


@functools.cache
def _is_cjk(char: str) -> bool:
    """True for the CJK ideographs the original splits one per token."""
    cp = ord(char)
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


@functools.cache
def _clean_char(char: str) -> str:
    """'' for NUL, U+FFFD and control chars, ' ' for whitespace, else the char."""
    if char in "\x00\ufffd" or _is_control(char):
        return ""
    return " " if _is_whitespace(char) else char


class _CleanTable(dict):
    """str.translate's table for `_clean_text`: each char as `_clean_char` leaves it, a CJK
    ideograph with a space on each side; filled with each distinct char when first seen."""

    def __missing__(self, codepoint: int) -> str:
        char = chr(codepoint)
        cleaned = _clean_char(char)
        self[codepoint] = f" {cleaned} " if cleaned and _is_cjk(char) else cleaned
        return self[codepoint]


_CLEAN_TABLE = _CleanTable()


def _clean_text(text: str) -> str:
    """Drop NUL, U+FFFD and control chars, turn every whitespace into ' ', and surround CJK
    ideographs with spaces so each becomes its own word (one pass over the text)."""
    return text.translate(_CLEAN_TABLE)


def _strip_accents(text: str) -> str:
    """Decompose and drop nonspacing marks: "é" -> "e"."""
    if text.isascii():  # ASCII has no accents; skipping NFD is a large speedup
        return text
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


def _split_on_punctuation(word: str) -> list[str]:
    """Make every punctuation char its own token: "a,b!" -> a , b !"""
    pieces: list[str] = []
    current: list[str] = []
    for char in word:
        if _is_punctuation(char):
            if current:
                pieces.append("".join(current))
                current = []
            pieces.append(char)
        else:
            current.append(char)
    if current:
        pieces.append("".join(current))
    return pieces


def _words(text: str | bytes) -> list[str]:
    """The cleaned text split on whitespace (before lower-casing and punctuation)."""
    # str.split (not _is_whitespace) is what the original splits on; it also
    # splits on U+2028/U+2029, which _clean_text keeps.
    return _clean_text(to_text(text)).split()


def _word_tokens(word: str, do_lower_case: bool, strip: bool) -> list[str]:
    """One whitespace-separated word lower-cased, stripped and split at punctuation."""
    if do_lower_case:
        word = word.lower()
    if strip:
        word = _strip_accents(word)
    # The original re-splits on whitespace here; lower()+NFD never create
    # whitespace, and an emptied word yields no pieces, so that is a no-op.
    return _split_on_punctuation(word)


def basic_tokenize(
    text: str | bytes, do_lower_case: bool = True, strip_accents: bool | None = None
) -> list[str]:
    """Google BERT's BasicTokenizer: clean, split CJK/whitespace/punctuation, normalize."""
    strip = do_lower_case if strip_accents is None else strip_accents
    tokens = []
    for word in _words(text):
        tokens.extend(_word_tokens(word, do_lower_case, strip))
    return tokens


# ---------------------------------------------------------------------------
# WordPiece.


def _parse_vocab(data: bytes, path: str) -> list[str]:
    """One token per '\\n'-terminated line, stripped, as Google's load_vocab."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"vocab file is not valid UTF-8: {path} ({e})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.strip() for line in lines]


class WordPieceTokenizer:
    """Google BERT's FullTokenizer (BasicTokenizer + WordpieceTokenizer) on a vocab.txt."""

    def __init__(
        self,
        vocab_file: str,
        do_lower_case: bool = True,
        strip_accents: bool | None = None,
        max_input_chars_per_word: int = 200,
    ) -> None:
        self._vocab_bytes = read_bytes(vocab_file, "vocab file")
        self._tokens = _parse_vocab(self._vocab_bytes, vocab_file)
        # Duplicate lines map to their last id, as dict assignment does in Google's load_vocab.
        self._ids = {token: i for i, token in enumerate(self._tokens)}
        missing = [t for t in SPECIAL_TOKENS if t not in self._ids]
        if missing:
            raise ValueError(f"vocab file {vocab_file} lacks special tokens {missing}")
        self.do_lower_case = do_lower_case
        self.strip_accents = do_lower_case if strip_accents is None else strip_accents
        self.max_input_chars_per_word = max_input_chars_per_word
        # No piece can match more chars than the longest vocab entry; bounding
        # the search by it keeps greedy matching linear-ish without changing results.
        self._longest_token = max(len(t) for t in self._tokens)
        self.vocab_size = len(self._tokens)
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self._ids[t] for t in SPECIAL_TOKENS
        )
        self._word_ids: dict[str, tuple[int, ...]] = {}  # encode's remembered words

    def _longest_match(self, word: str, start: int) -> int:
        """End of the longest vocab piece starting at word[start], or start if none."""
        prefix = "##" if start else ""
        for end in range(min(len(word), start + self._longest_token), start, -1):
            if prefix + word[start:end] in self._ids:
                return end
        return start

    def wordpiece(self, word: str) -> list[str]:
        """Greedy longest-match-first split of one word; [UNK] if it can't be split."""
        if len(word) > self.max_input_chars_per_word:
            return [UNK]
        pieces = []
        start = 0
        while start < len(word):
            end = self._longest_match(word, start)
            if end == start:
                return [UNK]
            pieces.append(("##" if start else "") + word[start:end])
            start = end
        return pieces

    def tokenize(self, text: str | bytes) -> list[str]:
        """Split text into WordPiece tokens exactly as Google's FullTokenizer."""
        tokens = []
        for word in basic_tokenize(text, self.do_lower_case, self.strip_accents):
            tokens.extend(self.wordpiece(word))
        return tokens

    def encode(self, text: str | bytes) -> list[int]:
        """Split text into token ids (each distinct word's ids are remembered: natural text
        repeats its words, so most are looked up, not split again)."""
        ids: list[int] = []
        remembered = self._word_ids
        for word in _words(text):
            found = remembered.get(word)
            if found is None:
                found = tuple(
                    self.convert_tokens_to_ids(
                        piece
                        for token in _word_tokens(word, self.do_lower_case, self.strip_accents)
                        for piece in self.wordpiece(token)
                    )
                )
                if len(remembered) < WORDS_REMEMBERED:
                    remembered[word] = found
            ids.extend(found)
        return ids

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_word_ids": {}}  # (sent to workers without what it saw)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Map tokens to ids; tokens not in the vocab map to unk_id."""
        return [self._ids.get(t, self.unk_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Map ids to tokens (the vocab line of each id)."""
        return [self._tokens[check_id(i, self.vocab_size)] for i in ids]

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True for '##' pieces, which continue the previous word."""
        return np.array([t.startswith("##") for t in self._tokens], dtype=bool)

    def special_ids(self) -> frozenset[int]:
        """Ids that must never be masked: [PAD] [CLS] [SEP] [MASK]."""
        return frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))

    def fingerprint(self) -> str:
        """Sha256 hex of the vocab bytes and every option that changes tokenization."""
        options = f"lower={self.do_lower_case},strip={self.strip_accents},maxchars={self.max_input_chars_per_word}"
        return file_fingerprint("wordpiece", self._vocab_bytes, options)


def check_id(i: int, vocab_size: int) -> int:
    """Reject ids outside the vocab (negative ids would silently wrap)."""
    if not 0 <= i < vocab_size:
        raise IndexError(f"token id {i} out of range [0, {vocab_size})")
    return int(i)
