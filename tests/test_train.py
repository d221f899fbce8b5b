"""End-to-end pretraining: the loss falls, stop + resume equals an uninterrupted run, and
8 sharded CPU devices (data=2, fsdp=2, tensor=2) match one device."""

import json
import os
import runpy
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import tfds_fixture  # tests/ is on sys.path under pytest's default import mode.
from bertjax import train
from bertjax.data import default_corpus, pipeline, sentences
from bertjax.families import bert_hf, modernbert_hf
from bertjax.interop import pretrained
from bertjax.models import families
from bertjax.models.bert.model import BertConfig
from bertjax.models.modernbert import model as modernbert
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.training import init_architecture, reporting, run_schedule
from bertjax.training.finetune_settings import FinetuneSettings
from bertjax.training.phase_schedule import Phase
from test_convert import assert_trees_equal, random_params, write_google_checkpoint

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
base_config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "base.py"))["get_config"]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> str:
    """Real English text (stdlib documentation) in the original one-sentence-per-line format."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    documents = [doc for doc in default_corpus.default_corpus() if len(doc) >= 2][:300]
    path.write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """Prepared data and the SentencePiece model, shared by the runs of this module."""
    return str(tmp_path_factory.mktemp("cache"))


def tiny_config(corpus_file: str, cache_dir: str, **overrides):
    c = base_config()
    c.model.update(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        dtype="float32",
    )
    c.data.update(
        source="text",
        input_files=corpus_file,
        tokenizer="sentencepiece",
        sentencepiece_vocab_size=512,
        max_seq_length=64,
        max_predictions_per_seq=10,
        dupe_factor=2,
        eval_fraction=0.1,
        cache_dir=cache_dir,
        num_workers=1,
    )
    c.long_phase.update(fraction=0.25, max_seq_length=128, max_predictions_per_seq=20)
    c.train.update(
        global_batch_size=16,
        total_steps=16,
        log_every=1,
        eval_every=0,
        eval_batches=2,
        checkpoint_every=4,
        keep_checkpoints=2,
        keep_every=0,
    )
    c.optimizer.update(peak_learning_rate=2e-3, warmup_steps=4)
    for key, value in overrides.items():
        section, field = key.split(".")
        c[section][field] = value
    return c


def read_metrics(workdir, split: str = "train") -> list[dict]:
    """The rows of metrics.jsonl for `split` (train: progress reports; eval: evaluations)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, f) if row["split"] == split]


