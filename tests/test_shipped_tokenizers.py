"""Tokenizers as they are shipped: a sentence-transformers directory (a BertModel and a
tokenizer.json with padding and truncation turned on, no vocab.txt) read as transformers reads
it, for fine-tuning and feature extraction without --vocab_file; tokenizers passed as the wrong
kind refused in one line; and bertjax's BPE and WordPiece ids equal the `tokenizers` library's
over a whole text file."""

import dataclasses
import itertools
import json
import os
import random

import jax
import numpy as np
import pytest
import tokenizers as tk
from safetensors.numpy import load_file, save_file

from bertjax import finetune
from bertjax.data import bpe, tokenization
from bertjax.data.errors import DataError
from bertjax.families import bert_hf
from bertjax.interop import hf_tokenizer, pretrained
from test_convert import random_params
from test_finetune import TINY, config_file, run_extract_features, sentence
from test_modernbert_io import bpe_tokenizer
from test_train import corpus_file  # noqa: F401 (fixture)

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = [
    "Crème Brûlée, naïve CAFÉ! Ångström's résumé?",
    "中文分词：我爱北京。 漢字 and 한국어",
    'Punctuation!!! ((quotes)) "x" $5 @home #tag',
    "Hello world.",
    "unaffable",
]


def wordpiece_json(words: list[str], path: str, padded: bool = True) -> tk.Tokenizer:
    """An uncased WordPiece tokenizer.json of Google's form as sentence-transformers saves it
    (padding to 128 and truncation turned on), over BERT's specials, every character of
    `words` (alone and as `##` piece) and `words`; returns it."""
    chars = sorted({c for w in words for c in w})
    tokens = list(dict.fromkeys(SPECIALS + chars + ["##" + c for c in chars] + words))
    ids = {t: i for i, t in enumerate(tokens)}
    built = tk.Tokenizer(tk.models.WordPiece(ids, unk_token="[UNK]", max_input_chars_per_word=100))
    built.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    built.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    built.decoder = tk.decoders.WordPiece()
    built.post_processor = tk.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    built.add_special_tokens(SPECIALS)
    if padded:
        built.enable_padding(length=128, pad_id=0, pad_token="[PAD]")
        built.enable_truncation(max_length=128)
    built.save(path)
    return built


def text_words(texts: list[str]) -> list[str]:
    """The lower-cased words of `texts` as BERT's basic tokenizer splits them."""
    return sorted({w for t in texts for w in tokenization.basic_tokenize(t)})


def sentence_transformers_dir(directory, words: list[str]) -> str:
    """A directory as sentence-transformers ships all-MiniLM-L6-v2: a BertModel (TINY shape,
    random weights, no `bert.` prefix), tokenizer.json with padding and truncation set, its
    BertTokenizer config, no vocab.txt, and sentence-transformers' own files."""
    os.makedirs(directory, exist_ok=True)
    vocab_size = wordpiece_json(words, str(directory / "tokenizer.json")).get_vocab_size()
    config = dataclasses.replace(TINY, vocab_size=vocab_size, num_hidden_layers=1)
    bert_hf.save_hf(config, random_params(config), str(directory))
    weights = load_file(str(directory / "model.safetensors"))
    save_file(
        {k.removeprefix("bert."): v for k, v in weights.items() if k.startswith("bert.")},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    values = json.loads((directory / "config.json").read_text())
    values.update(architectures=["BertModel"])
    files = {
        "config.json": values,
        "tokenizer_config.json": {
            "do_lower_case": True,
            "tokenize_chinese_chars": True,
            "strip_accents": None,
            "tokenizer_class": "BertTokenizer",
            "model_max_length": 512,
            **dict(
                zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS)
            ),
        },
        "special_tokens_map.json": {"pad_token": "[PAD]", "unk_token": "[UNK]"},
        "sentence_bert_config.json": {"max_seq_length": 256, "do_lower_case": False},
        "config_sentence_transformers.json": {"__version__": {"sentence_transformers": "2.0.0"}},
        "modules.json": [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
        ],
        "1_Pooling/config.json": {
            "word_embedding_dimension": TINY.hidden_size,
            "pooling_mode_mean_tokens": True,
        },
    }
    for name, value in files.items():
        os.makedirs(os.path.dirname(directory / name), exist_ok=True)
        (directory / name).write_text(json.dumps(value))
    return str(directory)


@pytest.fixture(scope="module")
def shipped(tmp_path_factory) -> str:
    """A sentence-transformers directory whose tokenizer knows TEXTS and the SST-2 rows of
    `sst2_rows`."""
    directory = tmp_path_factory.mktemp("shipped") / "all-MiniLM-like"
    return sentence_transformers_dir(directory, text_words(TEXTS + sst2_rows()[1]))


def sst2_rows() -> tuple[list[str], list[str]]:
    """SST-2 tsv lines (a label-deciding word) and their sentences."""
    rng = random.Random(0)
    sentences = [sentence(rng, i % 2 == 1) for i in range(48)]
    return [f"{s}\t{i % 2}" for i, s in enumerate(sentences)], sentences


