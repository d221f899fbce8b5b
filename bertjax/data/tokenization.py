"""Tokenizers for BERT: Google's WordPiece reproduced exactly, and SentencePiece.

Both implement the small `Tokenizer` protocol the data pipeline relies on.

CLI:
  python -m bertjax.data.tokenization train --input=a.txt,b.txt --model_prefix=out/sp \
      --vocab_size=32000 [--lowercase]
  python -m bertjax.data.tokenization tokenize --kind=wordpiece --vocab=vocab.txt --text="Hello!"
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
import unicodedata
from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2

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

_SP_MODEL_TYPES = ("unigram", "bpe", "char", "word")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and checkpoints need from a tokenizer."""

    vocab_size: int
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int

    def tokenize(self, text: str) -> list[str]:
        """Split text into vocabulary tokens."""

    def encode(self, text: str) -> list[int]:
        """Split text into token ids."""

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Map tokens to ids; unknown tokens map to unk_id."""

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Map ids to tokens."""

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True where a token continues the previous word."""

    def special_ids(self) -> frozenset[int]:
        """Ids that must never be masked: [PAD] [CLS] [SEP] [MASK]."""

    def fingerprint(self) -> str:
        """Sha256 hex of the vocabulary and options."""


def _to_text(text: str | bytes) -> str:
    """Return text as str; undecodable bytes become U+FFFD (later dropped)."""
    if isinstance(text, bytes):
        return text.decode("utf-8", errors="replace")
    return text


def _read_bytes(path: str, what: str) -> bytes:
    """Read a whole file, failing with a message that names it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} not found: {path}")
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        raise ValueError(f"{what} is empty: {path}")
    return data


def _fingerprint(kind: str, data: bytes, options: str) -> str:
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


def _clean_text(text: str) -> str:
    """Drop NUL, U+FFFD and control chars; turn every whitespace into ' '."""
    return "".join(map(_clean_char, text))


def _space_cjk(text: str) -> str:
    """Surround CJK ideographs with spaces so each becomes its own word."""
    return "".join(f" {c} " if _is_cjk(c) else c for c in text)


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


