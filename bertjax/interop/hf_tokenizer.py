"""The tokenizer files of a Hugging Face export, so that `transformers.AutoTokenizer
.from_pretrained(DIR)` gives bertjax's token ids. A `tokenizer.json` built with the
`tokenizers` library (a dependency of bertjax, as of transformers) holds either tokenizer:
WordPiece as Google's BasicTokenizer + WordpieceTokenizer (same casing, accent stripping and
200-character word limit), SentencePiece as a Unigram model from the `.model` (pieces, scores,
the model's own normalization rules, whitespace handling and dummy prefix); both with BERT's
`[CLS] A [SEP] B [SEP]` template. WordPiece also gets `vocab.txt`. One known difference: raw
text that spells a special token (`[MASK]`) is that token for transformers, while SentencePiece
puts a `▁` piece before it.

The other way (`tokenizer_file`, `json_tokenizer_file`): the tokenizer beside a Google or
Hugging Face checkpoint, including a `tokenizer.json` alone (read as transformers reads it:
`data.hf_json`), of Google's WordPiece form (read as bertjax's WordPiece, cased as transformers
would), BPE, or the Unigram form written here."""

from __future__ import annotations

import base64
import os
import re

import tokenizers as tk
from sentencepiece import sentencepiece_model_pb2

from bertjax.data import bpe, hf_json
from bertjax.data.tokenization import (
    CLS,
    MASK,
    PAD,
    SEP,
    UNK,
    SentencePieceTokenizer,
    Tokenizer,
    WordPieceTokenizer,
)
from bertjax.interop import tree
from bertjax.runtime import files

SPECIAL_TOKENS = {
    "pad_token": PAD,
    "unk_token": UNK,
    "cls_token": CLS,
    "sep_token": SEP,
    "mask_token": MASK,
}
# SentencePiece models beside a checkpoint: bertjax's and transformers' usual names.
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type
SPECIAL_PIECE_TYPES = (2, 3, 4)  # unknown, control, user-defined


