"""The tokenizer files of a Hugging Face export, so that `transformers.AutoTokenizer
.from_pretrained(DIR)` gives bertjax's token ids: WordPiece as `vocab.txt` +
`tokenizer_config.json` (BertTokenizer with the same casing and accent stripping),
SentencePiece as a `tokenizer.json` built with the `tokenizers` library from the `.model`
(Unigram pieces and scores, the model's own normalization rules, whitespace handling and dummy
prefix) and BERT's `[CLS] A [SEP] B [SEP]` template. One known difference: raw text that
spells a special token (`[MASK]`) is that token for transformers, while SentencePiece puts a
`▁` piece before it."""
from __future__ import annotations

import os

from sentencepiece import sentencepiece_model_pb2

from bertjax.data.tokenization import (CLS, MASK, PAD, SEP, UNK, SentencePieceTokenizer,
                                       Tokenizer, WordPieceTokenizer)
from bertjax.interop import tree

SPECIAL_TOKENS = {"pad_token": PAD, "unk_token": UNK, "cls_token": CLS, "sep_token": SEP,
                  "mask_token": MASK}
UNIGRAM = 1  # sentencepiece's TrainerSpec.model_type
SPECIAL_PIECE_TYPES = (2, 3, 4)  # unknown, control, user-defined


def sentencepiece_json(model_proto: bytes, cls_id: int, sep_id: int) -> str:
    """A `tokenizers` tokenizer.json that segments as the SentencePiece (unigram) model does."""
    try:
        from tokenizers import (AddedToken, Regex, Tokenizer as HfTokenizer, decoders, models,
                                normalizers, pre_tokenizers, processors)
    except ImportError:
        raise tree.ConversionError("writing tokenizer.json for a SentencePiece model needs the "
                                   "`tokenizers` package: pip install tokenizers") from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)
    if proto.trainer_spec.model_type != UNIGRAM:
        raise tree.ConversionError("only unigram SentencePiece models can be exported as "
                                   "tokenizer.json (this one is not)")
    hf = HfTokenizer(models.Unigram([(p.piece, p.score) for p in proto.pieces],
                                    unk_id=proto.trainer_spec.unk_id,
                                    byte_fallback=proto.trainer_spec.byte_fallback))
    steps = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    hf.normalizer = normalizers.Sequence(steps)
    scheme = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    hf.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme,
                                                split=proto.trainer_spec.split_by_whitespace)
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=scheme)
    hf.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                           for p in proto.pieces if p.type in SPECIAL_PIECE_TYPES])
    hf.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}", pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)])
    return hf.to_str(pretty=True)


def save_vocab(tokenizer: WordPieceTokenizer, path: str) -> list[str]:
    """Writes the WordPiece vocabulary as `vocab.txt` (one token a line, in id order)."""
    tokens = tokenizer.convert_ids_to_tokens(range(tokenizer.vocab_size))
    with open(os.path.join(path, "vocab.txt"), "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in tokens))
    return ["vocab.txt"]


def save_tokenizer(tokenizer: Tokenizer, path: str, model_max_length: int) -> list[str]:
    """Writes the tokenizer files for `AutoTokenizer` into `path`; returns their names."""
    config: dict = {**SPECIAL_TOKENS, "model_max_length": model_max_length,
                    "model_input_names": ["input_ids", "token_type_ids", "attention_mask"]}
    if isinstance(tokenizer, WordPieceTokenizer):
        names = save_vocab(tokenizer, path)
        config.update(tokenizer_class="BertTokenizer", do_lower_case=tokenizer.do_lower_case,
                      strip_accents=tokenizer.strip_accents, tokenize_chinese_chars=True)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        with open(os.path.join(path, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(sentencepiece_json(tokenizer.model_proto(), tokenizer.cls_id,
                                       tokenizer.sep_id))
        config.update(tokenizer_class="PreTrainedTokenizerFast")
        names = ["tokenizer.json"]
    else:
        raise tree.ConversionError(f"no Hugging Face form for a {type(tokenizer).__name__}")
    tree.write_json(os.path.join(path, "tokenizer_config.json"), config)
    tree.write_json(os.path.join(path, "special_tokens_map.json"), SPECIAL_TOKENS)
    return names + ["tokenizer_config.json", "special_tokens_map.json"]
