"""The tokenizer files of a Hugging Face export, so that `transformers.AutoTokenizer
.from_pretrained(DIR)` gives bertjax's token ids. A `tokenizer.json` built with the
`tokenizers` library (a dependency of bertjax, as of transformers) holds either tokenizer:
WordPiece as Google's BasicTokenizer + WordpieceTokenizer (same casing, accent stripping and
200-character word limit), SentencePiece as a Unigram model from the `.model` (pieces, scores,
the model's own normalization rules, whitespace handling and dummy prefix); both with BERT's
`[CLS] A [SEP] B [SEP]` template. WordPiece also gets `vocab.txt`. One known difference: raw
text that spells a special token (`[MASK]`) is that token for transformers, while SentencePiece
puts a `▁` piece before it.

The other way (`tokenizer_file`): the tokenizer beside a Google or Hugging Face checkpoint,
including a `tokenizer.json` alone, of Google's WordPiece form (read as bertjax's WordPiece,
cased as transformers would) or the Unigram form written here."""
from __future__ import annotations

import atexit
import base64
import json
import os
import re
import shutil
import tempfile
from typing import NamedTuple

import tokenizers as tk
from sentencepiece import sentencepiece_model_pb2

from bertjax import files
from bertjax.data import bpe
from bertjax.data.tokenization import (CLS, MASK, PAD, SEP, UNK, SentencePieceTokenizer,
                                       Tokenizer, WordPieceTokenizer)
from bertjax.interop import tree

SPECIAL_TOKENS = {"pad_token": PAD, "unk_token": UNK, "cls_token": CLS, "sep_token": SEP,
                  "mask_token": MASK}
# SentencePiece models beside a checkpoint: bertjax's and transformers' usual names.
SENTENCEPIECE_FILES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model")
UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type
# tokenizer_config.json classes under which transformers applies a tokenizer.json as it is.
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
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
    """Writes the tokenizer files for `AutoTokenizer` into `path`; returns their names (a BPE
    tokenizer.json is written as it was read, with ModernBERT's model inputs)."""
    if not isinstance(tokenizer, (WordPieceTokenizer, SentencePieceTokenizer,
                                  bpe.BpeTokenizer)):
        raise tree.ConversionError(f"no Hugging Face form for a {type(tokenizer).__name__}")
    byte_level = isinstance(tokenizer, bpe.BpeTokenizer)
    config: dict = {**SPECIAL_TOKENS, "model_max_length": model_max_length,
                    "model_input_names": ["input_ids", "attention_mask"] if byte_level
                    else ["input_ids", "token_type_ids", "attention_mask"],
                    "tokenizer_class": "PreTrainedTokenizerFast"}
    if byte_level:
        names = bpe.save(tokenizer, path)
    elif isinstance(tokenizer, WordPieceTokenizer):
        names = save_vocab(tokenizer, path)
        config.update(do_lower_case=tokenizer.do_lower_case,
                      strip_accents=tokenizer.strip_accents)
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
    return names + ["tokenizer_config.json", "special_tokens_map.json"]


class Casing(NamedTuple):
    """How the WordPiece tokenizer of a `tokenizer.json` cases text, as transformers applies it."""

    do_lower_case: bool
    strip_accents: bool
    max_input_chars_per_word: int


def tokenizer_file(directory: str) -> tuple[str, str, Casing | None]:
    """The tokenizer bertjax reads beside a Google TF or Hugging Face checkpoint, as `(kind,
    path, casing)`: the WordPiece `vocab.txt`, else a SentencePiece model
    (`SENTENCEPIECE_FILES`), else one rebuilt from a `tokenizer.json` of Google's WordPiece
    form (then `casing` is the json's) or of the Unigram form bertjax exports, else a BPE
    `tokenizer.json` (kind "bpe": ModernBERT's, read by the tokenizers library). Raises
    ConversionError saying what is there instead."""
    for kind, names in (("wordpiece", ("vocab.txt",)), ("sentencepiece", SENTENCEPIECE_FILES)):
        for name in names:
            if files.isfile(os.path.join(directory, name)):
                return kind, os.path.join(directory, name), None
    json_path = os.path.join(directory, "tokenizer.json")
    if files.isfile(json_path):
        try:
            spec = json.loads(files.read_text(json_path))
            model = spec["model"]["type"]
        except (ValueError, KeyError, TypeError):
            spec, model = {}, "unreadable"
        if model == "WordPiece":
            return "wordpiece", *_wordpiece_vocab(directory, spec)
        if model == "BPE":
            return "bpe", json_path, None
        proto = _unigram_proto(spec) if model == "Unigram" else None
        if proto is not None:
            return "sentencepiece", _temporary_file(SENTENCEPIECE_FILES[0], proto), None
        raise tree.ConversionError(
            f"{directory} has only tokenizer.json (a {model} tokenizer), which bertjax cannot "
            f"reproduce: it reads vocab.txt (WordPiece), a SentencePiece model "
            f"({', '.join(SENTENCEPIECE_FILES)}) or a BPE tokenizer.json")
    raise tree.ConversionError(f"no tokenizer beside {directory} (vocab.txt or a SentencePiece "
                               f"model: {', '.join(SENTENCEPIECE_FILES)})")


