"""Hugging Face ModernBERT directories into bertjax (no torch): read as `init_checkpoint` and
as a `python -m bertjax.convert` source with their BPE `tokenizer.json`; bertjax's export read
back with identical parameters; a tiny ModernBERT fine-tuned on a GLUE-like task through
`bertjax.finetune`, exported as `ModernBertForSequenceClassification`; feature extraction.
Against transformers itself: tests/test_modernbert_finetune_parity.py (`parity`)."""

import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import pytest
import tokenizers as tk

from bertjax import convert, finetune, train
from bertjax.checkpoints import checkpoint
from bertjax.data import bpe, corpus_source, pipeline, tokenization
from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.families import modernbert_hf
from bertjax.interop import hf as hf_files, native, pretrained, pretrained_weights, tree
from bertjax.models import families
from bertjax.models.modernbert import heads as modernbert_heads, model as modernbert
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.tasks import features, glue, ner, squad, squad_predict
from bertjax.training import finetune_setup, init_architecture, tokenizer_model, validate
from test_finetune import (  # noqa: F401
    REPO_ROOT,
    config_file,
    data_root,
    official_squad_v1,
    run_extract_features,
    sentence,
)
from test_modernbert_train import modernbert_tiny, small_config
from test_train import cache_dir, corpus_file  # noqa: F401 (fixtures)

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
TEXTS = [
    "the movie was good .",
    "a plot and very bad film",
    "what a lovely story ?",
    "john went to paris",
    "acme was dull and boring",
    "café naïve – déjà vu",
] * 20


def bpe_tokenizer(path: str, vocab_size: int = 300) -> str:
    """A byte-level BPE tokenizer.json of ModernBERT's form (no prefix space, BERT's special
    tokens, `[CLS] A [SEP] B [SEP]`), trained on TEXTS; returns its path."""
    hf = tk.Tokenizer(tk.models.BPE(unk_token="[UNK]"))
    hf.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tk.decoders.ByteLevel()
    hf.train_from_iterator(
        TEXTS,
        tk.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIALS,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    cls, sep = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
    hf.post_processor = tk.processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    hf.save(path)
    return path


def tiny_config(vocab_size: int, **overrides) -> ModernBertConfig:
    return ModernBertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=2,
        local_attention=8,
        max_position_embeddings=64,
        pad_token_id=3,
        **overrides,
    )


def random_params(config: ModernBertConfig, seed: int = 0) -> dict:
    model = modernbert.ModernBertForMaskedLM(config)
    params = model.init(jax.random.PRNGKey(seed), *modernbert.example_inputs())["params"]
    return jax.tree.map(np.asarray, nn.meta.unbox(params))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    """A transformers-layout ModernBertForMaskedLM directory (bertjax's writer, random
    weights) with a BPE tokenizer.json beside it, as a Hugging Face download has."""
    directory = str(tmp_path_factory.mktemp("hf") / "modernbert")
    tokenizer_json = bpe_tokenizer(os.path.join(directory, "tokenizer.json"))
    config = tiny_config(bpe.BpeTokenizer(tokenizer_json).vocab_size)
    modernbert_hf.save_hf(config, random_params(config), directory)
    return directory


def test_the_bpe_tokenizer_tokenizes_as_the_tokenizers_library(tmp_path):
    path = bpe_tokenizer(str(tmp_path / "tokenizer.json"))
    reference, ours = tk.Tokenizer.from_file(path), bpe.BpeTokenizer(path)
    for text in ("the movie was good .", "café naïve – déjà vu", "unseen wordz!"):
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids
        assert ours.tokenize(text) == reference.encode(text, add_special_tokens=False).tokens
    assert (ours.cls_id, ours.sep_id, ours.mask_id, ours.pad_id, ours.unk_id) == tuple(
        reference.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]")
    )
    # A word alone is split as inside a sentence (after a space), for CoNLL and SQuAD words.
    words = "the movie was good".split()
    assert ours.tokenize(words[0]) + [
        p for w in words[1:] for p in ours.tokenize_word(w)
    ] == ours.tokenize("the movie was good")
    assert ours.tokenize_word("movie") != ours.tokenize("movie")
    assert features.word_tokenizer(ours, ids=True)("movie") == ours.encode(" movie")
    mask = ours.continuation_mask()
    assert not mask[ours.cls_id] and not mask[ours.convert_tokens_to_ids(["\u0120the"])[0]]
    assert mask[ours.convert_tokens_to_ids(["e"])[0]]
    native.save_tokenizer(ours, str(tmp_path / "beside"))
    assert native.tokenizer_beside(str(tmp_path / "beside")).fingerprint() == ours.fingerprint()


