"""Numerical parity with Hugging Face transformers (PyTorch, CPU, float32) on the same
weights, and WordPiece parity with transformers' BertTokenizer (Rust) and its Python port.

Needs the `parity` extra (pip install -e '.[parity]'); deselected by default, run with
`python -m pytest -q -m parity tests`.
"""

import collections
import itertools
import os
import shutil
import unicodedata
from pathlib import Path

import jax
import numpy as np
import pytest

from bertjax import convert, train
from bertjax.data import tokenization
from bertjax.families import bert_hf
from bertjax.interop import pretrained
from bertjax.models.bert.model import BertConfig, BertForPreTraining
from test_convert import assert_trees_equal, random_params
from test_exports import wordpiece_json_dir
from test_train import corpus_file, tiny_config  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.bert import tokenization_bert_legacy  # noqa: E402

pytestmark = pytest.mark.parity
TOLERANCE = 1e-5
BERT_BASE_VOCAB = os.path.join(
    os.path.dirname(__file__), "..", "..", "shared", "data", "bert-base-uncased", "vocab.txt"
)
# (layers, hidden, heads, intermediate, vocab, type vocab, HF activation)
CONFIGS = [
    (1, 32, 1, 64, 101, 2, "gelu"),
    (2, 48, 3, 80, 257, 2, "gelu"),
    (3, 64, 8, 37, 1000, 3, "gelu_new"),
    (4, 128, 2, 512, 30522, 2, "gelu"),  # BERT-Tiny's widths and vocabulary, 4 layers
]


def _read_lines(path):
    with open(path, encoding="utf-8") as f:
        return f.readlines()


def random_hf_model(layers, hidden, heads, intermediate, vocab, type_vocab, act):
    """A BertForPreTraining with every weight random (also LayerNorm and biases, which HF
    initialises to constants, so a swapped or dropped one would show)."""
    torch.manual_seed(layers)
    config = transformers.BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        type_vocab_size=type_vocab,
        hidden_act=act,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    return randomized(transformers.BertForPreTraining(config).eval(), "LayerNorm", 0.05)