def basic_tokenize(text: str | bytes, do_lower_case: bool = True, strip_accents: bool | None = None) -> list[str]:
    """Google BERT's BasicTokenizer: clean, split CJK/whitespace/punctuation, normalize."""
    strip = do_lower_case if strip_accents is None else strip_accents
    tokens = []
    # str.split (not _is_whitespace) is what the original splits on; it also
    # splits on U+2028/U+2029, which _clean_text keeps.
    for word in _space_cjk(_clean_text(_to_text(text))).split():
        if do_lower_case:
            word = word.lower()
        if strip:
            word = _strip_accents(word)
        # The original re-splits on whitespace here; lower()+NFD never create
        # whitespace, and an emptied word yields no pieces, so that is a no-op.
        tokens.extend(_split_on_punctuation(word))
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
        self._vocab_bytes = _read_bytes(vocab_file, "vocab file")
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
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (self._ids[t] for t in SPECIAL_TOKENS)

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
        """Split text into token ids."""
        return self.convert_tokens_to_ids(self.tokenize(text))

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Map tokens to ids; tokens not in the vocab map to unk_id."""
        return [self._ids.get(t, self.unk_id) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Map ids to tokens (the vocab line of each id)."""
        return [self._tokens[_check_id(i, self.vocab_size)] for i in ids]

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True for '##' pieces, which continue the previous word."""
        return np.array([t.startswith("##") for t in self._tokens], dtype=bool)

    def special_ids(self) -> frozenset[int]:
        """Ids that must never be masked: [PAD] [CLS] [SEP] [MASK]."""
        return frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))

    def fingerprint(self) -> str:
        """Sha256 hex of the vocab bytes and every option that changes tokenization."""
        options = f"lower={self.do_lower_case},strip={self.strip_accents},maxchars={self.max_input_chars_per_word}"
        return _fingerprint("wordpiece", self._vocab_bytes, options)


def _check_id(i: int, vocab_size: int) -> int:
    """Reject ids outside the vocab (negative ids would silently wrap)."""
    if not 0 <= i < vocab_size:
        raise IndexError(f"token id {i} out of range [0, {vocab_size})")
    return int(i)


# ---------------------------------------------------------------------------
# SentencePiece.


class SentencePieceTokenizer:
    """A SentencePiece model with BERT's special tokens ([PAD] [UNK] [CLS] [SEP] [MASK])."""

    def __init__(self, model_file: str) -> None:
        self._model_bytes = _read_bytes(model_file, "sentencepiece model")
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self._model_bytes)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"not a sentencepiece model: {model_file} ({e})") from None
        self.vocab_size = self._sp.vocab_size()
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (
            self._special_id(t, model_file) for t in SPECIAL_TOKENS
        )

    def _special_id(self, piece: str, model_file: str) -> int:
        """Id of a special piece; piece_to_id returns unk_id for absent pieces, so verify."""
        i = self._sp.piece_to_id(piece)
        if self._sp.id_to_piece(i) != piece:
            raise ValueError(f"sentencepiece model {model_file} lacks special piece {piece}")
        return i

    def tokenize(self, text: str | bytes) -> list[str]:
        """Split text into pieces (unknown characters come back as their surface text)."""
        return self._sp.encode(_to_text(text), out_type=str)

    def encode(self, text: str | bytes) -> list[int]:
        """Split text into piece ids."""
        return self._sp.encode(_to_text(text), out_type=int)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Map pieces to ids; unknown pieces map to unk_id."""
        return [self._sp.piece_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Map ids to pieces."""
        return [self._sp.id_to_piece(_check_id(i, self.vocab_size)) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenize ids back to (normalized) text."""
        return self._sp.decode(list(ids))

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True for normal pieces without the '▁' word-start marker."""
        special = self.special_ids()
        mask = np.zeros(self.vocab_size, dtype=bool)
        for i in range(self.vocab_size):
            if i in special or self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_unused(i):
                continue
            mask[i] = not self._sp.id_to_piece(i).startswith("▁")
        return mask

    def special_ids(self) -> frozenset[int]:
        """Ids that must never be masked: [PAD] [CLS] [SEP] [MASK]."""
        return frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))

    def fingerprint(self) -> str:
        """Sha256 hex of the model (pieces, normalization rules, trainer options) without the
        paths it was trained from and to, so a retrained identical model keeps its identity."""
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._model_bytes)
        proto.trainer_spec.ClearField("model_prefix")
        proto.trainer_spec.ClearField("input")
        return _fingerprint("sentencepiece", proto.SerializeToString(deterministic=True), "")


def _nonblank(sentences: Iterable[str], counter: list[int]) -> Iterator[str]:
    """Yield non-blank sentences, counting them so an empty corpus gets a clear error."""
    for sentence in sentences:
        if sentence.strip():
            counter[0] += 1
            yield sentence


def train_sentencepiece(
    sentences: Iterable[str],
    model_prefix: str,
    vocab_size: int,
    model_type: str = "unigram",
    character_coverage: float = 0.9999,
    do_lower_case: bool = False,
    seed: int = 0,
    num_threads: int = 1,
    max_sentence_length: int = 16384,
    max_sentences: int = 10_000_000,
) -> str:
    """Train a SentencePiece model with BERT's special ids 0..4; return the .model path.

    Corpora of more than `max_sentences` sentences are sampled (seeded), which bounds memory.
    """
    if model_type not in _SP_MODEL_TYPES:
        raise ValueError(f"model_type must be one of {_SP_MODEL_TYPES}, got {model_type!r}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed {len(SPECIAL_TOKENS)}, got {vocab_size}")
    if os.path.dirname(model_prefix):
        os.makedirs(os.path.dirname(model_prefix), exist_ok=True)
    counter = [0]
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_nonblank(sentences, counter),
            model_prefix=model_prefix,
            vocab_size=vocab_size,
            model_type=model_type,
            character_coverage=character_coverage,
            normalization_rule_name="nmt_nfkc_cf" if do_lower_case else "nmt_nfkc",
            pad_id=0,
            unk_id=1,
            bos_id=-1,
            eos_id=-1,
            pad_piece=PAD,
            unk_piece=UNK,
            # Unlike WordPiece, literal "[MASK]" etc. in raw text then encode to the special id.
            user_defined_symbols=[CLS, SEP, MASK],
            # A small corpus may not support vocab_size pieces; take fewer instead of failing.
            hard_vocab_limit=False,
            # Multi-threaded EM sums in a nondeterministic order, changing the vocab run to run.
            num_threads=num_threads,
            # Paragraph-per-line corpora exceed the 4192-byte default, which silently drops them.
            max_sentence_length=max_sentence_length,
            input_sentence_size=max_sentences,
            shuffle_input_sentence=True,
            minloglevel=1,
        )
    except RuntimeError as e:
        if counter[0] == 0:
            raise ValueError("no non-blank sentences to train sentencepiece on") from None
        raise ValueError(f"sentencepiece training failed: {str(e).strip()}") from None
    return model_prefix + ".model"


