"""The tokenizer files of a Hugging Face export, so that `transformers.AutoTokenizer
.from_pretrained(DIR)` gives bertjax's token ids. A `tokenizer.json` built with the
`tokenizers` library (a dependency of bertjax, as of transformers) holds either tokenizer:
WordPiece as Google's BasicTokenizer + WordpieceTokenizer (same casing, accent stripping and
200-character word limit), SentencePiece as a Unigram model from the `.model` (pieces, scores,
the model's own normalization rules, whitespace handling and dummy prefix); both with BERT's
`[CLS] A [SEP] B [SEP]` template. WordPiece also gets `vocab.txt`. One known difference: raw
text that spells a special token (`[MASK]`) is that token for transformers, while SentencePiece
puts a `▁` piece before it."""
from __future__ import annotations

import atexit
import base64
import json
import os
import re
import shutil
import tempfile

import tokenizers as tk
from sentencepiece import sentencepiece_model_pb2

from bertjax import files
from bertjax.data.tokenization import (CLS, MASK, PAD, SEP, UNK, SentencePieceTokenizer,
                                       Tokenizer, WordPieceTokenizer)
from bertjax.interop import tree

SPECIAL_TOKENS = {"pad_token": PAD, "unk_token": UNK, "cls_token": CLS, "sep_token": SEP,
                  "mask_token": MASK}
# SentencePiece models beside a checkpoint: bertjax's and transformers' usual names.
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type
SPECIAL_PIECE_TYPES = (2, 3, 4)  # unknown, control, user-defined


def _sentencepiece_model(tokenizer: SentencePieceTokenizer) -> tk.Tokenizer:
    """The `tokenizers` Unigram tokenizer (no template yet) of a SentencePiece model."""
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tokenizer.model_proto())
    if proto.trainer_spec.model_type != UNIGRAM:
        raise tree.ConversionError("only unigram SentencePiece models have a tokenizer.json "
                                   "form here (this one is not unigram)")
    hf = tk.Tokenizer(tk.models.Unigram([(p.piece, p.score) for p in proto.pieces],
                                        unk_id=proto.trainer_spec.unk_id,
                                        byte_fallback=proto.trainer_spec.byte_fallback))
    steps = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(tk.normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [tk.normalizers.Strip(left=True, right=True),
                  tk.normalizers.Replace(tk.Regex(" {2,}"), " ")]
    hf.normalizer = tk.normalizers.Sequence(steps)
    scheme = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    hf.pre_tokenizer = tk.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                   split=proto.trainer_spec.split_by_whitespace)
    hf.decoder = tk.decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    hf.add_special_tokens([tk.AddedToken(p.piece, normalized=False, special=True)
                           for p in proto.pieces if p.type in SPECIAL_PIECE_TYPES])
    return hf


def _wordpiece_model(tokenizer: WordPieceTokenizer) -> tk.Tokenizer:
    """The `tokenizers` WordPiece tokenizer (no template yet) of Google's tokenizer."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    hf = tk.Tokenizer(tk.models.WordPiece(
        {token: i for i, token in enumerate(tokens)}, unk_token=UNK,
        max_input_chars_per_word=tokenizer.max_input_chars_per_word))
    hf.normalizer = tk.normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=tokenizer.strip_accents,
        lowercase=tokenizer.do_lower_case)
    hf.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    hf.decoder = tk.decoders.WordPiece(prefix="##")
    hf.add_special_tokens([tk.AddedToken(token, normalized=False, special=True)
                           for token in SPECIAL_TOKENS.values()])
    return hf


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """The `tokenizers` tokenizer.json that tokenizes as `tokenizer` does."""
    build = _wordpiece_model if isinstance(tokenizer, WordPieceTokenizer) else \
        _sentencepiece_model
    hf = build(tokenizer)
    hf.post_processor = tk.processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, tokenizer.cls_id), (SEP, tokenizer.sep_id)])
    return hf.to_str(pretty=True)


def save_vocab(tokenizer: WordPieceTokenizer, path: str) -> list[str]:
    """Writes the WordPiece vocabulary as `vocab.txt` (one token a line, in id order)."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    with files.open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in tokens))
    return ["vocab.txt"]