def randomized(model, norm: str, weight_std: float):
    """`model` with random weights: its norms' scales (parameters named `norm`...`weight`)
    near 1, biases and norm offsets N(0, 0.2), other weights N(0, weight_std)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if norm in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.2 if "bias" in name or norm in name else weight_std)
    return model


def two_segment_batch(vocab, type_vocab, batch=3, length=24):
    """[CLS] a [SEP] b [SEP] rows with padding after different lengths."""
    rng = np.random.default_rng(vocab)
    ids = rng.integers(1, vocab, (batch, length))
    lengths = [length, 17, 9]
    segment_b = [10, 8, 5]
    token_types = np.zeros((batch, length), np.int64)
    mask = np.zeros((batch, length), np.int64)
    for row, (n, b) in enumerate(zip(lengths, segment_b)):
        token_types[row, b:n] = type_vocab - 1
        mask[row, :n] = 1
        ids[row, n:] = 0
    return ids, token_types, mask


@pytest.mark.parametrize("dims", CONFIGS, ids=lambda d: "L{}_H{}_A{}_I{}_V{}_T{}_{}".format(*d))
def test_outputs_match_transformers(dims, tmp_path):
    hf_model = random_hf_model(*dims)
    hf_model.save_pretrained(tmp_path)
    config, params = bert_hf.load_hf(str(tmp_path))
    ids, token_types, mask = two_segment_batch(dims[4], dims[5])
    with torch.no_grad():
        expected = hf_model(
            input_ids=torch.tensor(ids),
            token_type_ids=torch.tensor(token_types),
            attention_mask=torch.tensor(mask),
            output_hidden_states=True,
        )
    every_position = np.tile(np.arange(ids.shape[1]), (ids.shape[0], 1))
    (mlm, nsp), state = jax.jit(
        lambda p: BertForPreTraining(config).apply(
            {"params": p}, ids, token_types, mask, every_position, mutable=["intermediates"]
        )
    )(params)
    encoder = state["intermediates"]["bert"]["encoder"]
    hidden = [encoder["embedding_output"][0]] + [
        encoder[f"layer_{i}"]["hidden_states"][0] for i in range(config.num_hidden_layers)
    ]
    diffs = {
        "mlm": np.abs(np.asarray(mlm) - expected.prediction_logits.numpy()).max(),
        "nsp": np.abs(np.asarray(nsp) - expected.seq_relationship_logits.numpy()).max(),
    }
    assert len(hidden) == len(expected.hidden_states)
    for i, (ours, theirs) in enumerate(zip(hidden, expected.hidden_states)):
        diffs[f"hidden_{i}"] = np.abs(np.asarray(ours) - theirs.numpy()).max()
    print(dims, {k: f"{v:.1e}" for k, v in diffs.items()})
    assert max(diffs.values()) <= TOLERANCE, diffs
    assert np.abs(expected.prediction_logits.numpy()).max() > 1.0  # not a trivially small output


def test_bertjax_to_hf_to_bertjax_is_exact(tmp_path):
    config = BertConfig(
        vocab_size=77,
        hidden_size=24,
        num_hidden_layers=2,
        num_attention_heads=3,
        intermediate_size=40,
        max_position_embeddings=32,
    )
    params = random_params(config, seed=5)
    bert_hf.save_hf(config, params, str(tmp_path / "ours"))
    model, info = transformers.BertForPreTraining.from_pretrained(
        str(tmp_path / "ours"), output_loading_info=True
    )
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert not info["error_msgs"]
    model.save_pretrained(tmp_path / "theirs")  # HF's own writer
    (tmp_path / "old").mkdir()  # the older format: pytorch_model.bin
    torch.save(model.state_dict(), tmp_path / "old" / "pytorch_model.bin")
    shutil.copy(tmp_path / "theirs" / "config.json", tmp_path / "old" / "config.json")
    for directory in ("theirs", "old"):
        loaded_config, loaded = bert_hf.load_hf(str(tmp_path / directory))
        assert loaded_config == config
        assert_trees_equal(loaded, params)


TEXTS = [
    "Hello, World! This is BERT's tokenizer.",
    "Crème brûlée, naïve café, Ångström, résumé, São Paulo, Łódź, Ελληνικά, Москва.",
    "中文分词测试：我爱北京天安门。漢字とひらがなとカタカナ、ハンカク ｶﾀｶﾅ. 한국어 문장입니다.",
    "Emoji 😀👍🏽 and symbols ★ ☃ © ® ™ € £ ¥ § ¶ ∑ ∞ ≠ → ⇒.",
    "Control\x00chars\x01here\x7f and\u200bzero-width\ufeff, tabs\tand\nnewlines\r\nand \ufffd.",
    "Punctuation runs!!!??? ...--- ((([[[{{{}}}]]]))) \"quotes\" 'single' `back` ~~~ ### @@@ $$$ %%% ^^^",
    "MiXeD CaSe WoRdS, ALL CAPS, lowercase, CamelCaseWord, iPhone, McDonald's, eBay, O'Neill.",
    "Numbers 3.14159 1,000,000 2nd 42% -7 +8 1e-5 0x1F 192.168.0.1 and dates 2018-10-11.",
    "a" * 150 + " " + "b" * 200 + " " + "c" * 201 + " " + "unaffable" * 30,
    "URLs https://example.com/path?q=1&r=2#frag and e-mails someone@example.org.",
    "Combining marks: e\u0301 a\u0308 n\u0303; full-width ＡＢＣ１２３；ligature ﬁ ﬂ; ß ẞ İ ı.",
    "   leading and trailing spaces   \u3000ideographic space\u00a0nbsp  ",
    "",
]


def built_vocab(path, lower: bool) -> str:
    """A vocab covering every character of TEXTS (as word start and as `##` piece) plus some
    whole words, for when the real bert-base vocab is absent."""
    words = {w for text in TEXTS for w in tokenization.basic_tokenize(text, do_lower_case=lower)}
    chars = sorted({c for w in words for c in w})
    tokens = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + chars
        + ["##" + c for c in chars]
        + sorted(w for w in words if len(w) < 8)[:100]
        + ["un", "##aff", "##able", "##aa"]
    )
    path.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("lower", [True, False], ids=["uncased", "cased"])
def test_wordpiece_matches_transformers(lower, tmp_path):
    vocab = (
        BERT_BASE_VOCAB
        if os.path.exists(BERT_BASE_VOCAB)
        else built_vocab(tmp_path / "v.txt", lower)
    )
    ours = tokenization.WordPieceTokenizer(vocab, do_lower_case=lower)
    rust = transformers.BertTokenizer(vocab=vocab, do_lower_case=lower)
    # Google's limit is 200 characters per word; HF's default is 100.
    rust._tokenizer.model.max_input_chars_per_word = ours.max_input_chars_per_word
    python_port = tokenization_bert_legacy.BertTokenizerLegacy(vocab, do_lower_case=lower)
    python_port.wordpiece_tokenizer.max_input_chars_per_word = ours.max_input_chars_per_word
    pieces = 0
    for text in TEXTS:
        tokens = ours.tokenize(text)
        assert tokens == rust.tokenize(text), text
        # The Python port NFC-normalises first (Google's code and the Rust one do not).
        assert ours.tokenize(unicodedata.normalize("NFC", text)) == python_port.tokenize(text), text
        assert ours.encode(text) == rust.convert_tokens_to_ids(tokens)
        pieces += sum(t.startswith("##") for t in tokens)
    assert pieces > 20  # words really were split into pieces


@pytest.mark.parametrize(
    "lower,strip,config",
    [
        (True, None, {"do_lower_case": True}),
        (False, None, {"do_lower_case": False}),
        (
            True,
            False,
            {
                "tokenizer_class": "PreTrainedTokenizerFast",  # (the json as it is)
                "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
            },
        ),
    ],
    ids=["uncased", "cased", "lower-cased-with-accents"],
)
def test_wordpiece_tokenizer_json_alone_matches_transformers(
    lower, strip, config, corpus_file, tmp_path
):
    """A Hugging Face directory whose tokenizer is only a WordPiece tokenizer.json (Google's
    uncased vocab): AutoTokenizer gives bertjax's ids and segments for text pairs."""
    path = (
        BERT_BASE_VOCAB
        if os.path.exists(BERT_BASE_VOCAB)
        else built_vocab(tmp_path / "v.txt", lower)
    )
    with open(path, encoding="utf-8") as f:
        tokens = list(dict.fromkeys(line.rstrip("\n") for line in f))  # (a json has no repeats)
    (tmp_path / "hf").mkdir()
    wordpiece_json_dir(tmp_path / "hf", tokens, lower, config, strip_accents=strip)
    ours = pretrained.checkpoint_tokenizer(str(tmp_path / "hf"), None)
    assert (ours.do_lower_case, ours.strip_accents) == (lower, lower if strip is None else strip)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = (
        [t for t in TEXTS if t]
        + [  # transformers reads an empty second text as none
            line.strip() for line in _read_lines(corpus_file)[:200:10]
        ]
    )
    for a, b in itertools.pairwise(texts):
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


