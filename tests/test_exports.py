"""Models that leave and come back: a fine-tuning workdir exported to the Hugging Face class of
its task (label maps, output layer, tokenizer), read by extract_features and used to start
another task (its encoder only); an imported model (WordPiece or SentencePiece) that finds
its tokenizer beside it.
Logit parity with transformers is in test_parity.py."""

import dataclasses
import itertools
import json
import os
import pathlib
import random

import jax
import numpy as np
import pytest
import tokenizers
from safetensors.numpy import load_file, save_file

from bertjax import convert, finetune
from bertjax.data import tokenization
from bertjax.families import bert_hf
from bertjax.interop import native, pretrained, pretrained_weights
from bertjax.models.bert.model import BertModel
from test_convert import random_params
from test_finetune import TINY, VOCAB, config_file, run_extract_features, sentence
from test_tokenization import make_sentences

SMALL = dataclasses.replace(TINY, num_hidden_layers=1)  # fine-tuned here: one layer compiles fast


def write_task_data(root, seed: int = 0) -> None:
    """vocab.txt, bert_config.json (TINY), and SST-2 and MRPC TSVs (a label-deciding word)."""
    rng = random.Random(seed)
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (root / "bert_config.json").write_text(json.dumps(dataclasses.asdict(SMALL)))
    for name, header, row in (
        ("SST-2", "sentence\tlabel", lambda i: f"{sentence(rng, i % 2 == 1)}\t{i % 2}"),
        (
            "MRPC",
            "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
            lambda i: f"{i % 2}\t{i}\t{i}\t{sentence(rng, i % 2 == 1)}\t{sentence(rng, True)}",
        ),
    ):
        os.makedirs(root / name)
        for split, count in (("train", 48), ("dev", 24)):
            (root / name / f"{split}.tsv").write_text(
                "\n".join([header] + [row(i) for i in range(count)]) + "\n"
            )