def test_a_tokenizer_json_is_read_without_its_padding_and_truncation(shipped, tmp_path):
    """transformers ignores a tokenizer.json's padding and truncation unless a call asks;
    so do bertjax's WordPiece (from the json) and BPE readers."""
    source = pretrained.Source(init_checkpoint=shipped)
    wordpiece = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    reference = tk.Tokenizer.from_file(os.path.join(shipped, "tokenizer.json"))
    assert len(reference.encode("Hello world.").ids) == 128  # (the json pads)
    reference.no_padding()
    assert (
        wordpiece.encode("Hello world.")
        == reference.encode("Hello world.", add_special_tokens=False).ids
    )
    hf_bpe = tk.Tokenizer.from_file(bpe_tokenizer(str(tmp_path / "tokenizer.json")))
    hf_bpe.enable_padding(length=128, pad_token="[PAD]", pad_id=hf_bpe.token_to_id("[PAD]"))
    hf_bpe.enable_truncation(max_length=4)
    hf_bpe.save(str(tmp_path / "tokenizer.json"))
    ours = bpe.BpeTokenizer(str(tmp_path / "tokenizer.json"))
    hf_bpe.no_padding()
    hf_bpe.no_truncation()
    text = "the movie was good . a plot and very bad film"
    assert ours.encode(text) == hf_bpe.encode(text, add_special_tokens=False).ids
    assert len(ours.encode(text)) > 4 and ours.pad_id not in ours.encode("Hello world.")


def test_vocab_file_may_be_the_directory_or_its_tokenizer_json(shipped):
    """--config.vocab_file=<the directory> or <its tokenizer.json> reads the tokenizer the
    directory ships (not "not found", not "lacks special tokens")."""
    source = pretrained.Source(init_checkpoint=shipped)
    beside = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    for vocab_file in (shipped, os.path.join(shipped, "tokenizer.json")):
        given = dataclasses.replace(source, vocab_file=vocab_file)
        ours = pretrained.tokenizer_of(given, pretrained.pretraining_run(given))
        assert ours.fingerprint() == beside.fingerprint(), vocab_file
        assert [ours.encode(t) for t in TEXTS] == [beside.encode(t) for t in TEXTS]


def test_tokenizers_passed_as_the_wrong_kind_are_one_line(shipped, tmp_path):
    json_path = os.path.join(shipped, "tokenizer.json")
    source = pretrained.Source(init_checkpoint=shipped)
    wordpiece = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    (tmp_path / "vocab.txt").write_text(
        "".join(t + "\n" for t in wordpiece.convert_ids_to_tokens(range(wordpiece.vocab_size)))
    )
    with open(json_path, "rb") as f:
        (tmp_path / "latin1.json").write_bytes(f.read().replace(b'"1.0"', b'"1.0\xe9"', 1))
    bpe_path = bpe_tokenizer(str(tmp_path / "bpe" / "tokenizer.json"))
    for kind, path, message in (
        ("bpe", json_path, r"is a WordPiece tokenizer.json: use data.tokenizer=wordpiece$"),
        (
            "bpe",
            str(tmp_path / "vocab.txt"),
            r"is a WordPiece vocab.txt: use data.tokenizer=wordpiece$",
        ),
        ("sentencepiece", json_path, r"use data.tokenizer=wordpiece$"),
        ("wordpiece", bpe_path, r"is a BPE tokenizer.json: use data.tokenizer=bpe$"),
        ("bpe", str(tmp_path / "latin1.json"), r"latin1.json is not UTF-8 \(byte \d+\)"),
        (
            "bpe",
            shipped,
            r"is a directory: name the tokenizer file in it \(a vocab.txt, "
            r"tokenizer.json or SentencePiece .model\)$",
        ),
    ):
        with pytest.raises(DataError, match=message) as error:
            tokenization.load_tokenizer(kind, path)
        assert "\n" not in str(error.value), (kind, path)
    # With data.tokenizer=wordpiece, the json is read as transformers reads it.
    read = tokenization.load_tokenizer("wordpiece", json_path)
    assert [read.encode(t) for t in TEXTS] == [wordpiece.encode(t) for t in TEXTS]
    with pytest.raises(
        DataError,
        match=r"tokenizer.json is uncased but do_lower_case=False; "
        r"set data.do_lower_case=True$",
    ):
        tokenization.load_tokenizer("wordpiece", json_path, do_lower_case=False)
    # Fine-tuning names its own flags.
    given = dataclasses.replace(source, vocab_file=json_path, tokenizer="bpe")
    with pytest.raises(pretrained.PretrainedError, match=r"use --config.tokenizer=wordpiece$"):
        pretrained.tokenizer_of(given, pretrained.pretraining_run(given))
    (tmp_path / "empty").mkdir()
    for vocab_file, message in (
        (tmp_path / "absent.txt", "tokenizer file not found: "),
        (tmp_path / "empty", "no tokenizer in "),
    ):
        given = dataclasses.replace(source, vocab_file=str(vocab_file))
        with pytest.raises(
            pretrained.PretrainedError,
            match=rf"^--config.vocab_file={vocab_file}: {message}{vocab_file}",
        ):
            pretrained.tokenizer_of(given, pretrained.pretraining_run(given))