def load_tokenizer(
    kind: str, path: str, do_lower_case: bool = True, strip_accents: bool | None = None
) -> Tokenizer:
    """Build a tokenizer; case options apply to WordPiece (SentencePiece models carry their own)."""
    if kind == "wordpiece":
        return WordPieceTokenizer(path, do_lower_case=do_lower_case, strip_accents=strip_accents)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected 'wordpiece' or 'sentencepiece'")


# ---------------------------------------------------------------------------
# CLI.


def _read_lines(paths: Sequence[str]) -> Iterator[str]:
    """Stream stripped lines of UTF-8 text files, bad bytes replaced."""
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                yield line.strip()


def _cmd_train(args: argparse.Namespace) -> None:
    """Train a SentencePiece model on text files."""
    paths = [p for p in args.input.split(",") if p]
    if not paths:
        raise ValueError("--input names no files")
    for path in paths:
        # Check up front: an error raised inside the trainer's iterator loses its message.
        if not os.path.isfile(path):
            raise FileNotFoundError(f"input file not found: {path}")
    model = train_sentencepiece(
        _read_lines(paths),
        args.model_prefix,
        args.vocab_size,
        model_type=args.model_type,
        character_coverage=args.character_coverage,
        do_lower_case=args.lowercase,
    )
    vocab_size = SentencePieceTokenizer(model).vocab_size
    print(f"wrote {model} and {args.model_prefix}.vocab ({vocab_size} pieces)")


def _cmd_tokenize(args: argparse.Namespace) -> None:
    """Print the tokens and ids of one text."""
    tokenizer = load_tokenizer(args.kind, args.vocab, do_lower_case=not args.cased)
    tokens = tokenizer.tokenize(args.text)
    print(" ".join(tokens))
    print(" ".join(map(str, tokenizer.convert_tokens_to_ids(tokens))))


def _parser() -> argparse.ArgumentParser:
    """Argument parser with the train and tokenize subcommands."""
    parser = argparse.ArgumentParser(prog="python -m bertjax.data.tokenization", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a SentencePiece model on text files")
    train.add_argument("--input", required=True, help="comma-separated UTF-8 text files, one sentence per line")
    train.add_argument("--model_prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--vocab_size", required=True, type=int)
    train.add_argument("--model_type", default="unigram", choices=_SP_MODEL_TYPES)
    train.add_argument("--character_coverage", default=0.9999, type=float)
    train.add_argument("--lowercase", action="store_true", help="case-fold (nmt_nfkc_cf normalization)")
    train.set_defaults(run=_cmd_train)
    tok = sub.add_parser("tokenize", help="print the tokens and ids of a text")
    tok.add_argument("--kind", default="wordpiece", choices=("wordpiece", "sentencepiece"))
    tok.add_argument("--vocab", required=True, help="vocab.txt (wordpiece) or .model (sentencepiece)")
    tok.add_argument("--text", required=True)
    tok.add_argument("--cased", action="store_true", help="wordpiece: keep case and accents")
    tok.set_defaults(run=_cmd_tokenize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user errors print one line and return 2."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