def fine_tune(root, task: str, workdir: str, config_name: str = "glue.py", **overrides) -> dict:
    """A one-epoch fine-tuning run of SMALL from random weights (model_config + vocab_file)."""
    config = config_file(config_name)
    config.update(
        task=task,
        data_dir=str(root),
        model_config=str(root / "bert_config.json"),
        vocab_file=str(root / "vocab.txt"),
        max_seq_length=16,
        train_batch_size=16,
        eval_batch_size=8,
        learning_rate=1e-3,
        num_train_epochs=1.0,
        seeds="1",
        log_every=3,
    )
    config.update(**overrides)
    return finetune.run(config, workdir, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def sst2_run(tmp_path_factory) -> str:
    """A one-epoch SST-2 fine-tuning workdir (one seed) on synthetic data."""
    root = tmp_path_factory.mktemp("data")
    write_task_data(root)
    fine_tune(root, "sst2", str(root / "run"))
    return str(root / "run")


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_fine_tuned_model_exports_as_sequence_classification(sst2_run, tmp_path, capsys):
    assert convert.main([sst2_run, str(tmp_path / "hf")]) == 0
    assert (
        "fine-tuned model: BertForSequenceClassification, labels ['0', '1']"
        in capsys.readouterr().out
    )
    values = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert values["architectures"] == ["BertForSequenceClassification"]
    assert values["id2label"] == {"0": "0", "1": "1"} and values["label2id"] == {"0": 0, "1": 1}
    assert values["problem_type"] == "single_label_classification"
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    _, params = pretrained.read(sst2_run)
    encoder = {bert_hf.path_to_hf("bert/" + p)[0] for p in native.tree.flatten(params["bert"])}
    assert set(tensors) == encoder | {"classifier.weight", "classifier.bias"}
    np.testing.assert_array_equal(tensors["classifier.weight"], params["output_weights"])
    assert {"tokenizer.json", "vocab.txt", "README.md"} <= set(os.listdir(tmp_path / "hf"))
    card = (tmp_path / "hf" / "README.md").read_text()
    assert 'BertForSequenceClassification.from_pretrained("hf")' in card  # (not its temporary)
    assert "| fine-tuning | sst2, seed 1, best epoch 1: dev accuracy" in card


def test_fine_tuned_model_gives_its_encoder_and_tokenizer(sst2_run):
    """Its encoder (and tokenizer, from the workdir) for extract_features, probe and a new
    fine-tuning run; not what pretraining from a checkpoint needs."""
    model, params, tokenizer = pretrained_weights.load_encoder(
        pretrained.Source(init_checkpoint=sst2_run)
    )
    _, stored = pretrained.read(sst2_run)
    jax.tree.map(np.testing.assert_array_equal, params, stored["bert"])
    assert model.config.hidden_size == TINY.hidden_size and tokenizer.vocab_size == len(VOCAB)
    run = pretrained.pretraining_run(pretrained.Source(init_checkpoint=sst2_run))
    assert run.finetuned_task == "sst2" and run.config is None
    with pytest.raises(pretrained.ConversionError, match="has no predictions, seq_relationship"):
        pretrained_weights.load_pretrained(
            sst2_run,
            {
                "bert": None,
                "predictions": None,  # (pretraining)
                "seq_relationship": None,
            },
            dataclasses.replace(SMALL, scan_layers=True),
        )


def test_fine_tuned_model_starts_another_task(sst2_run, tmp_path, capsys):
    root = os.path.dirname(sst2_run)
    summary = fine_tune(
        pathlib.Path(root),
        "mrpc",
        str(tmp_path / "mrpc"),
        init_checkpoint=sst2_run,
        model_config="",
        vocab_file="",
    )
    assert summary["seeds"][0]["best_step"] == 3
    assert (
        f"init_checkpoint {sst2_run} was fine-tuned on sst2: this run starts from its "
        "encoder, with a new output layer" in capsys.readouterr().out
    )


def test_imported_model_finds_its_tokenizer_beside_it(tmp_path):
    """HF -> bertjax writes the tokenizer beside the checkpoint; without one, the message
    names the flag of the command that reads it."""
    bert_config, params = TINY, random_params(TINY)
    bert_hf.save_hf(bert_config, params, str(tmp_path / "hf"))
    (tmp_path / "hf" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    assert {"vocab.txt", native.TOKENIZER_FILE} <= set(os.listdir(tmp_path / "imported"))
    source = pretrained.Source(init_checkpoint=str(tmp_path / "imported"))
    run = pretrained.pretraining_run(source)
    assert pretrained.tokenizer_of(source, run).convert_ids_to_tokens([7]) == [VOCAB[7]]
    assert pretrained.model_config_of(source, run).hidden_size == TINY.hidden_size
    native.save_bertjax(bert_config, params, str(tmp_path / "bare"))
    with pytest.raises(pretrained.PretrainedError, match="pass --vocab_file=PATH"):
        pretrained.tokenizer_of(
            pretrained.Source(init_checkpoint=str(tmp_path / "bare"), vocab_flag="--vocab_file"),
            run,
        )
    encoder = pretrained_weights.load_pretrained(
        str(tmp_path / "imported"),
        {"bert": pretrained_weights.abstract_params_on_one_device(BertModel(TINY))},
        TINY,
    )["bert"]
    jax.tree.map(np.testing.assert_array_equal, encoder, params["bert"])


def test_sentencepiece_model_leaves_and_comes_back(tmp_path):
    """bertjax (SentencePiece) -> HF -> bertjax: the HF export carries the model itself, so
    the HF directory (as init_checkpoint) and the imported one tokenize exactly as the
    original, and extract_features reads the imported one with no tokenizer flag. Without
    the model, it is rebuilt from the Unigram tokenizer.json; a tokenizer.json of another
    kind says what to pass."""
    tokenizer = tokenization.SentencePieceTokenizer(
        tokenization.train_sentencepiece(make_sentences(), str(tmp_path / "sp"), vocab_size=200)
    )
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size)
    native.save_bertjax(config, random_params(config), str(tmp_path / "bertjax"))
    native.save_tokenizer(tokenizer, str(tmp_path / "bertjax"))
    assert convert.main([str(tmp_path / "bertjax"), str(tmp_path / "hf")]) == 0
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    texts = [
        *make_sentences(20, seed=1),
        "Unseen wörds, [MASK] and   spaces.",
        " ＦＵＬＬ\twidth ① ",
        "",
    ]
    for directory in ("hf", "imported"):
        source = pretrained.Source(init_checkpoint=str(tmp_path / directory))
        found = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
        assert found.fingerprint() == tokenizer.fingerprint(), directory
        assert [found.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
    (tmp_path / "in.txt").write_text("Unseen wörds and spaces.\n")
    result = run_extract_features(
        tmp_path, f"{tmp_path}/imported", "--max_seq_length=32", "--layers=-1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    tokens = [f["token"] for f in json.loads((tmp_path / "out.jsonl").read_text())["features"]]
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode("Unseen wörds and spaces."))
    assert tokens == ["[CLS]", *pieces, "[SEP]"]
    os.remove(tmp_path / "hf" / native.SENTENCEPIECE_FILE)  # (as exports before it had)
    source = pretrained.Source(init_checkpoint=str(tmp_path / "hf"))
    rebuilt = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    assert [rebuilt.encode(t) for t in texts] == [tokenizer.encode(t) for t in texts]
    assert rebuilt.continuation_mask().tolist() == tokenizer.continuation_mask().tolist()
    spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    lower = {"type": "Sequence", "normalizers": [{"type": "Lowercase"}]}
    # A BPE tokenizer.json is read by the tokenizers library (ModernBERT's; a broken one is one
    # line), a Unigram one with rules bertjax does not apply is refused.
    for changed, message in (
        (
            {"model": {**spec["model"], "type": "BPE"}},
            r"is not a tokenizer.json the "
            r"tokenizers library reads \(.*\); pass --config.vocab_",
        ),
        (
            {"normalizer": lower},
            r"tokenizer.json is a Unigram tokenizer.json of a form "
            r"bertjax cannot reproduce.*pass --config.vocab_",
        ),
    ):
        (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({**spec, **changed}))
        with pytest.raises(pretrained.PretrainedError, match=message) as error:
            pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
        assert "\n" not in str(error.value)


WORDPIECE_TEXTS = [
    "Crème Brûlée, naïve CAFÉ! Ångström's résumé?",
    "中文分词：我爱北京。 漢字 and 한국어",
    'Punctuation!!! ((quotes)) "x" $5 @home #tag',
    "MiXeD CaSe, unaffable",
    "x" * 150 + " spaces\tand\nnewlines\u00a0nbsp",
    "",
]


def wordpiece_json_dir(
    path, tokens: list[str], lower: bool, tokenizer_config: dict | None, **normalizer
) -> tokenizers.Tokenizer:
    """A Hugging Face directory (random TINY-shaped weights) whose tokenizer is only a WordPiece
    tokenizer.json as the `tokenizers` library builds Google's (lower-cased or not), with
    `tokenizer_config` (None: no tokenizer_config.json); returns that tokenizer."""
    ids = {t: i for i, t in enumerate(tokens)}
    built = tokenizers.Tokenizer(tokenizers.models.WordPiece(ids, unk_token="[UNK]"))
    built.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lower, **normalizer)
    built.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
    built.post_processor = tokenizers.processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )
    built.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    config = dataclasses.replace(TINY, vocab_size=len(tokens))
    bert_hf.save_hf(config, random_params(config), str(path))
    built.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return built