def test_no_tokenizer_found_names_what_it_looks_for(tmp_path):
    with pytest.raises(
        hf_tokenizer.tree.ConversionError,
        match=r"no tokenizer in .*: bertjax looks for vocab.txt, tokenizer.json "
        r"or a SentencePiece model \(tokenizer.model, ",
    ):
        hf_tokenizer.tokenizer_file(str(tmp_path))


def test_bpe_and_wordpiece_ids_equal_the_tokenizers_library_over_a_text_file(corpus_file, tmp_path):
    """Every line of the tests' training corpus (and TEXTS), as bertjax's BPE (a byte-level
    BPE trained on that corpus: every merge rule is used) and WordPiece (Google's, from a
    vocab of that corpus) tokenize it and as the `tokenizers` library does."""
    with open(corpus_file, encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()] + TEXTS
    hf_bpe = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    hf_bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_bpe.train_from_iterator(
        lines,
        tk.trainers.BpeTrainer(
            vocab_size=1000,
            special_tokens=SPECIALS,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_bpe.save(str(tmp_path / "tokenizer.json"))
    ours = bpe.BpeTokenizer(str(tmp_path / "tokenizer.json"))
    assert [ours.encode(t) for t in lines] == [
        e.ids for e in hf_bpe.encode_batch(lines, add_special_tokens=False)
    ]
    some = [w for w in text_words(lines) if len(w) > 2][::3]  # (the rest: split into pieces)
    hf_wp = wordpiece_json(
        [*some, "un", "##aff", "##able"], str(tmp_path / "wp.json"), padded=False
    )
    wordpiece = tokenization.WordPieceTokenizer(
        _vocab_txt(hf_wp, tmp_path / "vocab.txt"), max_input_chars_per_word=100
    )
    expected = [e.ids for e in hf_wp.encode_batch(lines, add_special_tokens=False)]
    assert [wordpiece.encode(t) for t in lines] == expected
    assert (
        sum(
            t.startswith("##")
            for t in wordpiece.convert_ids_to_tokens(
                np.concatenate([e for e in expected if e]).tolist()
            )
        )
        > 1000
    )


def _vocab_txt(built: tk.Tokenizer, path) -> str:
    """The vocab.txt (id order) of a `tokenizers` WordPiece tokenizer; returns its path."""
    vocab = built.get_vocab()
    path.write_text("".join(t + "\n" for t in sorted(vocab, key=vocab.get)), encoding="utf-8")
    return str(path)


@pytest.mark.slow  # a fine-tuning run and extract_features: 19 s of CPU (145 s on a loaded machine)
def test_a_sentence_transformers_directory_fine_tunes_and_extracts_features(shipped, tmp_path):
    """No --vocab_file: the tokenizer.json shipped beside the BertModel is read as
    transformers reads it, for fine-tuning and for extract_features."""
    rows, _sentences = sst2_rows()
    os.makedirs(tmp_path / "SST-2")
    for split, part in (("train", rows[:32]), ("dev", rows[32:])):
        (tmp_path / "SST-2" / f"{split}.tsv").write_text(
            "\n".join(["sentence\tlabel", *part]) + "\n"
        )
    config = config_file("glue.py")
    config.update(
        task="sst2",
        data_dir=str(tmp_path),
        init_checkpoint=shipped,
        max_seq_length=16,
        train_batch_size=16,
        eval_batch_size=16,
        num_train_epochs=1.0,
        log_every=1,
    )
    summary = finetune.run(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert summary["seeds"][0]["best_step"] == 2
    (tmp_path / "in.txt").write_text(f"{TEXTS[0]}\n")
    result = run_extract_features(tmp_path, shipped, "--max_seq_length=32", "--layers=-1")
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = [f["token"] for f in json.loads((tmp_path / "out.jsonl").read_text())["features"]]
    reference = tk.Tokenizer.from_file(os.path.join(shipped, "tokenizer.json"))
    reference.no_padding()
    assert tokens == reference.encode(TEXTS[0]).tokens


@pytest.mark.parity
def test_a_sentence_transformers_directory_tokenizes_as_auto_tokenizer(shipped):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(shipped)
    source = pretrained.Source(init_checkpoint=shipped)
    ours = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    for a, b in itertools.pairwise(TEXTS):
        encoded = theirs(a, b)
        assert encoded["input_ids"] == [
            ours.cls_id,
            *ours.encode(a),
            ours.sep_id,
            *ours.encode(b),
            ours.sep_id,
        ], (a, b)
        assert encoded["token_type_ids"] == [0] * (len(ours.encode(a)) + 2) + [1] * (
            len(ours.encode(b)) + 1
        )
    assert theirs.convert_ids_to_tokens(theirs(TEXTS[0])["input_ids"]) == [
        "[CLS]",
        *ours.tokenize(TEXTS[0]),
        "[SEP]",
    ]