def test_loss_falls_and_checkpoint_written(corpus_file, cache_dir, tmp_path, capsys):
    """The loss falls; the final evaluation (2 held-out batches of 16) is logged and written;
    running the finished run again evaluates its last checkpoint only, to the same numbers."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{"train.total_steps": 40, "train.log_every": 10, "long_phase.fraction": 0.0},
    )
    final = train.train_and_evaluate(config, str(tmp_path))
    losses = [m["loss"] for m in read_metrics(tmp_path)]
    assert len(losses) == 4
    assert losses[-1] < losses[0] - 0.5, losses
    assert final["mlm_loss"] < losses[0]
    assert final["loss"] == pytest.approx(final["mlm_loss"] + final["nsp_loss"])
    held_out = 2 * 16  # eval_batches x global_batch_size sequences, one NSP prediction each
    assert final["nsp_accuracy"] * held_out == pytest.approx(
        round(final["nsp_accuracy"] * held_out)
    )
    capsys.readouterr()
    again = train.train_and_evaluate(config, str(tmp_path))
    assert "Training already finished (40 steps); evaluating only" in capsys.readouterr().out
    assert again == final  # from the checkpoint: the same parameters, batches and sums
    assert [m["step"] for m in read_metrics(tmp_path)] == [10, 20, 30, 40]  # nothing trained
    assert [m["step"] for m in read_metrics(tmp_path, "eval")] == [40]  # not logged again
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["36", "40"]  # keep latest 2
    assert any(
        name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tensorboard")
    )
    assert json.loads((tmp_path / "final_metrics.json").read_text())["step"] == 40
    evaluation = read_metrics(tmp_path, "eval")[0]  # eval_every=0: the final one only
    assert evaluation["step"] == 40 and evaluation["mlm_loss"] == final["mlm_loss"]
    assert json.loads((tmp_path / "config.json").read_text())["train"]["total_steps"] == 40
    assert "Bytes per device" in (tmp_path / "startup_report.txt").read_text()
    assert not (tmp_path / "profile").exists()  # (train.profile_steps=0: no trace; test_loop)


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_stop_and_resume_equals_uninterrupted(corpus_file, cache_dir, tmp_path, capsys):
    """A run stopped at step 6 that lost its step-6 checkpoint (as a crash between
    checkpoints would) restarts from step 4; another stop lands in the long phase. Every
    logged loss equals the uninterrupted run's at the same step, bit for bit. Each stop,
    the phase switch and the end are announced."""
    config = tiny_config(corpus_file, cache_dir)
    train.train_and_evaluate(config, str(tmp_path / "straight"))
    resumed = tmp_path / "resumed"
    for stop_after in (6, 9, 0):
        config.train.stop_after_steps = stop_after
        capsys.readouterr()
        train.train_and_evaluate(config, str(resumed))
        printed = capsys.readouterr().out
        if stop_after == 6:
            assert (
                "Stopped after 6 steps (step 6 of 16); rerun the same command to continue"
                in printed
            )
            shutil.rmtree(resumed / "checkpoints" / "6")
        elif stop_after == 9:  # steps 5-13
            assert "phase long from step 13: 128 tokens, 20 predictions per sequence" in printed
            assert "Stopped after 9 steps (step 13 of 16)" in printed
        else:
            assert "Done in " in printed and "step 16 of 16; held-out loss" in printed
    straight = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "straight")}
    records = read_metrics(resumed)
    assert [m["step"] for m in records] == list(range(1, 7)) + list(range(5, 17))
    for m in records:
        assert m["loss"] == straight[m["step"]], (m["step"], m["loss"], straight[m["step"]])
    phases = {m["step"]: m["phase"] for m in records}
    assert phases[12] == "short" and phases[13] == "long"


def test_fine_tuning_takes_the_sentencepiece_model_the_run_recorded(corpus_file, tmp_path):
    """Fine-tuning finds the run's SentencePiece model by the fingerprint its checkpoint
    recorded, even after the corpus was touched (a new cache key) or removed; a model
    rebuilt from a different corpus, or another vocab_file, is refused, naming both."""
    corpus_copy = tmp_path / "corpus.txt"
    shutil.copy(corpus_file, corpus_copy)
    workdir = tmp_path / "run"
    train.train_and_evaluate(
        tiny_config(str(corpus_copy), "", **{"train.total_steps": 4, "long_phase.fraction": 0.0}),
        str(workdir),
    )
    fine_tune = runpy.run_path(os.path.join(REPO_ROOT, "configs", "finetune", "glue.py"))[
        "get_config"
    ]()
    fine_tune.init_checkpoint = str(workdir)

    def source():
        return FinetuneSettings.of(fine_tune.to_dict()).source

    pretrain = pretrained.pretraining_run(source())
    assert pretrain.tokenizer_fingerprint
    models = sorted(os.listdir(workdir / "data"))
    os.utime(corpus_copy, (1, 1))
    corpus_copy.rename(tmp_path / "moved.txt")
    assert (
        pretrained.tokenizer_of(source(), pretrain).fingerprint() == pretrain.tokenizer_fingerprint
    )
    assert sorted(os.listdir(workdir / "data")) == models  # found, not trained again
    for name in models:
        if name.startswith("sentencepiece_"):
            os.remove(workdir / "data" / name)
    with pytest.raises(pretrained.PretrainedError, match="cannot rebuild the tokenizer"):
        pretrained.tokenizer_of(source(), pretrain)
    text = (tmp_path / "moved.txt").read_text()
    corpus_copy.write_text(" ".join(word[::-1] for word in text.split(" ")))
    with pytest.raises(
        pretrained.PretrainedError, match="rebuilt from the pretraining corpus is not"
    ):
        pretrained.tokenizer_of(source(), pretrain)
    (other,) = (workdir / "data").glob("sentencepiece_*.model")
    fine_tune.vocab_file = str(other)
    with pytest.raises(pretrained.PretrainedError, match=r"vocab_file=.* is not the tokenizer"):
        pretrained.tokenizer_of(source(), pretrain)


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_eight_devices_match_one(corpus_file, cache_dir, tmp_path):
    assert len(jax.devices()) == 8, "conftest sets 8 fake CPU devices"
    short_only = {"train.total_steps": 6, "long_phase.fraction": 0.0}  # one phase to compile
    one = tiny_config(corpus_file, cache_dir, **short_only)
    one.mesh.update(data=1, fsdp=1, tensor=1)
    train.train_and_evaluate(one, str(tmp_path / "one"), devices=jax.devices()[:1])
    eight = tiny_config(corpus_file, cache_dir, **short_only)
    eight.mesh.update(data=2, fsdp=2, tensor=2)
    train.train_and_evaluate(eight, str(tmp_path / "eight"))
    a, b = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "eight")
    np.testing.assert_allclose([m["loss"] for m in a], [m["loss"] for m in b], rtol=2e-5)
    np.testing.assert_allclose([m["grad_norm"] for m in a], [m["grad_norm"] for m in b], rtol=2e-4)


def test_pretrains_from_a_tfds_dataset(cache_dir, tmp_path):
    name = tfds_fixture.prepare_docs(str(tmp_path / "tfds"))
    config = tiny_config(
        "",
        str(tmp_path / "cache"),
        **{
            "data.source": "tfds",
            "data.tfds_name": name,
            "data.tfds_data_dir": str(tmp_path / "tfds"),
            "train.total_steps": 4,
            "long_phase.fraction": 0.0,
        },
    )
    final = train.train_and_evaluate(config, str(tmp_path / "run"))
    # The run read the 200 documents, split into paragraphs and sentences as tfds_source does.
    documents = [doc for doc in default_corpus.default_corpus() if len(doc) >= 2][:200]
    (meta_file,) = (tmp_path / "cache").glob("short_64_*/meta.json")
    meta = json.loads(meta_file.read_text())
    assert (meta["corpus"]["documents"], meta["corpus"]["sentences"]) == (
        200,
        sum(len(sentences.split_sentences(" ".join(doc))) for doc in documents),
    )
    # An untrained model predicts about uniformly: MLM over the 512 tokens plus NSP over 2.
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    assert len(losses) == 4 and losses[0] == pytest.approx(np.log(512) + np.log(2), abs=0.05)
    assert final["loss"] < losses[0]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--config.data.source=text", "--config.data.input_files=/no/such/corpus.txt"],
            "/no/such/corpus.txt",
        ),
        (
            ["--config.mesh.data=3"],
            "mesh {'data': 3, 'fsdp': 1, 'tensor': 1} needs 3 devices but "
            "8 are available; set one axis to -1 to fill",
        ),
        (["--config.train.global_batch_size=30", "--config.train.grad_accum_steps=4"], "divisible"),
        (["--config.data.source=text", "--config.data.input_files=TMP"], "TMP' is a directory"),
        (["--workdir="], "--workdir is empty"),
    ],
    ids=["missing file", "mesh", "batch", "directory as input file", "empty workdir"],
)
def test_command_line_errors_are_one_clear_line(overrides, message, tmp_path):
    """Bad settings end with `error: ...` naming the problem, exit code 1, no traceback."""
    overrides = [flag.replace("TMP", str(tmp_path)) for flag in overrides]
    message = message.replace("TMP", str(tmp_path))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.train",
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        check=False,
    )
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1 and message in error_lines[0], result.stderr[-2000:]


def test_a_tokenizer_larger_than_the_model_names_the_flag(corpus_file, cache_dir, tmp_path):
    """A vocabulary file larger than the model (a SentencePiece model the run would train is
    checked from the config, before it trains: test_cli.py)."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"word{i}" for i in range(115)])
        + "\n"
    )
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{"model.vocab_size": 100, "data.tokenizer": "wordpiece", "data.vocab_file": str(vocab)},
    )
    with pytest.raises(
        pipeline.DataError,
        match=r"the tokenizer has 120 tokens but "
        r"model.vocab_size=100; set --config.model.vocab_size=120 \(or more\)",
    ):
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_init_checkpoint_from_a_google_tf_checkpoint(corpus_file, cache_dir, tmp_path):
    """A run with learning rate 0 starts from, and keeps, a TF checkpoint's weights."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{
            "train.total_steps": 1,
            "train.checkpoint_every": 1,
            "long_phase.fraction": 0.0,
            "optimizer.peak_learning_rate": 0.0,
            "optimizer.warmup_steps": 0,
            "train.eval_batches": 1,
            "train.init_checkpoint": str(tmp_path / "google"),
        },
    )
    model_config = BertConfig.from_dict(config.model.to_dict())
    params = random_params(model_config)
    write_google_checkpoint(tmp_path / "google", model_config, params)
    os.remove(tmp_path / "google" / "vocab.txt")  # no tokenizer beside it: the config's is used
    train.train_and_evaluate(config, str(tmp_path / "run"))
    assert_trees_equal(pretrained.read(str(tmp_path / "run"))[1], params)


def test_a_bert_run_takes_the_architecture_of_a_google_or_hugging_face_checkpoint(tmp_path):
    """Issue 42: configs/tiny.py from a Google TF or a Hugging Face BERT of another shape
    takes the checkpoint's architecture (nothing restated); an override given on the command
    line that contradicts it is one line naming both values; a BERT config from a ModernBERT
    checkpoint names the ModernBERT configs."""
    found = BertConfig(
        vocab_size=120,
        hidden_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=40,
        max_position_embeddings=300,
        layer_norm_eps=1e-7,
    )
    write_google_checkpoint(tmp_path / "google", found, random_params(found))
    bert_hf.save_hf(found, random_params(found), str(tmp_path / "hf"))
    for checkpoint_dir in (tmp_path / "google", tmp_path / "hf"):
        config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
        config.model.update(
            init_architecture.checkpoint_model(config.model.to_dict(), str(checkpoint_dir))
        )
        assert BertConfig.from_dict(config.model.to_dict()) == found
        config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
        with pytest.raises(
            pretrained.PretrainedError,
            match=r"^--config.model.vocab_size=8000 "
            r"\(the checkpoint's: 120\) contradicts init_checkpoint",
        ):
            init_architecture.checkpoint_model(
                config.model.to_dict(), str(checkpoint_dir), {"model.vocab_size"}
            )
    modern = ModernBertConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    shapes = families.abstract_params(modernbert.ModernBertForMaskedLM(modern))
    modernbert_hf.save_hf(
        modern, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), str(tmp_path / "modern")
    )
    with pytest.raises(
        pretrained.PretrainedError,
        match=r"holds a ModernBERT model but the "
        r"run's model is BERT: start from a ModernBERT config, "
        r"configs/modernbert_tiny.py",
    ):
        init_architecture.checkpoint_model(config.model.to_dict(), str(tmp_path / "modern"))


def test_the_steps_line_of_a_resumed_run_says_what_is_left():
    """Resumed at step 36 of 120 (short: 1-108), the line said "short 108 steps" (issue 42)."""
    phases = [Phase("short", 128, 20, 16, 0, 108), Phase("long", 256, 40, 16, 108, 120)]
    assert reporting.steps_line(36, 120, phases, 25) == (
        "Training steps 37-120: short 72 steps x 16 x 128 tokens, long 12 steps x 16 x 256 "
        "tokens; progress every 25 steps"
    )
    assert reporting.steps_line(119, 120, phases, 25).startswith(
        "Training steps 120-120: long 1 step x 16 x 256 tokens;"
    )
    assert reporting.steps_line(0, 120, phases, 25).startswith(
        "Training steps 1-120: short 108 steps x 16 x 128 tokens, long 12 steps"
    )


# A workdir rerun with another schedule (issue 33: a finished 60-step run rerun with
# total_steps=80 went back from the long phase to the short one, with a new learning rate, and
# changed the step-60 model unasked): refused in one line, nothing written; with
# `train.extend=True` it trains on at the learning rate docs/pretraining.md states, and the
# steps the run had been planned for are an uninterrupted run's, bit for bit. (Here, to reuse
# this module's prepared data.)
PEAK, WARMUP = 2e-3, 4  # tiny_config's


def files_under(directory) -> dict[str, tuple[int, int]]:
    """Every file under `directory`: (size, modification time in ns) by relative path."""
    return {
        os.path.relpath(os.path.join(root, name), directory): (
            os.stat(os.path.join(root, name)).st_size,
            os.stat(os.path.join(root, name)).st_mtime_ns,
        )
        for root, _, names in os.walk(directory)
        for name in names
        if name != "run.lock"
    }  # (rewritten by every run that takes it)


@pytest.fixture(scope="module")
def finished(corpus_file, cache_dir, tmp_path_factory):
    """A finished 8-step run (long phase: steps 7-8) and its config."""
    config = tiny_config(corpus_file, cache_dir, **{"train.total_steps": 8})
    workdir = tmp_path_factory.mktemp("finished")
    train.train_and_evaluate(config, str(workdir))
    return workdir, config


@pytest.mark.slow  # over a minute end to end (docs/testing.md)
def test_another_schedule_is_refused_and_extend_trains_on_as_documented(finished, capsys):
    workdir, config = finished
    before = files_under(workdir)
    config.train.total_steps = 12
    with pytest.raises(run_schedule.ScheduleChanged) as refused:
        train.train_and_evaluate(config, str(workdir))
    assert str(refused.value) == (
        f"checkpoint {workdir}/checkpoints/8 was trained on a schedule this run changes "
        "(train.total_steps: 8 -> 12): resuming would move the phases and the learning rate "
        "under the steps it trained. Use another --workdir for a new run; or extend this one "
        "past step 8 with --config.train.extend=True (steps 1-8 keep their schedule, the added "
        "ones train in phase long at the learning rate this config gives them: "
        "docs/pretraining.md); or rerun with the settings it recorded."
    )
    assert files_under(workdir) == before  # nothing written, config.json included

    config.train.extend = True
    capsys.readouterr()
    train.train_and_evaluate(config, str(workdir))
    assert (
        "Extending the run past step 8 (train.extend): steps 9-12 train in phase long, the "
        "learning rate from 6.667e-04" in capsys.readouterr().out
    )  # 2e-3 * (1 - 8 / 12)
    rows = read_metrics(workdir)
    assert [m["step"] for m in rows] == list(range(1, 13))
    # Step s applies the rate at s - 1: steps 1-8 the 8-step schedule's (warmup 4, linear
    # decay to 0 at 8), steps 9-12 the 12-step schedule's at the same step.
    expected = [PEAK * k / WARMUP if k < WARMUP else PEAK * (1 - k / 8) for k in range(8)] + [
        PEAK * (1 - k / 12) for k in range(8, 12)
    ]
    assert [m["learning_rate"] for m in rows] == pytest.approx(expected, rel=1e-6)
    assert [m["phase"] for m in rows] == ["short"] * 6 + ["long"] * 6  # no way back


@pytest.mark.slow  # (two more runs)
def test_a_partly_run_workdir_extended_trains_the_planned_steps_bit_for_bit(finished, tmp_path):
    """Stopped at step 5 of 8, then extended to 12: every step's loss and learning rate are
    those of the finished run extended to 12."""
    workdir, config = finished
    if len(read_metrics(workdir)) < 12:  # (run without the test before)
        config.train.update(total_steps=12, extend=True)
        train.train_and_evaluate(config, str(workdir))
    partly = tmp_path / "partly"
    config.train.update(total_steps=8, extend=False, stop_after_steps=5)
    train.train_and_evaluate(config, str(partly))
    config.train.update(total_steps=12, extend=True, stop_after_steps=0)
    train.train_and_evaluate(config, str(partly))
    straight = {m["step"]: (m["loss"], m["learning_rate"]) for m in read_metrics(workdir)}
    resumed = read_metrics(partly)
    assert [m["step"] for m in resumed] == list(range(1, 13))  # (a checkpoint at the stop)
    for m in resumed:
        assert (m["loss"], m["learning_rate"]) == straight[m["step"]], m