def test_a_tokenizer_json_without_the_special_tokens_is_one_line(tmp_path):
    hf = tk.Tokenizer(tk.models.BPE(unk_token="<unk>"))
    hf.train_from_iterator(
        TEXTS, tk.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>"])
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(pipeline.DataError, match=r"lacks the special tokens \[PAD\]") as e:
        bpe.BpeTokenizer(str(tmp_path / "tokenizer.json"))
    assert "\n" not in str(e.value)


def test_a_hugging_face_modernbert_directory_is_read_with_its_bpe_tokenizer(hf_dir, monkeypatch):
    detected = []
    detect_format = pretrained.detect_format
    monkeypatch.setattr(
        pretrained, "detect_format", lambda path: detected.append(path) or detect_format(path)
    )
    source = pretrained.Source(init_checkpoint=hf_dir)
    run = pretrained.pretraining_run(source)
    config = pretrained.model_config_of(source, run)
    assert families.name_of(config) == "modernbert" and run.finetuned_task == ""
    tokenizer = pretrained.tokenizer_of(source, run)
    assert detected == [hf_dir] and run.format == "hf"  # (the format told once, for both)
    assert isinstance(tokenizer, bpe.BpeTokenizer)
    assert tokenizer.vocab_size == config.vocab_size
    expected = random_params(config)  # what bertjax's export wrote
    abstract = pretrained_weights.abstract_params_on_one_device(
        modernbert.ModernBertForMaskedLM(config)
    )
    loaded = pretrained_weights.load_pretrained(hf_dir, abstract, config)
    for path, value in tree.flatten(expected).items():
        np.testing.assert_array_equal(np.asarray(tree.flatten(loaded)[path]), value, path)


def test_convert_a_hugging_face_modernbert_to_bertjax_and_back(hf_dir, tmp_path):
    """HF -> bertjax (params-only checkpoint + its tokenizer) -> HF: identical weights and the
    same tokenizer.json, and the bertjax checkpoint starts a ModernBERT run (init_checkpoint)
    with identical parameters."""
    assert convert.main([hf_dir, str(tmp_path / "bertjax")]) == 0
    assert convert.main([str(tmp_path / "bertjax"), str(tmp_path / "hf")]) == 0
    config, params = modernbert_hf.load_hf(hf_dir)
    again_config, again = modernbert_hf.load_hf(str(tmp_path / "hf"))
    assert again_config == config
    for path, value in tree.flatten(params).items():
        np.testing.assert_array_equal(tree.flatten(again)[path], value, path)
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == json.loads(
        Path(os.path.join(hf_dir, "tokenizer.json")).read_text(encoding="utf-8")
    )
    run_config = families.model_config({"family": "modernbert", **dataclasses.asdict(config)})
    abstract = pretrained_weights.abstract_params_on_one_device(
        modernbert.ModernBertForMaskedLM(run_config)
    )
    loaded = pretrained_weights.load_pretrained(str(tmp_path / "bertjax"), abstract, run_config)
    for path, value in tree.flatten(params).items():
        np.testing.assert_array_equal(np.asarray(tree.flatten(loaded)[path]), value, path)
    other = dataclasses.replace(run_config, local_attention=16)
    with pytest.raises(tree.ConversionError, match="local_attention: checkpoint 8"):
        pretrained_weights.load_pretrained(str(tmp_path / "bertjax"), abstract, other)


@pytest.fixture(scope="module")
def bare_dir(hf_dir, tmp_path_factory) -> str:
    """hf_dir's encoder as transformers saves a bare ModernBertModel: its weights without the
    `model.` prefix, no prediction head or decoder, architectures ModernBertModel."""
    from safetensors.numpy import save_file

    directory = tmp_path_factory.mktemp("bare")
    tensors = hf_files.read_tensors(hf_dir)
    save_file(
        {
            name[len("model.") :]: value
            for name, value in tensors.items()
            if name.startswith("model.")
        },
        str(directory / "model.safetensors"),
    )
    values = json.loads(Path(os.path.join(hf_dir, "config.json")).read_text(encoding="utf-8"))
    (directory / "config.json").write_text(
        json.dumps({**values, "architectures": ["ModernBertModel"]})
    )
    shutil.copy(os.path.join(hf_dir, "tokenizer.json"), directory / "tokenizer.json")
    return str(directory)


def test_a_bare_modernbert_model_gives_its_encoder_and_the_head_starts_fresh(
    hf_dir, bare_dir, tmp_path, capsys
):
    source = pretrained.Source(init_checkpoint=bare_dir)
    run = pretrained.pretraining_run(source)
    assert run.finetuned_task == ""
    config = pretrained.model_config_of(source, run)
    model = modernbert_heads.ModernBertForSequenceClassification(config, 2)
    abstract = pretrained_weights.abstract_params_on_one_device(model)
    parts = {name: abstract[name] for name in families.pretrained_parts(config)}
    loaded = pretrained_weights.load_pretrained(
        bare_dir, parts, config, optional=families.optional_pretrained_parts(config)
    )
    assert set(loaded) == {"model"}  # the head keeps the fine-tuning model's initialisation
    full = tree.flatten(modernbert_hf.load_hf(hf_dir)[1])
    for path, value in tree.flatten(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), full[path], path)
    # Pretraining needs the MLM head; converting would write a model without it.
    with pytest.raises(tree.ConversionError, match="has no decoder, head parameters"):
        pretrained_weights.load_pretrained(
            bare_dir,
            pretrained_weights.abstract_params_on_one_device(
                modernbert.ModernBertForMaskedLM(config)
            ),
            config,
        )
    capsys.readouterr()  # (the head's warning above, when absl logs to stderr)
    assert convert.main([bare_dir, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a bare ModernBertModel (no MLM head)" in err[0], err


def test_pretraining_data_tokenizes_with_a_bpe_tokenizer_json(hf_dir, tmp_path):
    def settings(**data):
        return DataSettings.of({**small_config("corpus.txt", "").data, **data})

    path = os.path.join(hf_dir, "tokenizer.json")
    tokenizer = corpus_source.load_or_train_tokenizer(
        settings(tokenizer="bpe", vocab_file=path), str(tmp_path)
    )
    assert isinstance(tokenizer, bpe.BpeTokenizer)
    assert (
        tokenizer.encode(" john went")
        == tk.Tokenizer.from_file(path).encode(" john went", add_special_tokens=False).ids
    )
    with pytest.raises(
        pipeline.DataError,
        match=r"data\.tokenizer=bpe needs --config\.data\.vocab_file=tokenizer\.json",
    ):
        corpus_source.load_or_train_tokenizer(settings(tokenizer="bpe"), str(tmp_path))
    source = pretrained.Source(vocab_file=path)  # fine-tuning's vocab_file: told by its form
    assert isinstance(
        pretrained.tokenizer_of(source, pretrained.PretrainingRun({})), bpe.BpeTokenizer
    )


def test_continued_pretraining_takes_the_checkpoint_architecture(hf_dir, tmp_path):
    """Issue 42: a run from a Hugging Face ModernBERT takes its architecture and padding id
    (configs/modernbert_tiny.py's defaults replaced, as from_pretrained does); an override
    given on the command line that contradicts it is one line naming both values, before any
    data work; one that agrees is accepted. The padding id is the tokenizer's [PAD]."""
    found = modernbert_hf.hf_config(
        tree.read_json_config(os.path.join(hf_dir, "config.json"), "Hugging Face"), hf_dir
    )
    config = modernbert_tiny()
    config.model.num_hidden_layers = 3  # (given, and the checkpoint's)
    changed = init_architecture.checkpoint_model(
        config.model.to_dict(), hf_dir, {"model.num_hidden_layers"}
    )
    config.model.update(changed)
    assert set(changed) >= {"vocab_size", "hidden_size", "pad_token_id"}
    assert families.model_config(config.model.to_dict()) == dataclasses.replace(
        found, dtype="float32"
    )  # (dtype, remat and dropout: the run's)
    config = modernbert_tiny()
    config.model.hidden_size = 64
    config.train.init_checkpoint = hf_dir
    with pytest.raises(
        pretrained.PretrainedError,
        match=r"^--config.model.hidden_size=64 \(the "
        r"checkpoint's: 32\) contradicts init_checkpoint .*drop the override",
    ):
        train.train_and_evaluate(config, str(tmp_path / "run"), overrides={"model.hidden_size"})
    assert not (tmp_path / "run").exists()
    config = modernbert_tiny()  # from scratch, with the checkpoint's tokenizer
    config.data.update(tokenizer="bpe", vocab_file=os.path.join(hf_dir, "tokenizer.json"))
    tokenizer = bpe.BpeTokenizer(config.data.vocab_file)
    with pytest.raises(
        ConfigError,
        match=r"^model.pad_token_id=0 but the tokenizer's \[PAD\] "
        r"is 3; set --config.model.pad_token_id=3$",
    ):
        init_architecture.check_tokenizer(families.model_config(config.model), tokenizer)
    config.model.update(init_architecture.checkpoint_model(config.model.to_dict(), hf_dir))
    init_architecture.check_tokenizer(families.model_config(config.model), tokenizer)


def test_a_fresh_run_takes_padding_and_vocabulary_from_its_tokenizer(tmp_path):
    """Issue 52: a new ModernBERT run with its own BPE tokenizer.json takes the tokenizer's
    [PAD] id and (where the config's table is smaller) its size, told in a line, instead of
    two refusals in turn; a value set on the command line that contradicts the tokenizer is
    refused in one line before any data work, and one that agrees is kept."""
    path = bpe_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    tokenizer = bpe.BpeTokenizer(path)
    assert (tokenizer.pad_id, tokenizer.vocab_size) == (3, 300)
    config = modernbert_tiny()
    config.data.update(tokenizer="bpe", vocab_file=path)
    config.model.vocab_size = 256
    data = validate.settings(config).data
    changed = tokenizer_model.model_of_tokenizer_file(config.model.to_dict(), data, ())
    assert changed == {"pad_token_id": 3, "vocab_size": 300}
    config.model.update(changed)
    init_architecture.check_tokenizer(families.model_config(config.model), tokenizer)  # accepted
    config.model.vocab_size = 512  # (a larger table: kept)
    assert tokenizer_model.model_of_tokenizer_file(config.model.to_dict(), data, ()) == {}
    config = modernbert_tiny()
    config.data.update(tokenizer="bpe", vocab_file=path)
    with pytest.raises(
        ConfigError,
        match=r"^--config.model.pad_token_id=0 \(the tokenizer's: 3, its \[PAD\]\) contradicts "
        r"the tokenizer: drop the override \(the run takes the tokenizer's\), or name the "
        r"tokenizer it belongs to as --config.data.vocab_file$",
    ):
        train.train_and_evaluate(
            config, str(tmp_path / "run"), overrides={"model.pad_token_id", "model.hidden_size"}
        )
    assert not (tmp_path / "run").exists()
    config.model.update(pad_token_id=3, vocab_size=300)
    assert (
        tokenizer_model.model_of_tokenizer_file(
            config.model.to_dict(), data, {"model.pad_token_id", "model.vocab_size"}
        )
        == {}
    )


@pytest.mark.slow  # a real pretraining run
def test_pretraining_continues_a_transformers_modernbert_with_its_tokenizer(
    hf_dir, corpus_file, cache_dir, tmp_path
):
    """`train.init_checkpoint` a Hugging Face ModernBERT and `data.tokenizer=bpe` its
    tokenizer.json: the run tokenizes as the checkpoint did, starts from its weights, records
    the tokenizer, and exports it unchanged."""
    _hf_config, hf_params = modernbert_hf.load_hf(hf_dir)
    config = small_config(corpus_file, cache_dir)  # (its model: the checkpoint's, not restated)
    config.data.update(
        tokenizer="bpe", vocab_file=os.path.join(hf_dir, "tokenizer.json"), max_seq_length=64
    )
    config.long_phase.fraction = 0.0
    config.train.update(total_steps=2, checkpoint_every=2, eval_batches=1, init_checkpoint=hf_dir)
    config.optimizer.warmup_steps = 1
    train.train_and_evaluate(config, str(tmp_path / "run"))
    tokenizer = bpe.BpeTokenizer(config.data.vocab_file)
    assert (
        checkpoint.read_meta(str(tmp_path / "run" / "checkpoints"))["tokenizer"]
        == tokenizer.fingerprint()
    )
    after = tree.flatten(native.load_bertjax(str(tmp_path / "run"))[1])
    for path, value in tree.flatten(hf_params).items():  # two steps of at most the peak rate
        np.testing.assert_allclose(after[path], value, atol=1e-2, err_msg=path)
    assert convert.main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text(encoding="utf-8") == Path(
        config.data.vocab_file
    ).read_text(encoding="utf-8")


def test_the_export_keeps_what_the_tokenizer_says(hf_dir, tmp_path, capsys):
    """Issue 42: a ModernBERT run recorded with pad_token_id 0 ([UNK] for its BPE tokenizer,
    whose [PAD] is 3) exports pad_token_id 3; a SentencePiece ModernBERT's tokenizer_config
    lists no token_type_ids (the model has none); convert says which step it exported."""
    tokenizers_ = {
        "bpe": bpe.BpeTokenizer(os.path.join(hf_dir, "tokenizer.json")),
        "sentencepiece": tokenization.SentencePieceTokenizer(
            tokenization.train_sentencepiece(TEXTS, str(tmp_path / "sp"), 60)
        ),
    }
    for name, tokenizer in tokenizers_.items():
        config = dataclasses.replace(tiny_config(tokenizer.vocab_size), pad_token_id=0)
        run = str(tmp_path / name / "run")
        checkpoint.save_params(
            run,
            random_params(config),
            {"model": families.recorded_fields(config)},
        )
        native.save_tokenizer(tokenizer, run)
        capsys.readouterr()
        assert convert.main([run, str(tmp_path / name / "hf")]) == 0
        assert "step 0: the latest checkpoint in" in capsys.readouterr().out
        exported = json.loads((tmp_path / name / "hf" / "config.json").read_text())
        assert exported["pad_token_id"] == tokenizer.pad_id
        tokenizer_config = json.loads(
            (tmp_path / name / "hf" / "tokenizer_config.json").read_text()
        )
        assert tokenizer_config["model_input_names"] == ["input_ids", "attention_mask"]
    assert tokenizers_["bpe"].pad_id == 3


def test_squad_words_take_the_pieces_they_have_in_running_text(hf_dir):
    tokenizer = pretrained.checkpoint_tokenizer(hf_dir, None)
    example = squad.SquadExample("q", "who was good ?", ["john", "was", "good", "."], "john", 0, 0)
    rows, _ = squad.convert_examples_to_features([example], tokenizer, 64, 16, 32, True)
    first_doc = 1 + len(tokenizer.tokenize("who was good ?")) + 1
    doc = tokenizer.tokenize(" john was good .")
    assert rows.tokens[0][first_doc : first_doc + len(doc)] == doc
    john = len(tokenizer.tokenize_word("john"))
    assert (rows.start_positions[0], rows.end_positions[0]) == (first_doc, first_doc + john - 1)


def fine_tune_sst2(init_checkpoint: str, root) -> dict:
    """Fine-tunes `init_checkpoint` (mean pooling) on an SST-2-like task of 64 rows written
    under `root`; returns the run's summary (the run in root/run)."""
    rng = random.Random(0)
    os.makedirs(root / "SST-2")
    for split, count in (("train", 64), ("dev", 16)):
        rows = [f"{sentence(rng, i % 2 == 1)}\t{i % 2}" for i in range(count)]
        (root / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    config = config_file("glue.py")
    config.update(
        task="sst2",
        data_dir=str(root),
        init_checkpoint=init_checkpoint,
        max_seq_length=16,
        train_batch_size=16,
        eval_batch_size=8,
        learning_rate=3e-3,
        log_every=4,
        num_train_epochs=4.0,
        classifier_pooling="mean",
    )
    return finetune.run(config, str(root / "run"), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def sst2_run(hf_dir, tmp_path_factory) -> str:
    """A fine-tuned tiny ModernBERT (mean pooling) on an SST-2-like task of 64 rows."""
    root = tmp_path_factory.mktemp("glue")
    summary = fine_tune_sst2(hf_dir, root)
    assert summary["seeds"][0]["dev"]["dev"]["accuracy"] >= 0.75, summary["seeds"]
    return str(root / "run")


@pytest.mark.slow  # a real fine-tuning run: about 40 s of CPU
def test_a_bare_modernbert_model_fine_tunes(bare_dir, tmp_path):
    summary = fine_tune_sst2(bare_dir, tmp_path)
    assert summary["seeds"][0]["dev"]["dev"]["accuracy"] >= 0.75, summary["seeds"]


@pytest.mark.slow  # a real fine-tuning run: about 40 s of CPU
def test_a_modernbert_fine_tunes_on_glue_and_exports_to_its_transformers_class(
    sst2_run, hf_dir, tmp_path
):
    meta_config = native.config_of(native.checkpoint_dir(sst2_run))
    assert isinstance(meta_config, ModernBertConfig)
    assert meta_config.classifier_pooling == "mean"
    assert convert.main([sst2_run, str(tmp_path / "hf")]) == 0
    values = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert values["architectures"] == ["ModernBertForSequenceClassification"]
    assert (values["classifier_pooling"], values["num_labels"]) == ("mean", 2)
    names = set(hf_files.read_tensors(str(tmp_path / "hf")))
    assert {
        "classifier.weight",
        "classifier.bias",
        "head.dense.weight",
        "model.final_norm.weight",
    } <= names
    assert not any(name.startswith("decoder.") for name in names)
    assert os.path.isfile(tmp_path / "hf" / "tokenizer.json")
    # The export as the init_checkpoint of another fine-tuning: its encoder and head.
    source = pretrained.Source(init_checkpoint=str(tmp_path / "hf"))
    run = pretrained.pretraining_run(source)
    assert run.finetuned_task == "ModernBertForSequenceClassification (labels 0, 1)"
    config = pretrained.model_config_of(source, run)
    model = modernbert_heads.ModernBertForSequenceClassification(config, 2)
    abstract = pretrained_weights.abstract_params_on_one_device(model)
    loaded = pretrained_weights.load_pretrained(
        str(tmp_path / "hf"), {"model": abstract["model"], "head": abstract["head"]}, config
    )
    tuned = native.load_bertjax(sst2_run)[1]
    for path, value in tree.flatten(loaded).items():
        np.testing.assert_array_equal(np.asarray(value), tree.flatten(tuned)[path], path)
    assert convert.main([str(tmp_path / "hf"), str(tmp_path / "again")]) == 1


def test_extract_features_of_a_modernbert(hf_dir, tmp_path):
    """The CLI on a transformers ModernBERT directory: its BPE tokens and layers' vectors, the
    last one the encoder's output."""
    (tmp_path / "in.txt").write_text("the movie was good .\njohn ||| paris\n")
    result = run_extract_features(tmp_path, hf_dir, "--max_seq_length=16", "--layers=-1,-3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Wrote 2 records (layers -1,-3)" in result.stdout
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    model, params, tokenizer = pretrained_weights.load_encoder(
        pretrained.Source(init_checkpoint=hf_dir)
    )
    ids = np.array(
        [[tokenizer.cls_id, *tokenizer.encode("the movie was good ."), tokenizer.sep_id]]
    )
    assert [f["token"] for f in records[0]["features"]] == tokenizer.convert_ids_to_tokens(ids[0])
    expected = np.asarray(model.apply({"params": params}, ids, np.ones_like(ids)))[0]
    got = np.array([f["layers"][0]["values"] for f in records[0]["features"]])
    np.testing.assert_allclose(got, expected, atol=2e-6)
    assert [layer["index"] for layer in records[0]["features"][0]["layers"]] == [-1, -3]
    assert [f["token"] for f in records[1]["features"]] == [
        "[CLS]",
        *tokenizer.tokenize("john"),
        "[SEP]",
        *tokenizer.tokenize("paris"),
        "[SEP]",
    ]


def test_probes_refuse_a_modernbert_in_one_line(hf_dir, tmp_path):
    command = [
        sys.executable,
        "-m",
        "bertjax.probe",
        f"--init_checkpoint={hf_dir}",
        "--task=sst2",
        f"--workdir={tmp_path}",
    ]
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: --init_checkpoint=")
    assert "holds a ModernBERT model; the probes read BERT's layers only" in result.stderr


def test_bert_options_are_refused_for_a_modernbert(hf_dir, tmp_path):
    config = config_file("glue.py")
    config.update(
        task="sst2", data_dir=str(tmp_path), init_checkpoint=hf_dir, causal_attention=True
    )
    with pytest.raises(
        finetune_setup.FinetuneError, match="causal_attention=True is for BERT"
    ) as e:
        finetune.run(config, str(tmp_path / "run"))
    assert "\n" not in str(e.value)
    config.update(causal_attention=False, classifier_pooling="max")
    with pytest.raises(pretrained.PretrainedError, match="classifier_pooling='max' is not one"):
        finetune.run(config, str(tmp_path / "run"))


def test_each_task_builds_the_transformers_head_of_a_modernbert(hf_dir):
    tokenizer = pretrained.checkpoint_tokenizer(hf_dir, None)
    config = modernbert_hf.load_hf(hf_dir)[0]
    tasks = {
        glue.GlueFinetune(
            features.TaskOptions(task="mrpc"), tokenizer
        ): modernbert_heads.ModernBertForSequenceClassification,
        ner.NerFinetune(
            features.TaskOptions(), tokenizer
        ): modernbert_heads.ModernBertForTokenClassification,
        squad_predict.SquadFinetune(
            features.TaskOptions(), tokenizer
        ): modernbert_heads.ModernBertForQuestionAnswering,
    }
    for task, cls in tasks.items():
        model = task.model(config)
        assert type(model) is cls
        assert set(families.abstract_params(model)) == {"model", "head", "classifier"}
    # CoNLL words take their pieces inside running text.
    rows, _, _ = ner.encode(
        [ner.Sentence(["john", "was", "good"], ["B-PER", "O", "O"])], tokenizer, 16
    )
    pieces = tokenizer.encode(" john was good")
    assert rows["input_ids"][0][: len(pieces) + 2].tolist() == [
        tokenizer.cls_id,
        *pieces,
        tokenizer.sep_id,
    ]


@pytest.mark.slow  # two real fine-tuning runs
def test_ner_and_squad_fine_tune_a_modernbert_end_to_end(hf_dir, data_root, tmp_path):
    """CoNLL-2003 and SQuAD v1.1 files through `bertjax.finetune` from a transformers-layout
    ModernBERT and its BPE tokenizer: entity-level scores on dev and test, and SQuAD
    predictions for every question whose official EM/F1 are the ones reported."""
    common = dict(
        init_checkpoint=hf_dir,
        max_seq_length=24,
        train_batch_size=8,
        eval_batch_size=8,
        learning_rate=3e-3,
        log_every=8,
    )
    ner_config = config_file("ner.py")
    ner_config.update(data_dir=os.path.join(data_root, "conll"), num_train_epochs=3, **common)
    seed = finetune.run(ner_config, str(tmp_path / "ner"), devices=jax.devices()[:1])["seeds"][0]
    assert set(seed["dev"]["dev"]) == set(seed["test"]["test"]) == {"precision", "recall", "f1"}
    assert (tmp_path / "ner" / "seed_1" / "predictions" / "test_predictions.txt").exists()
    squad_file = os.path.join(data_root, "squad.json")
    squad_config = config_file("squad.py")
    squad_config.update(
        train_file=squad_file,
        predict_file=squad_file,
        doc_stride=8,
        max_query_length=8,
        num_train_epochs=2,
        **common,
    )
    dev = finetune.run(squad_config, str(tmp_path / "squad"), devices=jax.devices()[:1])["seeds"][
        0
    ]["dev"]["dev"]
    predictions = json.loads(
        (tmp_path / "squad" / "seed_1" / "predictions" / "predictions.json").read_text()
    )
    gold = {
        qa["id"]: qa["answers"][0]["text"]
        for paragraph in json.loads(Path(squad_file).read_text())["data"][0]["paragraphs"]
        for qa in paragraph["qas"]
    }
    assert sorted(predictions) == sorted(gold)
    scores = [official_squad_v1(predictions[qid], answer) for qid, answer in gold.items()]
    assert dev["exact_match"] == pytest.approx(100.0 * np.mean([em for em, _ in scores]))
    assert dev["f1"] == pytest.approx(100.0 * np.mean([f1 for _, f1 in scores]))
    # Learnt, not only run (measured: NER dev F1 1.0; SQuAD EM 47.5, F1 55.5).
    assert seed["dev"]["dev"]["f1"] > 0.5 and dev["f1"] > 30, (seed["dev"], dev)