def corpus_vocab(path, corpus_file: str) -> str:
    """A WordPiece vocab for the test corpus: BERT's specials, every character (as word start
    and as `##` piece) and its 300 commonest words."""
    with open(corpus_file, encoding="utf-8") as f:
        words = collections.Counter(w for line in f for w in tokenization.basic_tokenize(line))
    chars = sorted({c for w in words for c in w} | {c for t in TEXTS for c in t.lower()})
    tokens = (
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        + chars
        + ["##" + c for c in chars]
        + [w for w, _ in words.most_common(300) if len(w) > 1]
    )
    path.write_text("\n".join(dict.fromkeys(tokens)) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("kind", ["wordpiece", "sentencepiece"])
def test_hugging_face_export_tokenizes_and_predicts_as_bertjax(kind, corpus_file, tmp_path):
    """A bertjax pretraining run exported by `python -m bertjax.convert`: AutoTokenizer gives
    bertjax's ids and segments for text pairs, and the exported model its logits."""
    overrides = {
        "train.total_steps": 2,
        "optimizer.warmup_steps": 1,
        "train.checkpoint_every": 2,
        "long_phase.fraction": 0.0,
        "train.eval_batches": 1,
    }
    if kind == "wordpiece":
        vocab = corpus_vocab(tmp_path / "vocab.txt", corpus_file)
        overrides.update(
            {
                "data.tokenizer": "wordpiece",
                "data.vocab_file": vocab,
                "model.vocab_size": len(Path(vocab).read_text().split("\n")) - 1,
            }
        )
    config = tiny_config(corpus_file, str(tmp_path / "cache"), **overrides)
    train.train_and_evaluate(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert convert.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    source = pretrained.Source(init_checkpoint=str(tmp_path / "run"))
    ours = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    texts = (
        [t for t in TEXTS if t]
        + [  # transformers reads an empty second text as none
            line.strip() for line in _read_lines(corpus_file)[:200:10]
        ]
    )
    rows = []
    for a, b in itertools.pairwise(texts):
        expected = [ours.cls_id, *ours.encode(a), ours.sep_id, *ours.encode(b), ours.sep_id]
        encoded = theirs(a, b)
        assert encoded["input_ids"] == expected, (a, b)
        assert encoded["token_type_ids"] == [0] * (len(ours.encode(a)) + 2) + [1] * (
            len(ours.encode(b)) + 1
        )
        if len(expected) <= config.model.max_position_embeddings:
            rows.append((expected, encoded["token_type_ids"]))
    assert len(rows) >= 10
    length = max(len(ids) for ids, _ in rows)
    ids, types, mask = (
        np.array([list(r) + [0] * (length - len(r)) for r in column])
        for column in zip(*[(i, t, [1] * len(i)) for i, t in rows])
    )
    model = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        expected = model(
            input_ids=torch.tensor(ids),
            token_type_ids=torch.tensor(types),
            attention_mask=torch.tensor(mask),
        )
    bert_config, params = pretrained.read(str(tmp_path / "run"))
    every_position = np.tile(np.arange(length), (len(ids), 1))
    mlm, nsp = BertForPreTraining(bert_config).apply(
        {"params": params}, ids, types, mask, every_position
    )
    real = mask.astype(bool)  # logits at padding positions are not compared
    assert (
        np.abs(np.asarray(mlm)[real] - expected.prediction_logits.numpy()[real]).max() <= TOLERANCE
    )
    assert np.abs(np.asarray(nsp) - expected.seq_relationship_logits.numpy()).max() <= TOLERANCE