def _wordpiece_vocab(directory: str, spec: dict) -> tuple[str, Casing]:
    """The vocabulary (a `vocab.txt` made from the json's, in id order) and casing of a
    WordPiece tokenizer.json of Google's form: BertNormalizer (cleaning text, splitting CJK),
    BertPreTokenizer, `##` pieces, [UNK], no added tokens but BERT's special ones and a
    `[CLS] A [SEP] B [SEP]` post-processor. Raises ConversionError naming what differs."""
    json_path = os.path.join(directory, "tokenizer.json")
    model, normalizer = spec["model"], spec.get("normalizer") or {}
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        vocab = {}  # (not a WordPiece vocab: refused below, lacking the special tokens)
    tokens = sorted(vocab, key=vocab.get)
    added = {t.get("content") for t in spec.get("added_tokens") or []} - set(
        SPECIAL_TOKENS.values())
    checks = [
        (normalizer.get("type") == "BertNormalizer" and normalizer.get("clean_text")
         and normalizer.get("handle_chinese_chars"), f"its normalizer is {normalizer.get('type')},"
         " not BertNormalizer with clean_text and handle_chinese_chars"),
        ((spec.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer",
         "its pre_tokenizer is not BertPreTokenizer"),
        ((model.get("continuing_subword_prefix"), model.get("unk_token")) == ("##", UNK),
         f"its pieces are not '##' continuations with {UNK}"),
        ([vocab[t] for t in tokens] == list(range(len(tokens))),
         "its vocab's ids are not 0, 1, 2, ... (holes or repeats)"),
        (all(t and t == t.strip() and "\n" not in t for t in tokens),
         "a token of its vocab is empty or has spaces around it"),
        (set(SPECIAL_TOKENS.values()) <= set(vocab),
         f"its vocab lacks {sorted(set(SPECIAL_TOKENS.values()) - set(vocab))}"),
        (not added, f"it adds tokens {sorted(added)[:3]} to its vocab's"),
    ]
    problems = [what for ok, what in checks if not ok]
    if not problems:
        problems = _template_problems(files.read_text(json_path), spec, tokens)
    if problems:
        raise tree.ConversionError(f"{json_path} is a WordPiece tokenizer bertjax cannot "
                                   f"reproduce: {'; '.join(problems)}")
    vocab_txt = "".join(t + "\n" for t in tokens).encode("utf-8")
    return _temporary_file("vocab.txt", vocab_txt), _casing(directory, normalizer, model)


def _template_problems(text: str, spec: dict, tokens: list[str]) -> list[str]:
    """What keeps the json's post-processor from giving BERT's `[CLS] A [SEP] B [SEP]` (segment
    0, then 1), found by encoding a pair; empty if it gives that."""
    ids = {t: i for i, t in enumerate(tokens)}
    try:
        hf = tk.Tokenizer.from_str(text)
    except Exception as e:  # (tokenizers raises plain Exception)
        return [f"the tokenizers library cannot read it ({e})"]
    a, b = (hf.encode(t, add_special_tokens=False).ids for t in ("a", "b"))
    pair = hf.encode("a", "b")
    if pair.ids == [ids[CLS], *a, ids[SEP], *b, ids[SEP]] and \
            pair.type_ids == [0] * (len(a) + 2) + [1] * (len(b) + 1):
        return []
    return [f"its post_processor ({(spec.get('post_processor') or {}).get('type')}) does not "
            f"give {CLS} A {SEP} B {SEP}"]


def _casing(directory: str, normalizer: dict, model: dict) -> Casing:
    """The casing transformers' AutoTokenizer gives a WordPiece tokenizer.json: its own with
    the `tokenizer_class` bertjax exports; otherwise (BertTokenizer) `tokenizer_config.json`'s
    `do_lower_case` (default true) and `strip_accents`, and 100 characters a word. Raises
    ConversionError where that is not the json's own casing (which casing the model was
    trained with is then unknown)."""
    lower = bool(normalizer.get("lowercase"))
    strip = lower if normalizer.get("strip_accents") is None else bool(normalizer["strip_accents"])
    config_path = os.path.join(directory, "tokenizer_config.json")
    config = tree.read_json_config(config_path, "tokenizer config") \
        if files.isfile(config_path) else {}
    if config.get("tokenizer_class") in FAST_TOKENIZER_CLASSES:
        return Casing(lower, strip, model.get("max_input_chars_per_word", 100))
    config_lower = bool(config.get("do_lower_case", True))
    config_strip = config_lower if config.get("strip_accents") is None \
        else bool(config["strip_accents"])
    chinese = config.get("tokenize_chinese_chars", True)
    if (config_lower, config_strip, chinese) != (lower, strip, True):
        raise tree.ConversionError(
            f"{directory}'s tokenizer.json (lowercase {lower}, strip_accents {strip}) and "
            f"tokenizer_config.json (do_lower_case {config_lower}, strip_accents {config_strip}"
            f"{'' if chinese else ', tokenize_chinese_chars false'}{'' if config else ': absent'}"
            ", which transformers' BertTokenizer applies) disagree, so the casing the model was "
            "trained with is unknown; set do_lower_case and strip_accents in "
            "tokenizer_config.json to the model's")
    return Casing(lower, strip, 100)


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


def _temporary_file(name: str, data: bytes) -> str:
    """A tokenizer file `name` holding `data`, deleted when the process ends."""
    directory = tempfile.mkdtemp(prefix="bertjax_tokenizer_")
    atexit.register(shutil.rmtree, directory, True)
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path
