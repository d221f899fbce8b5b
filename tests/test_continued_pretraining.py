"""Issue 52: continued pretraining from what a user has, and one tokenizer rule for every
entry point. A run from a checkpoint takes the tokenizer beside it unless another is named;
a named one must have the checkpoint's ids (the recorded fingerprint of a bertjax run, the
same token at each id as the tokenizer beside a Google or Hugging Face checkpoint, no more
ids than the embedding rows), on train, finetune, extract_features and probe alike, before
any data work. A bare encoder (a Hub BertModel, a fine-tuned export) pretrains further with
fresh heads; an architecture override is checked against the checkpoint, not the config."""

import dataclasses
import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import test_faults
from bertjax import finetune, train
from bertjax.families import bert_hf
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models.bert.model import BertConfig
from test_convert import random_params, run_cli, write_google_checkpoint
from test_faults import Trainer
from test_finetune import config_file
from test_shipped_tokenizers import TEXTS, sentence_transformers_dir, text_words
from test_train import REPO_ROOT, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)

TINY_PY = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]


@pytest.fixture(scope="module")
def bare_encoder(tmp_path_factory, corpus_file) -> str:
    """A sentence-transformers directory as shipped (a BertModel: no pretraining heads, a
    tokenizer.json and no vocab.txt) whose WordPiece knows the corpus's words."""
    with open(corpus_file, encoding="utf-8") as f:
        words = text_words(TEXTS + f.read().split("\n")[:400])
    return sentence_transformers_dir(tmp_path_factory.mktemp("hub") / "all-MiniLM-like", words)


@pytest.mark.slow  # a real pretraining run (70 s on a 2-core host)
def test_a_bare_encoder_continues_pretraining_with_fresh_heads(
    bare_encoder,
    corpus_file,
    tmp_path,
    capsys,
):
    """A Hub BertModel (no heads, no vocab.txt) as init_checkpoint of configs/base.py's
    shape: no tokenizer flag (the tokenizer.json beside it is taken), the encoder's weights
    loaded, the MLM and NSP heads fresh and said so in one line."""
    config = tiny_config(
        corpus_file,
        str(tmp_path / "cache"),
        **{
            "train.total_steps": 2,
            "train.checkpoint_every": 2,
            "long_phase.fraction": 0.0,
            "optimizer.peak_learning_rate": 0.0,
            "optimizer.warmup_steps": 0,
            "train.eval_batches": 1,
            "train.init_checkpoint": bare_encoder,
            "data.tokenizer": "wordpiece",
        },
    )
    train.train_and_evaluate(config, str(tmp_path / "run"))
    out = capsys.readouterr().out
    assert "has no predictions, seq_relationship parameters (a bare encoder" in out, out
    encoder = bert_hf.load_hf(bare_encoder)[1]["bert"]
    params = pretrained.read(str(tmp_path / "run"))[1]
    np.testing.assert_array_equal(  # learning rate 0: the encoder as loaded
        params["bert"]["embeddings"]["word_embeddings"],
        encoder["embeddings"]["word_embeddings"],
    )
    assert not np.any(params["predictions"]["output_bias"])  # zeros, as the original's
    kernel = params["predictions"]["transform"]["dense"]["kernel"]
    assert 0.01 < kernel.std() < 0.03  # initializer_range 0.02
    assert read_metrics(tmp_path / "run")


def vocab(path, tokens: list[str]) -> str:
    path.write_text("".join(t + "\n" for t in tokens))
    return str(path)


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"word{i}" for i in range(40)]


@pytest.fixture
def checkpoints(tmp_path) -> dict[str, str]:
    """A Hugging Face and a Google checkpoint of 48 embedding rows, each with a 45-token
    vocab.txt beside it (fewer tokens than rows, as BERT's padded tables)."""
    config = BertConfig(
        vocab_size=48,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )
    params = random_params(config)
    bert_hf.save_hf(config, params, str(tmp_path / "hf"))
    write_google_checkpoint(tmp_path / "google", config, params)
    for name in ("hf", "google"):
        vocab(tmp_path / name / "vocab.txt", SPECIALS + WORDS)
    return {"hf": str(tmp_path / "hf"), "google": str(tmp_path / "google")}