def wordpiece_vocab(texts: list[str], lower: bool) -> list[str]:
    """BERT's special tokens, every character of `texts` (as a word and as a `##` piece) and
    their short words, lower-cased or not."""
    words = {w for t in texts for w in tokenization.basic_tokenize(t, do_lower_case=lower)}
    chars = sorted({c for w in words for c in w})
    return list(
        dict.fromkeys(
            [
                "[PAD]",
                "[UNK]",
                "[CLS]",
                "[SEP]",
                "[MASK]",
                *chars,
                *("##" + c for c in chars),
                *sorted(w for w in words if len(w) < 8),
                "un",
                "##aff",
                "##able",
            ]
        )
    )


@pytest.mark.parametrize("lower", [True, False], ids=["uncased", "cased"])
def test_hugging_face_wordpiece_tokenizer_json_alone_is_read(lower, tmp_path):
    """A Hugging Face directory whose tokenizer is only a WordPiece tokenizer.json (BertNormalizer,
    BertPreTokenizer, `##` pieces: Google's) is read as bertjax's WordPiece with the json's
    vocabulary and casing: the same ids and segments as `tokenizers` gives for text pairs, for
    fine-tuning (init_checkpoint) and `convert` (which writes it beside the import)."""
    tokens = wordpiece_vocab(WORDPIECE_TEXTS, lower)
    built = wordpiece_json_dir(
        tmp_path / "hf", tokens, lower, None if lower else {"do_lower_case": False}
    )
    source = pretrained.Source(init_checkpoint=str(tmp_path / "hf"), do_lower_case=lower)
    ours = pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
    assert (ours.do_lower_case, ours.vocab_size, ours.max_input_chars_per_word) == (
        lower,
        len(tokens),
        100,
    )  # (transformers' BertTokenizer: 100 characters a word)
    pieces = 0
    for a, b in itertools.pairwise(WORDPIECE_TEXTS):
        expected = built.encode(a, b)
        assert [
            ours.cls_id,
            *ours.encode(a),
            ours.sep_id,
            *ours.encode(b),
            ours.sep_id,
        ] == expected.ids, (a, b)
        assert expected.type_ids == [0] * (len(ours.encode(a)) + 2) + [1] * (
            len(ours.encode(b)) + 1
        )
        pieces += sum(t.startswith("##") for t in ours.convert_ids_to_tokens(ours.encode(a)))
    assert pieces > 10 and ours.encode("CAFÉ") == built.encode("CAFÉ", add_special_tokens=False).ids
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    imported = pretrained.Source(init_checkpoint=str(tmp_path / "imported"), do_lower_case=lower)
    assert (
        pretrained.tokenizer_of(imported, pretrained.pretraining_run(imported)).fingerprint()
        == ours.fingerprint()
    )