def save_tokenizer(tokenizer: Tokenizer, path: str, model_max_length: int) -> list[str]:
    """Writes the tokenizer files for `AutoTokenizer` into `path`; returns their names."""
    if not isinstance(tokenizer, (WordPieceTokenizer, SentencePieceTokenizer)):
        raise tree.ConversionError(f"no Hugging Face form for a {type(tokenizer).__name__}")
    config: dict = {**SPECIAL_TOKENS, "model_max_length": model_max_length,
                    "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
                    "tokenizer_class": "PreTrainedTokenizerFast"}
    if isinstance(tokenizer, WordPieceTokenizer):
        names = save_vocab(tokenizer, path)
        config.update(do_lower_case=tokenizer.do_lower_case,
                      strip_accents=tokenizer.strip_accents)
    else:  # the model itself too, from which bertjax reads it back exactly
        names = [SENTENCEPIECE_FILES[0]]
        with files.open(os.path.join(path, names[0]), "wb") as f:
            f.write(tokenizer.model_proto())
    with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json(tokenizer))
    names.append("tokenizer.json")
    tree.write_json(os.path.join(path, "tokenizer_config.json"), config)
    tree.write_json(os.path.join(path, "special_tokens_map.json"), SPECIAL_TOKENS)
    return names + ["tokenizer_config.json", "special_tokens_map.json"]


def tokenizer_file(directory: str) -> tuple[str, str]:
    """The tokenizer bertjax reads beside a Google TF or Hugging Face checkpoint, as `(kind,
    path)`: the WordPiece `vocab.txt`, else a SentencePiece model (`SENTENCEPIECE_FILES`), else
    one rebuilt from a Unigram `tokenizer.json` of the form bertjax exports. Raises
    ConversionError saying what is there instead."""
    for kind, names in (("wordpiece", ("vocab.txt",)), ("sentencepiece", SENTENCEPIECE_FILES)):
        for name in names:
            if files.isfile(os.path.join(directory, name)):
                return kind, os.path.join(directory, name)
    json_path = os.path.join(directory, "tokenizer.json")
    if files.isfile(json_path):
        try:
            spec = json.loads(files.read_text(json_path))
            model = spec["model"]["type"]
        except (ValueError, KeyError, TypeError):
            spec, model = {}, "unreadable"
        proto = _unigram_proto(spec) if model == "Unigram" else None
        if proto is not None:
            return "sentencepiece", _temporary_model(proto)
        raise tree.ConversionError(
            f"{directory} has only tokenizer.json (a {model} tokenizer), which bertjax cannot "
            f"reproduce: it reads vocab.txt (WordPiece) or a SentencePiece model "
            f"({', '.join(SENTENCEPIECE_FILES)})")
    raise tree.ConversionError(f"no tokenizer beside {directory} (vocab.txt or a SentencePiece "
                               f"model: {', '.join(SENTENCEPIECE_FILES)})")


def _unigram_proto(spec: dict) -> bytes | None:
    """The SentencePiece model of a Unigram tokenizer.json in the form `tokenizer_json`
    writes (the inverse of `_sentencepiece_model`); None for any other form."""
    steps = (spec.get("normalizer") or {}).get("normalizers", [])
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "Metaspace" or pre.get("prepend_scheme") not in ("always", "never") \
            or any(s.get("type") not in ("Precompiled", "Strip", "Replace") or s["type"] ==
                   "Replace" and (s.get("pattern"), s.get("content")) != ({"Regex": " {2,}"}, " ")
                   for s in steps):
        return None
    model, added = spec["model"], {t["content"] for t in spec.get("added_tokens", [])}
    proto = sentencepiece_model_pb2.ModelProto()
    for i, (piece, score) in enumerate(model["vocab"]):
        kind = 2 if i == model["unk_id"] else 3 if piece == PAD else 4 if piece in added else \
            6 if model.get("byte_fallback") and re.fullmatch(r"<0x[0-9A-F]{2}>", piece) else 1
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


def _temporary_model(proto: bytes) -> str:
    """A SentencePiece model file holding `proto`, deleted when the process ends."""
    directory = tempfile.mkdtemp(prefix="bertjax_tokenizer_")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, SENTENCEPIECE_FILES[0])
    with open(path, "wb") as f:
        f.write(proto)
    return path