def test_a_named_tokenizer_must_have_the_checkpoints_ids(checkpoints, tmp_path):
    """Finding 2, on the function every entry point resolves its tokenizer with: for a
    Hugging Face and a Google checkpoint, the vocab.txt beside it is taken (fewer tokens than
    embedding rows is fine), and so is a named prefix of it; a named vocabulary with other
    tokens, or more ids than embedding rows, is refused in one line naming both."""
    prefix = vocab(tmp_path / "prefix.txt", SPECIALS + WORDS[:10])
    other = vocab(tmp_path / "other.txt", SPECIALS + [f"other{i}" for i in range(40)])
    larger = vocab(tmp_path / "larger.txt", SPECIALS + WORDS + ["extra1", "extra2", "extra3", "x"])
    for path in checkpoints.values():
        source = pretrained.Source(init_checkpoint=path)
        run = pretrained.pretraining_run(source)
        assert pretrained.tokenizer_of(source, run).vocab_size == 45  # of 48 rows
        named = dataclasses.replace(source, vocab_file=prefix)
        assert pretrained.tokenizer_of(named, run).vocab_size == 15
        with pytest.raises(
            pretrained.PretrainedError,
            match=rf"^--config.vocab_file={other} is not the tokenizer of init_checkpoint "
            rf"{path}: its id 5 is 'other0', the checkpoint's 'word0'; drop "
            r"--config.vocab_file to take the checkpoint's own tokenizer",
        ):
            pretrained.tokenizer_of(dataclasses.replace(source, vocab_file=other), run)
        os.remove(os.path.join(path, "vocab.txt"))  # nothing beside it to compare with:
        with pytest.raises(  # the embedding rows only
            pretrained.PretrainedError,
            match=rf"^--config.vocab_file={larger} has 49 tokens but init_checkpoint {path} "
            r"has 48 embedding rows: its ids do not fit the checkpoint",
        ):
            pretrained.tokenizer_of(dataclasses.replace(source, vocab_file=larger), run)


def test_every_entry_point_refuses_a_tokenizer_of_other_ids_before_any_data_work(
    checkpoints,
    corpus_file,
    tmp_path,
):
    """Finding 2: train, finetune, and extract_features and probe (both `load_encoder`)
    refuse a vocabulary that is not the checkpoint's before any data is prepared or read."""
    other = vocab(tmp_path / "other.txt", SPECIALS + [f"other{i}" for i in range(40)])
    hf_dir = checkpoints["hf"]
    config = tiny_config(
        corpus_file,
        str(tmp_path / "cache"),
        **{
            "train.init_checkpoint": hf_dir,
            "data.tokenizer": "wordpiece",
            "data.vocab_file": other,
            "data.max_seq_length": 32,
            "long_phase.fraction": 0.0,
        },
    )
    with pytest.raises(pretrained.PretrainedError, match="is not the tokenizer of"):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "cache").exists()  # nothing prepared
    fine_tune = config_file("glue.py")
    fine_tune.update(init_checkpoint=hf_dir, vocab_file=other, data_dir=str(tmp_path / "none"))
    with pytest.raises(pretrained.PretrainedError, match="is not the tokenizer of"):
        finetune.run(fine_tune, str(tmp_path / "finetune"))  # (its data is never read)
    with pytest.raises(pretrained.PretrainedError, match=r"^--vocab_file=.* is not the tokenizer"):
        pretrained_weights.load_encoder(pretrained.Source.frozen(hf_dir, other, True))