def test_hugging_face_wordpiece_tokenizer_json_bertjax_cannot_reproduce(tmp_path):
    """A WordPiece tokenizer.json of another form, or cased differently than transformers would
    apply it or than the run says, gets one line saying what differs."""
    tokens = wordpiece_vocab(WORDPIECE_TEXTS, False)
    source = pretrained.Source(init_checkpoint=str(tmp_path / "hf"), do_lower_case=False)

    def refused(pattern: str) -> None:
        with pytest.raises(pretrained.PretrainedError, match=pattern) as error:
            pretrained.tokenizer_of(source, pretrained.pretraining_run(source))
        assert "\n" not in str(error.value) and "pass --config.vocab_file=PATH" in str(error.value)

    wordpiece_json_dir(tmp_path / "hf", tokens, False, None)  # transformers would lower-case it
    refused(
        r"tokenizer.json \(lowercase False, strip_accents False\) and tokenizer_config.json "
        r"\(do_lower_case True, strip_accents True: absent, which transformers' BertTokenizer "
        r"applies\) disagree"
    )
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    for changed, pattern in (
        ({"normalizer": {"type": "Lowercase"}}, "its normalizer is Lowercase, not BertNormalizer"),
        ({"pre_tokenizer": {"type": "Whitespace"}}, "its pre_tokenizer is not BertPreTokenizer"),
        (
            {"model": {**spec["model"], "vocab": {t: i * 2 for i, t in enumerate(tokens)}}},
            r"its vocab's ids are not 0, 1, 2, ... \(holes or repeats\)",
        ),
        ({"post_processor": None}, r"its post_processor \(None\) does not give \[CLS\] A"),
    ):
        (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({**spec, **changed}))
        refused(r"tokenizer.json is a WordPiece tokenizer bertjax cannot reproduce: " + pattern)
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(spec))
    source = dataclasses.replace(source, do_lower_case=True)
    with pytest.raises(
        pretrained.PretrainedError,
        match=r"the tokenizer.json of .*/hf is cased "
        r"but do_lower_case=True; set --config.do_lower_case=False$",
    ):
        pretrained.tokenizer_of(source, pretrained.pretraining_run(source))


def test_hugging_face_fine_tuned_model_gives_its_encoder(sst2_run, tmp_path, capsys):
    """A fine-tuned HF directory (bertjax's SST-2 export; as a token classifier, without a
    pooler, as transformers saves one) starts another task from its encoder only, said in
    the same line as for a bertjax workdir; `convert` imports its encoder."""
    assert convert.main([sst2_run, str(tmp_path / "hf")]) == 0
    _, stored = pretrained.read(sst2_run)
    root = os.path.dirname(sst2_run)
    summary = fine_tune(
        pathlib.Path(root),
        "mrpc",
        str(tmp_path / "mrpc"),
        init_checkpoint=str(tmp_path / "hf"),
        model_config="",
        vocab_file="",
    )
    assert summary["seeds"][0]["best_step"] == 3
    assert (
        f"init_checkpoint {tmp_path / 'hf'} was fine-tuned on BertForSequenceClassification "
        "(labels 0, 1): this run starts from its encoder, with a new output layer"
        in capsys.readouterr().out
    )
    _, encoder, _ = pretrained_weights.load_encoder(
        pretrained.Source(init_checkpoint=str(tmp_path / "hf"))
    )
    jax.tree.map(np.testing.assert_array_equal, encoder, stored["bert"])
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("bert.pooler.")},
        str(tmp_path / "hf" / "model.safetensors"),
    )
    values = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(
        json.dumps({**values, "architectures": ["BertForTokenClassification"]})
    )
    run = pretrained.pretraining_run(pretrained.Source(init_checkpoint=str(tmp_path / "hf")))
    assert run.finetuned_task == "BertForTokenClassification (labels 0, 1)"
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
    assert (
        "skipped (a task's output layer, not carried over): classifier.bias, "
        "classifier.weight" in capsys.readouterr().out
    )
    _, imported = native.load_bertjax(str(tmp_path / "imported"))
    pooler = imported["bert"].pop("pooler")
    assert np.std(pooler["dense"]["kernel"]) == pytest.approx(SMALL.initializer_range, rel=0.2)
    stored["bert"].pop("pooler")
    jax.tree.map(np.testing.assert_array_equal, imported, {"bert": stored["bert"]})
