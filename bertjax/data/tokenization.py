"""Tokenizers for BERT: Google's WordPiece reproduced exactly (`data.wordpiece`),
SentencePiece (here) and a Hugging Face BPE tokenizer.json (`data.bpe`). All implement the
small `Tokenizer` protocol the data pipeline relies on.

CLI:
  python -m bertjax.data.tokenization train --input=a.txt,b.txt --model_prefix=out/sp \
      --vocab_size=32000 [--lowercase]
  python -m bertjax.data.tokenization tokenize --kind=wordpiece --vocab=vocab.txt --text="Hello!"
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import sentencepiece as spm
from absl import logging
from sentencepiece import sentencepiece_model_pb2

from bertjax.data import bpe, hf_json
from bertjax.data.errors import DataError
from bertjax.data.wordpiece import (  # noqa: F401 (the tokenizers and tokens, in one place)
    CLS,
    MASK,
    PAD,
    SEP,
    SPECIAL_TOKENS,
    UNK,
    WordPieceTokenizer,
    basic_tokenize,
    check_id,
    file_fingerprint,
    read_bytes,
    to_text,
)
from bertjax.runtime import console, files

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


# ---------------------------------------------------------------------------
# SentencePiece.


class SentencePieceTokenizer:
    """A SentencePiece model with BERT's special tokens ([PAD] [UNK] [CLS] [SEP] [MASK])."""

    def __init__(self, model_file: str) -> None:
        self._model_bytes = read_bytes(model_file, "sentencepiece model")
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
        return self._sp.encode(to_text(text), out_type=str)

    def encode(self, text: str | bytes) -> list[int]:
        """Split text into piece ids."""
        return self._sp.encode(to_text(text), out_type=int)

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int]:
        """Map pieces to ids; unknown pieces map to unk_id."""
        return [self._sp.piece_to_id(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Map ids to pieces."""
        return [self._sp.id_to_piece(check_id(i, self.vocab_size)) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenize ids back to (normalized) text."""
        return self._sp.decode(list(ids))

    def continuation_mask(self) -> np.ndarray:
        """Bool [vocab_size]: True for normal pieces without the '▁' word-start marker."""
        special = self.special_ids()
        mask = np.zeros(self.vocab_size, dtype=bool)
        for i in range(self.vocab_size):
            if (
                i in special
                or self._sp.is_control(i)
                or self._sp.is_unknown(i)
                or self._sp.is_unused(i)
            ):
                continue
            mask[i] = not self._sp.id_to_piece(i).startswith("▁")
        return mask

    def special_ids(self) -> frozenset[int]:
        """Ids that must never be masked: [PAD] [CLS] [SEP] [MASK]."""
        return frozenset((self.pad_id, self.cls_id, self.sep_id, self.mask_id))

    def model_proto(self) -> bytes:
        """The serialized SentencePiece model (pieces, scores, normalization rules)."""
        return self._model_bytes

    def fingerprint(self) -> str:
        """Sha256 hex of the model (pieces, normalization rules, trainer options) without the
        paths it was trained from and to, so a retrained identical model keeps its identity."""
        proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # (generated, no stubs)
        proto.ParseFromString(self._model_bytes)
        proto.trainer_spec.ClearField("model_prefix")
        proto.trainer_spec.ClearField("input")
        return file_fingerprint("sentencepiece", proto.SerializeToString(deterministic=True), "")


def _nonblank(sentences: Iterable[str], counts: dict[str, int], max_bytes: int) -> Iterator[str]:
    """Yield non-blank sentences, counting them (an empty corpus gets a clear error) and those
    over `max_bytes` of UTF-8, which SentencePiece leaves out of training."""
    for sentence in sentences:
        if sentence.strip():
            counts["sentences"] += 1
            counts["too_long"] += len(sentence.encode("utf-8")) > max_bytes
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
    counts = {"sentences": 0, "too_long": 0}
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_nonblank(sentences, counts, max_sentence_length),
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
            minloglevel=2,  # errors only: its one warning, long lines skipped, is counted below
        )
    except RuntimeError as e:
        if counts["sentences"] == 0:
            raise ValueError("no non-blank sentences to train sentencepiece on") from None
        raise ValueError(f"sentencepiece training failed: {str(e).strip()}") from None
    made = spm.SentencePieceProcessor(model_file=model_prefix + ".model").vocab_size()
    if made < vocab_size:
        logging.info(
            "SentencePiece: asked for %d pieces, made %d: the corpus holds too few "
            "distinct pieces for more (a larger corpus gives more; ids from %d up are "
            "never used)",
            vocab_size,
            made,
            made,
        )
    if counts["too_long"]:
        logging.warning(
            "SentencePiece left %d of %d lines longer than %d bytes out of learning "
            "its vocabulary (the data pipeline still tokenizes them)",
            counts["too_long"],
            counts["sentences"],
            max_sentence_length,
        )
    return model_prefix + ".model"


def load_tokenizer(
    kind: str,
    path: str,
    do_lower_case: bool = True,
    strip_accents: bool | None = None,
    max_input_chars_per_word: int = 200,
    flag_prefix: str = "data.",
) -> Tokenizer:
    """Build a tokenizer; case options and the word limit apply to WordPiece from a vocab.txt
    (SentencePiece models and tokenizer.json files carry their own: a WordPiece
    tokenizer.json's casing must agree with `do_lower_case`). A file of another kind than
    `kind` is refused in one line naming its kind (`flag_prefix`: where the entry point's
    `tokenizer` and `do_lower_case` fields are, for that line)."""
    if kind not in ("wordpiece", "sentencepiece", "bpe"):
        raise ValueError(
            f"unknown tokenizer kind {kind!r}; expected 'wordpiece', 'sentencepiece' or 'bpe'"
        )
    found, what = _file_kind(path)
    if found is not None and found != kind:
        raise DataError(f"{path} is {what}: use {flag_prefix}tokenizer={found}")
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    if kind == "bpe":
        return bpe.BpeTokenizer(path)
    if what == WORDPIECE_JSON:
        vocab, casing = hf_json.wordpiece_vocab(path)
        if do_lower_case != casing.do_lower_case:
            raise DataError(
                f"{path} is {'un' if casing.do_lower_case else ''}cased but "
                f"do_lower_case={do_lower_case}; set {flag_prefix}do_lower_case="
                f"{casing.do_lower_case}"
            )
        return WordPieceTokenizer(vocab, **casing._asdict())
    return WordPieceTokenizer(
        path,
        do_lower_case=do_lower_case,
        strip_accents=strip_accents,
        max_input_chars_per_word=max_input_chars_per_word,
    )


WORDPIECE_JSON = "a WordPiece tokenizer.json"


def file_kind(path: str) -> str | None:
    """The tokenizer kind of a file by its content ("wordpiece": a vocab.txt or a WordPiece
    tokenizer.json, "sentencepiece", "bpe": a BPE tokenizer.json); None if not recognised."""
    return _file_kind(path)[0]


def _file_kind(path: str) -> tuple[str | None, str]:
    """`file_kind` and the file's description ("a WordPiece vocab.txt", ...)."""
    if files.isdir(path):
        raise DataError(
            f"{path} is a directory: name the tokenizer file in it (a vocab.txt, "
            "tokenizer.json or SentencePiece .model)"
        )
    data = read_bytes(path, "tokenizer file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        try:
            spm.SentencePieceProcessor(model_proto=data)
            return "sentencepiece", "a SentencePiece model"
        except (RuntimeError, OSError, ValueError):
            return None, ""
    if text.lstrip().startswith("{"):
        model = hf_json.read(path)[1]["model"]["type"]
        return {"WordPiece": "wordpiece", "BPE": "bpe"}.get(model), f"a {model} tokenizer.json"
    if UNK in text.splitlines():
        return "wordpiece", "a WordPiece vocab.txt"
    return None, ""


# ---------------------------------------------------------------------------
# CLI.


def _read_lines(paths: Sequence[str]) -> Iterator[str]:
    """Stream stripped lines of UTF-8 text files, bad bytes replaced."""
    for path in paths:
        with files.open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                yield line.strip()


def _cmd_train(args: argparse.Namespace) -> None:
    """Train a SentencePiece model on text files."""
    paths = [p for p in args.input.split(",") if p]
    if not paths:
        raise ValueError("--input names no files")
    for path in paths:
        # Check up front: an error raised inside the trainer's iterator loses its message.
        if not files.isfile(path):
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
    console.say(f"wrote {model} and {args.model_prefix}.vocab ({vocab_size} pieces)")


def _cmd_tokenize(args: argparse.Namespace) -> None:
    """Print the tokens and ids of one text."""
    tokenizer = load_tokenizer(
        args.kind, args.vocab, do_lower_case=not args.cased, flag_prefix="--"
    )
    tokens = tokenizer.tokenize(args.text)
    console.say(" ".join(tokens))
    console.say(" ".join(map(str, tokenizer.convert_tokens_to_ids(tokens))))


def _parser() -> argparse.ArgumentParser:
    """Argument parser with the train and tokenize subcommands."""
    parser = argparse.ArgumentParser(
        prog="python -m bertjax.data.tokenization", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a SentencePiece model on text files")
    train.add_argument(
        "--input", required=True, help="comma-separated UTF-8 text files, one sentence per line"
    )
    train.add_argument("--model_prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    train.add_argument("--vocab_size", required=True, type=int)
    train.add_argument("--model_type", default="unigram", choices=_SP_MODEL_TYPES)
    train.add_argument("--character_coverage", default=0.9999, type=float)
    train.add_argument(
        "--lowercase", action="store_true", help="case-fold (nmt_nfkc_cf normalization)"
    )
    train.set_defaults(run=_cmd_train)
    tok = sub.add_parser("tokenize", help="print the tokens and ids of a text")
    tok.add_argument(
        "--kind", "--tokenizer", default="wordpiece", choices=("wordpiece", "sentencepiece", "bpe")
    )
    tok.add_argument(
        "--vocab",
        required=True,
        help="vocab.txt or tokenizer.json (wordpiece), .model (sentencepiece) or "
        "tokenizer.json (bpe)",
    )
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
        console.error(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