def test_an_override_is_checked_against_the_checkpoint_not_the_config(checkpoints, tmp_path):
    """Finding 8: configs/base.py (12 heads) from a checkpoint of hidden 16 and 2 heads with
    --config.model.hidden_size=64 is one line naming the checkpoint's value, before any work;
    the same without the override validates the checkpoint's architecture."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.train",
            "--config=configs/base.py",
            f"--workdir={tmp_path / 'run'}",
            f"--config.train.init_checkpoint={checkpoints['hf']}",
            "--config.model.hidden_size=64",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: --config.model.hidden_size=64 (the checkpoint's: 16) contradicts "
        f"init_checkpoint {checkpoints['hf']}, whose architecture the run takes: drop the "
        "override, or start from another checkpoint"
    ], result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # four real pretraining runs
def test_a_runs_own_model_and_its_export_continue_pretraining(
    corpus_file,
    tmp_path,
    capsys,
):
    """Finding 1, the Quick start's case: a run whose SentencePiece model has fewer pieces
    than the model's embedding rows continues from its workdir with no tokenizer flag, with
    its own .model named, and from its Hugging Face export; the continued runs tokenize
    as the first (same fingerprint)."""
    cache = str(tmp_path / "cache")
    short = {
        "train.total_steps": 2,
        "train.checkpoint_every": 2,
        "long_phase.fraction": 0.0,
        "train.eval_batches": 1,
        "optimizer.warmup_steps": 0,
        "model.vocab_size": 600,  # rows
    }
    first = tmp_path / "first"
    train.train_and_evaluate(tiny_config(corpus_file, cache, **short), str(first))
    fingerprint = pretrained.pretraining_run(
        pretrained.Source(init_checkpoint=str(first))
    ).tokenizer_fingerprint
    (own_model,) = [str(p) for p in (tmp_path / "cache").glob("sentencepiece_*.model")]
    assert (
        pretrained.own_tokenizer(
            pretrained.Source(init_checkpoint=str(first)),
            pretrained.pretraining_run(pretrained.Source(init_checkpoint=str(first))),
            rebuild=False,
        ).vocab_size
        < 600
    )
    assert run_cli(str(first), str(tmp_path / "first_hf")).returncode == 0
    for name, init, named in (
        ("from_workdir", str(first), ""),
        ("own_model_named", str(first), own_model),
        ("from_hf_export", str(tmp_path / "first_hf"), ""),
    ):
        config = tiny_config(
            corpus_file,
            str(tmp_path / f"cache_{name}"),
            **{**short, "train.init_checkpoint": init, "data.vocab_file": named},
        )
        train.train_and_evaluate(config, str(tmp_path / name))
        continued = pretrained.pretraining_run(
            pretrained.Source(init_checkpoint=str(tmp_path / name))
        )
        assert continued.tokenizer_fingerprint == fingerprint, name
    assert "error" not in capsys.readouterr().out


@pytest.mark.slow  # three real pretraining runs in subprocesses
def test_a_bare_encoders_continued_pretraining_resumes_exactly_after_ctrl_c(
    bare_encoder,
    corpus_file,
    tmp_path,
):
    """Finding 4: pretraining from a bare Hub encoder (fresh heads), stopped by Ctrl-C after
    its first step, resumes from its checkpoint (the heads as saved, not fresh again): every
    loss the two runs logged equals an uninterrupted run's."""
    overrides = {
        "train.total_steps": 6,
        "train.checkpoint_every": 2,
        "long_phase.fraction": 0.0,
        "optimizer.warmup_steps": 2,
        "train.eval_batches": 1,
        "train.init_checkpoint": bare_encoder,
        "data.tokenizer": "wordpiece",
    }
    cache = str(tmp_path / "cache")

    def command_line(workdir: str) -> list[str]:  # (the model: the checkpoint's)
        args = test_faults.command_line(corpus_file, cache, workdir, **overrides)
        return [arg for arg in args if not arg.startswith("--config.model.")]

    reference = Trainer(command_line(str(tmp_path / "ref")))
    assert reference.finish() == 0, reference.output()
    assert "fresh pretraining heads" in reference.output(None)
    args = command_line(str(tmp_path / "run"))
    first = Trainer(args, pause="step:1")
    first.wait_for_pause()
    first.proc.send_signal(signal.SIGINT)
    first.wait_for("Ctrl-C: saving a checkpoint at the end of this step")
    first.release()
    assert first.finish() == 130, first.output()
    second = Trainer(args)
    assert second.finish() == 0, second.output()
    assert "fresh pretraining heads" not in second.output(None)  # (restored, not fresh)
    logged = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "run")}
    expected = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "ref")}
    assert logged == expected and len(expected) == 6, (logged, expected)


def test_an_unreadable_tokenizer_beside_a_checkpoint_is_one_line(checkpoints):
    """A vocab.txt beside the checkpoint without BERT's special tokens: one line naming it
    and the flag to pass, not a ValueError's traceback."""
    path = checkpoints["hf"]
    vocab(Path(path) / "vocab.txt", WORDS)
    source = pretrained.Source(init_checkpoint=path)
    with pytest.raises(
        pretrained.PretrainedError,
        match=r"vocab.txt lacks special tokens .*; pass --config.vocab_file=PATH$",
    ):
        pretrained.tokenizer_of(source, pretrained.pretraining_run(source))


def test_pretraining_resolves_its_tokenizer_as_fine_tuning_does(checkpoints, tmp_path):
    """Finding 5: pretraining's resolution (its `configured` tokenizer: the config's, trained
    or read) is not consulted where init_checkpoint has a tokenizer beside it, and
    `data.vocab_file` may name a checkpoint directory, as fine-tuning's vocab_file may."""

    def configured():
        raise AssertionError("the config's tokenizer was built")

    for path in checkpoints.values():
        source = pretrained.Source(
            init_checkpoint=path, tokenizer="sentencepiece", vocab_flag="--config.data.vocab_file"
        )
        run = pretrained.pretraining_run(source)
        assert pretrained.tokenizer_of(source, run, configured).vocab_size == 45
        no_checkpoint = pretrained.Source(vocab_file=path, tokenizer="wordpiece")
        assert pretrained.tokenizer_of(no_checkpoint, run, configured).vocab_size == 45