def _sentencepiece_model(tokenizer: SentencePieceTokenizer) -> tk.Tokenizer:
    """The `tokenizers` Unigram tokenizer (no template yet) of a SentencePiece model."""
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # (generated, no stubs)
    proto.ParseFromString(tokenizer.model_proto())
    if proto.trainer_spec.model_type != UNIGRAM:
        raise tree.ConversionError(
            "only unigram SentencePiece models have a tokenizer.json "
            "form here (this one is not unigram)"
        )
    hf = tk.Tokenizer(
        tk.models.Unigram(
            [(p.piece, p.score) for p in proto.pieces],
            unk_id=proto.trainer_spec.unk_id,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    steps: list[tk.normalizers.Normalizer] = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(tk.normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [
            tk.normalizers.Strip(left=True, right=True),
            tk.normalizers.Replace(tk.Regex(" {2,}"), " "),
        ]
    hf.normalizer = tk.normalizers.Sequence(steps)
    scheme = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    hf.pre_tokenizer = tk.pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme=scheme, split=proto.trainer_spec.split_by_whitespace
    )
    hf.decoder = tk.decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    hf.add_special_tokens(
        [
            tk.AddedToken(p.piece, normalized=False, special=True)
            for p in proto.pieces
            if p.type in SPECIAL_PIECE_TYPES
        ]
    )
    return hf


def _wordpiece_model(tokenizer: WordPieceTokenizer) -> tk.Tokenizer:
    """The `tokenizers` WordPiece tokenizer (no template yet) of Google's tokenizer."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    hf = tk.Tokenizer(
        tk.models.WordPiece(
            {token: i for i, token in enumerate(tokens)},
            unk_token=UNK,
            max_input_chars_per_word=tokenizer.max_input_chars_per_word,
        )
    )
    hf.normalizer = tk.normalizers.BertNormalizer(
        clean_text=True,
        handle_chinese_chars=True,
        strip_accents=tokenizer.strip_accents,
        lowercase=tokenizer.do_lower_case,
    )
    hf.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    hf.decoder = tk.decoders.WordPiece(prefix="##")
    hf.add_special_tokens(
        [tk.AddedToken(token, normalized=False, special=True) for token in SPECIAL_TOKENS.values()]
    )
    return hf


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """The `tokenizers` tokenizer.json that tokenizes as `tokenizer` does."""
    if isinstance(tokenizer, WordPieceTokenizer):
        hf = _wordpiece_model(tokenizer)
    else:
        assert isinstance(tokenizer, SentencePieceTokenizer)  # (save_tokenizer's other kind)
        hf = _sentencepiece_model(tokenizer)
    hf.post_processor = tk.processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, tokenizer.cls_id), (SEP, tokenizer.sep_id)],
    )
    return hf.to_str(pretty=True)


def save_vocab(tokenizer: WordPieceTokenizer, path: str) -> list[str]:
    """Writes the WordPiece vocabulary as `vocab.txt` (one token a line, in id order)."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    with files.open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in tokens))
    return ["vocab.txt"]


def save_tokenizer(
    tokenizer: Tokenizer, path: str, model_max_length: int, token_type_ids: bool
) -> list[str]:
    """Writes the tokenizer files for `AutoTokenizer` into `path`; returns their names (a BPE
    tokenizer.json is written as it was read). `token_type_ids`: whether the model takes them
    (BERT does, ModernBERT not), for tokenizer_config.json's `model_input_names`."""
    if not isinstance(tokenizer, (WordPieceTokenizer, SentencePieceTokenizer, bpe.BpeTokenizer)):
        raise tree.ConversionError(f"no Hugging Face form for a {type(tokenizer).__name__}")
    byte_level = isinstance(tokenizer, bpe.BpeTokenizer)
    config: dict = {
        **SPECIAL_TOKENS,
        "model_max_length": model_max_length,
        "model_input_names": [
            "input_ids",
            *(["token_type_ids"] if token_type_ids else []),
            "attention_mask",
        ],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if isinstance(tokenizer, bpe.BpeTokenizer):
        names = bpe.save(tokenizer, path)
    elif isinstance(tokenizer, WordPieceTokenizer):
        names = save_vocab(tokenizer, path)
        config.update(do_lower_case=tokenizer.do_lower_case, strip_accents=tokenizer.strip_accents)
    else:  # the model itself too, from which bertjax reads it back exactly
        names = [SENTENCEPIECE_FILES[0]]
        with files.open(os.path.join(path, names[0]), "wb") as f:
            f.write(tokenizer.model_proto())
    if not byte_level:
        with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(tokenizer_json(tokenizer))
        names.append("tokenizer.json")
    tree.write_json(os.path.join(path, "tokenizer_config.json"), config)
    tree.write_json(os.path.join(path, "special_tokens_map.json"), SPECIAL_TOKENS)
    return [*names, "tokenizer_config.json", "special_tokens_map.json"]


def tokenizer_file(directory: str) -> tuple[str, str, hf_json.Casing | None]:
    """The tokenizer bertjax reads in a Google TF or Hugging Face checkpoint directory, as
    `(kind, path, casing)`: the WordPiece `vocab.txt`, else a SentencePiece model
    (`SENTENCEPIECE_FILES`), else its `tokenizer.json` (`json_tokenizer_file`). Raises
    ConversionError saying what it looked for."""
    for kind, names in (("wordpiece", ("vocab.txt",)), ("sentencepiece", SENTENCEPIECE_FILES)):
        for name in names:
            if files.isfile(os.path.join(directory, name)):
                return kind, os.path.join(directory, name), None
    json_path = os.path.join(directory, "tokenizer.json")
    if files.isfile(json_path):
        return json_tokenizer_file(json_path)
    raise tree.ConversionError(
        f"no tokenizer in {directory}: bertjax looks for vocab.txt, "
        f"tokenizer.json or a SentencePiece model "
        f"({', '.join(SENTENCEPIECE_FILES)})"
    )


def json_tokenizer_file(path: str) -> tuple[str, str, hf_json.Casing | None]:
    """`(kind, path, casing)` of a `tokenizer.json`: one of Google's WordPiece form as a
    `vocab.txt` rebuilt from it (`casing`: the json's), the Unigram form bertjax exports as a
    SentencePiece model, a BPE one as it is (kind "bpe": ModernBERT's, read by the tokenizers
    library). Raises ConversionError or DataError naming what it is instead."""
    spec = hf_json.read(path)[1]
    model = spec["model"]["type"]
    if model == "WordPiece":
        return "wordpiece", *hf_json.wordpiece_vocab(path)
    if model == "BPE":
        return "bpe", path, None
    proto = _unigram_proto(spec) if model == "Unigram" else None
    if proto is not None:
        return "sentencepiece", hf_json.temporary_file(SENTENCEPIECE_FILES[0], proto), None
    raise tree.ConversionError(
        f"{path} is a {model} tokenizer.json of a form bertjax cannot reproduce: it reads "
        f"vocab.txt (WordPiece), a SentencePiece model ({', '.join(SENTENCEPIECE_FILES)}) or a "
        "WordPiece, BPE or (bertjax's) Unigram tokenizer.json"
    )


def _unigram_proto(spec: dict) -> bytes | None:
    """The SentencePiece model of a Unigram tokenizer.json in the form `tokenizer_json`
    writes (the inverse of `_sentencepiece_model`); None for any other form."""
    steps = (spec.get("normalizer") or {}).get("normalizers", [])
    pre = spec.get("pre_tokenizer") or {}
    if (
        pre.get("type") != "Metaspace"
        or pre.get("prepend_scheme") not in ("always", "never")
        or any(
            s.get("type") not in ("Precompiled", "Strip", "Replace")
            or (
                s["type"] == "Replace"
                and (s.get("pattern"), s.get("content")) != ({"Regex": " {2,}"}, " ")
            )
            for s in steps
        )
    ):
        return None
    model, added = spec["model"], {t["content"] for t in spec.get("added_tokens", [])}
    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # (generated, no stubs)
    for i, (piece, score) in enumerate(model["vocab"]):
        kind = (
            2
            if i == model["unk_id"]
            else 3
            if piece == PAD
            else 4
            if piece in added
            else 6
            if model.get("byte_fallback") and re.fullmatch(r"<0x[0-9A-F]{2}>", piece)
            else 1
        )
        proto.pieces.add(piece=piece, score=score, type=kind)
    pieces = [p.piece for p in proto.pieces]
    proto.trainer_spec.model_type = UNIGRAM
    proto.trainer_spec.vocab_size = len(pieces)
    proto.trainer_spec.unk_id = model["unk_id"]
    proto.trainer_spec.unk_piece = pieces[model["unk_id"]]
    proto.trainer_spec.pad_id = pieces.index(PAD) if PAD in pieces else -1
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = -1
    proto.trainer_spec.byte_fallback = bool(model.get("byte_fallback"))
    proto.trainer_spec.split_by_whitespace = bool(pre.get("split", True))
    charsmap = [s["precompiled_charsmap"] for s in steps if s["type"] == "Precompiled"]
    proto.normalizer_spec.name = "nmt_nfkc" if charsmap else "identity"
    if charsmap and charsmap[0]:
        proto.normalizer_spec.precompiled_charsmap = base64.b64decode(charsmap[0])
    proto.normalizer_spec.add_dummy_prefix = pre["prepend_scheme"] == "always"
    proto.normalizer_spec.remove_extra_whitespaces = any(s["type"] == "Strip" for s in steps)
    return proto.SerializeToString()
