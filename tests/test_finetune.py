"""Fine-tuning end to end on synthetic data: heads, the GLUE CLI (seeds, best checkpoint,
submission), feature-based NER (frozen encoder), SQuAD, clear errors, extract_features."""

import collections
import json
import os
import random
import re
import runpy
import shutil
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import extract_features, finetune, train
from bertjax.checkpoints import checkpoint, checkpoint_checks
from bertjax.errors import ConfigError
from bertjax.families import bert_hf, bert_tf
from bertjax.interop import pretrained, pretrained_weights
from bertjax.interop.tree import ConversionError
from bertjax.models.bert.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertjax.models.bert.model import BertConfig, BertModel
from bertjax.training import finetune_loop, finetune_setup, nonfinite
from bertjax.training.finetune_settings import FinetuneSettings
from test_faults import (
    Trainer,
    assert_console_in_log,
    assert_one_full_disk_line,
    on_a_small_filesystem,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIVE, NEGATIVE = ["good", "great", "fun", "lovely"], ["bad", "awful", "dull", "boring"]
NAMES = ["john", "paris", "acme", "mary"]
FILLER = ["the", "movie", "was", "a", "plot", "and", "very", "film", "story", "it", "what", "?"]
VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    ".",
    ",",
    *POSITIVE,
    *NEGATIVE,
    *NAMES,
    *FILLER,
]


TINY = BertConfig(
    vocab_size=len(VOCAB),
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=64,
)


def assert_quiet_console(output: str) -> None:
    """No absl-format line (`I1123 12:36:38.698904 ... file.py:42] ...`: a library's INFO or
    warning let through) and no traceback."""
    assert not re.search(r"^[IWEF]\d{4} \d\d:\d\d:\d\d", output, re.MULTILINE), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def pretrained_encoder(root: str):
    return pretrained_weights.load_pretrained(
        os.path.join(root, "pretrain"),
        {"bert": pretrained_weights.abstract_params_on_one_device(BertModel(TINY))},
        TINY,
    )["bert"]


def config_file(name: str):
    return runpy.run_path(os.path.join(REPO_ROOT, "configs", "finetune", name))["get_config"]()


def sentence(rng: random.Random, positive: bool) -> str:
    words = [rng.choice(FILLER[:10]) for _ in range(3)]
    return " ".join([*words, rng.choice(POSITIVE if positive else NEGATIVE), "."])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> str:
    """A vocab, a 2-step pretraining checkpoint, SST-2 TSVs, CoNLL files and a SQuAD JSON."""
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    (root / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (root / "corpus.txt").write_text(
        "".join(
            "\n".join(sentence(rng, rng.random() < 0.5) for _ in range(6)) + "\n\n"
            for _ in range(40)
        )
    )
    os.makedirs(root / "SST-2")
    for split, count in (("train", 96), ("dev", 40)):
        rows = [f"{sentence(rng, i % 2 == 1)}\t{i % 2}" for i in range(count)]
        extra = ["a row without a label", "the film\t7"] if split == "train" else []
        (root / "SST-2" / f"{split}.tsv").write_text(
            "\n".join(["sentence\tlabel", *rows, *extra]) + "\n"
        )
    (root / "SST-2" / "test.tsv").write_text(
        "index\tsentence\n" + "".join(f"{i}\t{sentence(rng, i % 2 == 1)}\n" for i in range(10))
    )
    os.makedirs(root / "conll")
    for split, count in (("train.txt", 64), ("valid.txt", 16), ("test.txt", 16)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(count):
            name = rng.choice(NAMES)
            lines += [
                f"{name} NNP B-NP {'B-LOC' if name == 'paris' else 'B-PER'}",
                "was VBD B-VP O",
                f"{rng.choice(POSITIVE)} JJ B-ADJP O",
                ". . O O",
                "",
            ]
        (root / "conll" / split).write_text("\n".join(lines) + "\n")
    paragraphs = []
    for i in range(40):
        name, other = rng.sample(NAMES, 2)
        context = f"{name} was good . {other} was bad ."
        paragraphs.append(
            {
                "context": context,
                "qas": [
                    {
                        "id": f"q{i}",
                        "question": "what was good ?",
                        "answers": [{"text": name, "answer_start": 0}],
                    }
                ],
            }
        )
    (root / "squad.json").write_text(
        json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]})
    )
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "base.py"))["get_config"]()
    config.model.update(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        dtype="float32",
    )
    config.data.update(
        source="text",
        input_files=str(root / "corpus.txt"),
        tokenizer="wordpiece",
        vocab_file=str(root / "vocab.txt"),
        max_seq_length=32,
        max_predictions_per_seq=5,
        dupe_factor=1,
        eval_fraction=0.1,
        num_workers=1,
    )
    config.long_phase.fraction = 0.0
    config.train.update(
        global_batch_size=8,
        total_steps=2,
        log_every=1,
        eval_every=0,
        eval_batches=1,
        checkpoint_every=2,
        keep_every=0,
    )
    config.optimizer.warmup_steps = 1
    train.train_and_evaluate(config, str(root / "pretrain"), devices=jax.devices()[:1])
    return str(root)


def small(config, root: str, **overrides):
    config.update(
        init_checkpoint=os.path.join(root, "pretrain"),
        max_seq_length=16,
        train_batch_size=32,
        eval_batch_size=8,
        learning_rate=1e-3,
        log_every=3,
    )
    config.update(**overrides)
    return config


def test_heads_have_google_names_and_all_layers():
    cfg = BertConfig(
        vocab_size=30,
        hidden_size=16,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    ids = jnp.ones((2, 8), jnp.int32)

    def shapes(m):
        return jax.tree.map(
            lambda x: x.shape,
            jax.eval_shape(
                lambda: nn.meta.unbox(m.init(jax.random.PRNGKey(0), ids, ids * 0, ids)["params"])
            ),
        )

    assert {
        k: v for k, v in shapes(BertForSequenceClassification(cfg, 3)).items() if k != "bert"
    } == {"output_weights": (3, 16), "output_bias": (3,)}
    assert shapes(BertForQuestionAnswering(cfg))["cls"] == {
        "squad": {"output_weights": (2, 16), "output_bias": (2,)}
    }
    tagger = shapes(BertForTokenClassification(cfg, 5, feature_based=True, lstm_size=6))
    assert tagger["output_weights"] == (5, 12) and tagger["lstm_0_forward"]["ii"]["kernel"] == (
        64,
        6,
    )
    model = BertModel(cfg)
    variables = model.init(jax.random.PRNGKey(0), ids, ids * 0, ids)
    layers, pooled = model.apply(variables, ids, ids * 0, ids, all_layers=True)
    sequence, pooled_last = model.apply(variables, ids, ids * 0, ids)
    assert layers.shape == (4, 2, 8, 16)
    np.testing.assert_array_equal(layers[-1], sequence)
    np.testing.assert_array_equal(pooled, pooled_last)


def assert_console_in_order(stdout: str, workdir, seeds: list[dict]) -> None:
    """A fine-tuning run's console: each seed's lines in the order things happen (its steps,
    then each epoch's dev and best lines after that epoch's last step), then the one checkpoint
    it names, which exists at the end (the best epoch's; the others are deleted); the outputs
    listed once each, relative to their folder, all of them there."""
    lines = stdout.splitlines()
    for seed in seeds:
        rows = [
            json.loads(line) for line in (workdir / f"seed_{seed['seed']}" / "metrics.jsonl").open()
        ]
        epoch_end = {r["epoch"]: r["step"] for r in rows if r["split"] == "dev"}
        times = []  # (the step each printed line of the seed comes after)
        for line in lines:
            if match := re.match(rf"seed {seed['seed']} step (\d+)/", line):
                times.append(int(match[1]))
            elif match := re.match(rf"seed {seed['seed']} epoch (\d+)", line):
                times.append(epoch_end[int(match[1])] + 0.5)
            elif re.match(rf"seed {seed['seed']}: .*checkpoint", line):
                times.append(float("inf"))
        assert times == sorted(times) and times[-1] == float("inf"), times
    announced = re.findall(
        r"^seed (\d+): best epoch (\d+) kept, checkpoint step (\d+) -> (\S+)$", stdout, re.M
    )
    assert [(int(s), int(e), int(step)) for s, e, step, _ in announced] == [
        (seed["seed"], seed["best_epoch"], seed["best_step"]) for seed in seeds
    ]
    assert all(
        path == f"{workdir}/seed_{s}/checkpoints/{step}" and os.path.isdir(path)
        for s, _, step, path in announced
    )
    assert len(re.findall(r"checkpoint step \d+ ->", stdout)) == len(seeds)  # (no other)
    start = lines.index(
        f"Outputs in {workdir}: summary.json, config.json, log.txt, tokenizer "
        "vocab.txt + bertjax_tokenizer.json"
    )
    for name in ("summary.json", "config.json", "log.txt", "vocab.txt", "bertjax_tokenizer.json"):
        assert (workdir / name).is_file(), name
    for line, seed in zip(lines[start + 1 :], seeds):
        folder, listed = line.strip().split(": ", 1)
        assert folder == f"seed_{seed['seed']}/"
        names = [item.split(" (")[0] for item in listed.split(", ")]
        assert names[0] == f"checkpoints/{seed['best_step']}" and len(set(names)) == len(names)
        assert not any(name.startswith("seed_") for name in names), line  # (no folder again)
        assert all((workdir / folder / name).exists() for name in names), line
    assert len(lines) == start + 1 + len(seeds)


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_glue_cli_trains_seeds_keeps_best_and_writes_submission(data_root, tmp_path):
    workdir = tmp_path / "sst2"
    command = [
        sys.executable,
        "-m",
        "bertjax.finetune",
        "--config=configs/finetune/glue.py",
        "--config.task=sst2",
        f"--config.init_checkpoint={data_root}/pretrain",
        f"--config.data_dir={data_root}",
        "--config.max_seq_length=16",
        "--config.learning_rate=1e-3",
        "--config.num_train_epochs=10",
        "--config.eval_batch_size=8",
        "--config.seeds=1,2",
        f"--workdir={workdir}",
    ]
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["skipped"]["train"] == {"missing column": 1, "unknown label": 1}
    accuracies = [seed["dev"]["dev"]["accuracy"] for seed in summary["seeds"]]
    assert min(accuracies) >= 0.8, accuracies  # the sentiment word decides the label
    stats = summary["summary"]["dev/accuracy"]
    assert stats["mean"] == pytest.approx(np.mean(accuracies))
    assert stats["std"] == pytest.approx(np.std(accuracies))
    assert stats["median"] == pytest.approx(np.median(accuracies))
    for seed in summary["seeds"]:
        seed_dir = workdir / f"seed_{seed['seed']}"
        dev_rows = [
            json.loads(line)
            for line in (seed_dir / "metrics.jsonl").open()
            if json.loads(line)["split"] == "dev"
        ]
        best = dev_rows[int(np.argmax([r["accuracy"] for r in dev_rows]))]  # the first best
        assert os.listdir(seed_dir / "checkpoints") == [str(best["step"])]
        assert (seed["best_step"], seed["best_epoch"]) == (best["step"], best["epoch"])
        assert seed["dev"]["dev"]["accuracy"] == best["accuracy"]
        assert any(
            n.startswith("events.out.tfevents") for n in os.listdir(seed_dir / "tensorboard")
        )
        lines = (seed_dir / "predictions" / "SST-2.tsv").read_text().splitlines()
        assert lines[0] == "index\tprediction" and len(lines) == 11
        assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    assert "sst2 dev/accuracy: mean" in result.stdout
    assert_console_in_order(result.stdout, workdir, summary["seeds"])
    assert "orbax" in (workdir / "log.txt").read_text()  # the libraries' INFO lines go there
    assert_console_in_log(result.stdout + result.stderr, workdir / "log.txt")  # and ours
    # The console: the libraries' INFO quiet, the learning rate, ETA, baseline and outputs.
    assert_quiet_console(result.stdout + result.stderr)
    assert re.search(
        r"seed 1 step \d+/\d+ loss [\d.]+ lr [\d.e-]+ \(\d+s, eta \d+m\d+s\)", result.stdout
    ), result.stdout
    assert "baseline 0.5000" in result.stdout  # dev: 20 of each label
    assert summary["baselines"]["dev"]["accuracy"] == 0.5
    assert json.loads((workdir / "config.json").read_text())["seeds"] == "1,2"
    rows = [json.loads(line) for line in (workdir / "seed_1" / "metrics.jsonl").open()]
    assert [r["epoch"] for r in rows if r["split"] == "dev"] == list(range(1, 11))
    assert all(r["learning_rate"] > 0 for r in rows if r["split"] == "train")


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_feature_based_ner_trains_only_the_tagger(data_root, tmp_path):
    config = small(
        config_file("ner.py"),
        data_root,
        data_dir=os.path.join(data_root, "conll"),
        feature_based=True,
        lstm_size=16,
        num_train_epochs=6,
        learning_rate=1e-2,
        train_batch_size=8,
        do_lower_case=True,
    )
    summary = finetune.run(config, str(tmp_path))  # 8 devices: sharded batches and eval padding
    seed = summary["seeds"][0]
    assert set(seed["dev"]["dev"]) == {"precision", "recall", "f1"}
    assert set(seed["test"]["test"]) == {"precision", "recall", "f1"}
    assert set(summary["summary"]) == {
        f"{split}/{m}" for split in ("dev", "test") for m in ("precision", "recall", "f1")
    }
    assert (tmp_path / "seed_1" / "predictions" / "test_predictions.txt").exists()
    tagger = BertForTokenClassification(TINY, 9, feature_based=True, lstm_size=16)
    tuned = checkpoint.restore_params(
        str(tmp_path / "seed_1" / "checkpoints"),
        pretrained_weights.abstract_params_on_one_device(tagger),
    )
    jax.tree.map(np.testing.assert_array_equal, pretrained_encoder(data_root), tuned["bert"])
    # Adam moments only for the tagger: none for the frozen encoder.
    params = pretrained_weights.abstract_params_on_one_device(tagger)
    moments = jax.eval_shape(
        finetune_setup.optimizer(FinetuneSettings.of(config.to_dict()), 10, tagger).init, params
    )

    def size(tree):
        return sum(x.size for x in jax.tree.leaves(tree))

    assert size(moments) <= 2 * (size(params) - size(params["bert"])) + 8
    assert seed["dev"]["dev"]["f1"] > 0.5, seed  # names are tagged from the frozen features


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_squad_end_to_end(data_root, tmp_path):
    squad_file = os.path.join(data_root, "squad.json")
    config = small(
        config_file("squad.py"),
        data_root,
        train_file=squad_file,
        predict_file=squad_file,
        max_seq_length=24,
        doc_stride=8,
        max_query_length=8,
        num_train_epochs=2,
    )
    summary = finetune.run(config, str(tmp_path), devices=jax.devices()[:1])
    dev = summary["seeds"][0]["dev"]["dev"]
    predictions = json.loads((tmp_path / "seed_1" / "predictions" / "predictions.json").read_text())
    assert sorted(predictions) == sorted(f"q{i}" for i in range(40))
    # The official SQuAD v1.1 scores of the predictions written (each question has one answer).
    gold = {
        qa["id"]: qa["answers"][0]["text"]
        for paragraph in json.loads(Path(squad_file).read_text())["data"][0]["paragraphs"]
        for qa in paragraph["qas"]
    }
    scores = [official_squad_v1(predictions[qid], answer) for qid, answer in gold.items()]
    assert dev["exact_match"] == pytest.approx(100.0 * np.mean([em for em, _ in scores]))
    assert dev["f1"] == pytest.approx(100.0 * np.mean([f1 for _, f1 in scores]))


def official_squad_v1(prediction: str, answer: str) -> tuple[float, float]:
    """(exact match, F1) as in the official evaluate-v1.1.py (written out again here)."""

    def tokens(text):
        text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
        return re.sub(r"\b(a|an|the)\b", " ", text).split()

    got, want = tokens(prediction), tokens(answer)
    common = sum((collections.Counter(got) & collections.Counter(want)).values())
    if common == 0:
        return float(got == want), 0.0
    precision, recall = common / len(got), common / len(want)
    return float(got == want), 2 * precision * recall / (precision + recall)


def test_clear_errors(data_root, tmp_path):
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        data_dir=data_root,
        init_checkpoint=str(tmp_path / "nothing"),
    )
    with pytest.raises(pretrained.PretrainedError, match=r"init_checkpoint=.* does not exist"):
        finetune.run(config, str(tmp_path / "a"), devices=jax.devices()[:1])
    assert not (tmp_path / "nothing").exists()  # nothing created in passing
    os.makedirs(tmp_path / "empty")
    config.init_checkpoint = str(tmp_path / "empty")
    with pytest.raises(pretrained.PretrainedError, match="no finished checkpoint"):
        finetune.run(config, str(tmp_path / "a"), devices=jax.devices()[:1])
    (tmp_path / "bigger.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 64}))
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        data_dir=data_root,
        model_config=str(tmp_path / "bigger.json"),
    )
    with pytest.raises(ConversionError, match=r"hidden_size: checkpoint 32, config\.model 64"):
        finetune.run(config, str(tmp_path / "b"), devices=jax.devices()[:1])
    assert not (tmp_path / "b").exists()  # refused after taking its lock: no log.txt, config.json
    config = small(
        config_file("glue.py"), data_root, task="sst2", data_dir=data_root, max_train_examples=1
    )
    with pytest.raises(
        finetune_setup.FinetuneError,
        match=r"^1 training examples give no step of "
        r"batch 32 in 3.0 epochs: raise --config.num_train_epochs or lower "
        r"--config.train_batch_size$",
    ):
        finetune.run(config, str(tmp_path / "c"), devices=jax.devices()[:1])
    assert not (tmp_path / "c").exists()


def test_an_overflowing_update_is_never_saved_and_skipped_steps_are_named(
    data_root, tmp_path, caplog
):
    """A learning rate of 3e38 with no warmup overflows the parameters in the first update
    (Adam's first ratio is about 3): the steps after it are skipped (and said so), and the
    epoch's checkpoint is refused, naming the flag."""
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        data_dir=data_root,
        learning_rate=3e38,
        warmup_proportion=0.0,
        num_train_epochs=1.0,
    )
    with pytest.raises(
        nonfinite.NonFiniteState,
        match=r"the params hold NaN or Inf; refusing to "
        r"write a checkpoint .*: lower --config.learning_rate$",
    ):
        finetune.run(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert "steps up to step 3 skipped: their loss or gradients held NaN or Inf" in caplog.text
    assert not list((tmp_path / "run").glob("**/checkpoints/[0-9]*"))


def test_fine_tuning_profiles_the_steps_after_each_seeds_first(data_root, tmp_path, capsys):
    """profile_steps=1: process 0 writes a jax.profiler trace of the step after the seed's
    first (compiled) one where TensorBoard's profile plugin reads it, under
    DIR/seed_S/profile, and says where in one line."""
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        data_dir=data_root,
        num_train_epochs=1.0,
        profile_steps=1,
    )
    finetune.run(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    profile = tmp_path / "run" / "seed_1" / "profile"
    traces = list(profile.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0, list(profile.rglob("*"))
    assert f"Profile of steps 2-2: {profile} (view it with" in capsys.readouterr().out


def test_a_rerun_may_change_how_it_is_watched_but_not_what_it_computes(tmp_path):
    """A used DIR holds the same run whatever its profile_steps (`OBSERVING_FIELDS`); any
    other changed field is refused, naming it."""
    config = {"learning_rate": 5e-5, "profile_steps": 0, "seeds": "1"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    finetune_loop.check_workdir(json.dumps({**config, "profile_steps": 3}), str(tmp_path), False)
    without = {k: v for k, v in config.items() if k != "profile_steps"}  # (written before it)
    (tmp_path / "config.json").write_text(json.dumps(without))
    finetune_loop.check_workdir(json.dumps(config), str(tmp_path), False)
    with pytest.raises(ConfigError, match=r"other settings \(learning_rate: 5e-05 -> 0\.0001\)"):
        finetune_loop.check_workdir(
            json.dumps({**config, "learning_rate": 1e-4}), str(tmp_path), False
        )


def run_extract_features(
    directory, init_checkpoint: str, *flags: str
) -> subprocess.CompletedProcess:
    """`python -m bertjax.extract_features` from `directory/in.txt` to `directory/out.jsonl`."""
    command = [
        sys.executable,
        "-m",
        "bertjax.extract_features",
        f"--input_file={directory}/in.txt",
        f"--output_file={directory}/out.jsonl",
        f"--init_checkpoint={init_checkpoint}",
        *flags,
    ]
    return subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_extract_features_says_in_one_line_what_it_cannot_write(data_root, tmp_path):
    """An OSError other than a missing file (here: the output is a directory) is one line."""
    (tmp_path / "in.txt").write_text("the movie was good .\n")
    (tmp_path / "out.jsonl").mkdir()
    result = run_extract_features(tmp_path, f"{data_root}/pretrain", "--max_seq_length=16")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [
        f"error: Is a directory: {tmp_path}/out.jsonl (a directory is given where "
        "a file is expected)"
    ], result.stderr[-3000:]


def test_a_max_seq_length_beyond_the_positions_is_one_line(data_root, tmp_path):
    """extract_features and probe check --max_seq_length against the checkpoint's positions
    (not an XLA shape error's traceback), before any text is read."""
    positions = TINY.max_position_embeddings
    line = (
        f"error: --max_seq_length={positions + 1} is out of range: the model has {positions} "
        "positions (max_position_embeddings), and [CLS] and [SEP] take 2; set --max_seq_length "
        f"between 2 and {positions}"
    )
    (tmp_path / "in.txt").write_text("the movie was good .\n")
    extract = run_extract_features(
        tmp_path, f"{data_root}/pretrain", f"--max_seq_length={positions + 1}"
    )
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.probe",
            f"--init_checkpoint={data_root}/pretrain",
            f"--workdir={tmp_path}/probe",
            f"--max_seq_length={positions + 1}",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    for result in (extract, probe):
        errors = [e for e in result.stderr.splitlines() if e.startswith("error: ")]
        assert result.returncode == 1 and errors == [line], result.stderr[-3000:]
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "probe").exists()


def test_extract_features_original_format(data_root, tmp_path):
    (tmp_path / "in.txt").write_text("the movie was good .\nacme film ||| paris story bad .\n")
    result = run_extract_features(
        tmp_path, f"{data_root}/pretrain", "--max_seq_length=16", "--batch_size=4"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert_quiet_console(result.stdout + result.stderr)
    assert "Wrote 2 records (layers -1,-2,-3,-4)" in result.stdout  # the default: the last 4
    assert extract_features.default_layers(2) == [-1, -2]  # all of a smaller model
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["linex_index"] for r in records] == [0, 1]
    assert [
        f["token"] for f in records[1]["features"]
    ] == "[CLS] acme film [SEP] paris story bad . [SEP]".split()
    first = records[0]["features"][0]
    assert [layer["index"] for layer in first["layers"]] == [-1, -2, -3, -4]
    assert len(first["layers"][0]["values"]) == 32
    # The values are the encoder's last layer for this input (rounded to 6 places).
    ids = jnp.array([[VOCAB.index(t) for t in "[CLS] the movie was good . [SEP]".split()]])
    sequence, _ = BertModel(TINY).apply(
        {"params": pretrained_encoder(data_root)}, ids, ids * 0, ids * 0 + 1
    )
    np.testing.assert_allclose(first["layers"][0]["values"], sequence[0, 0], atol=2e-6)


def test_google_and_hugging_face_checkpoints_initialise_fine_tuning(data_root, tmp_path):
    """The pretraining checkpoint, converted to Google TF and to Hugging Face (with vocab.txt
    beside it), gives the same architecture, tokenizer and encoder weights to fine-tuning."""
    bert_config, params = pretrained.read(os.path.join(data_root, "pretrain"))
    expected = pretrained_encoder(data_root)
    for kind, save in (("tf", bert_tf.save_tf), ("hf", bert_hf.save_hf)):
        directory = tmp_path / f"uncased_{kind}"
        save(bert_config, params, str(directory))
        (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        config = small(
            config_file("glue.py"), data_root, task="sst2", init_checkpoint=str(directory)
        )
        source = FinetuneSettings.of(config.to_dict()).source
        pretrain = pretrained.pretraining_run(source)
        assert pretrained.model_config_of(source, pretrain) == pretrained.model_config_of(
            source,
            pretrained.pretraining_run(
                FinetuneSettings.of(
                    small(config_file("glue.py"), data_root, task="sst2").to_dict()
                ).source
            ),
        )
        assert pretrained.tokenizer_of(source, pretrain).vocab_size == len(VOCAB)
        loaded = pretrained_weights.load_pretrained(
            str(directory),
            {"bert": pretrained_weights.abstract_params_on_one_device(BertModel(TINY))},
            TINY,
        )["bert"]
        jax.tree.map(np.testing.assert_array_equal, loaded, expected)
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        init_checkpoint=str(tmp_path / "uncased_hf"),
        do_lower_case=False,
    )
    with pytest.raises(ValueError, match="uncased model"):
        source = FinetuneSettings.of(config.to_dict()).source
        pretrained.tokenizer_of(source, pretrained.pretraining_run(source))


class Killed(Exception):
    """Stands for a kill -9 in the middle of a fine-tuning run."""


@pytest.mark.slow  # (four fine-tuning runs, about 45 s: the `slow` stage of .ci/run)
def test_fine_tuning_resumes_reruns_and_refuses_other_settings(data_root, tmp_path, monkeypatch):
    """A run stopped just before its epoch-3 checkpoint (what kill -9 leaves: epoch 3's rows
    written, checkpoint 2 the latest; a copy with that checkpoint truncated is one error naming
    it and the way on), rerun with the same config, resumes after epoch 2 and
    ends as an uninterrupted run, with one row per step; a rerun of the finished run predicts
    again without training; other settings in that workdir are refused, naming them, and
    leave it as it was; --overwrite replaces the run."""
    config = small(
        config_file("glue.py"),
        data_root,
        task="sst2",
        data_dir=data_root,
        num_train_epochs=3,
        log_every=1,
    )
    one_device = jax.devices()[:1]
    expected = finetune.run(config, str(tmp_path / "reference"), devices=one_device)
    reference_rows = (tmp_path / "reference" / "seed_1" / "metrics.jsonl").read_text()
    save = checkpoint.Checkpointer.save

    def killed_before_epoch_3(self, step, state, position, meta, force=False):
        if position["epoch"] == 3:
            raise Killed
        return save(self, step, state, position, meta, force)

    workdir = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint.Checkpointer, "save", killed_before_epoch_3)
        with pytest.raises(Killed):
            finetune.run(config, str(workdir), devices=one_device)

    def rows():
        return (workdir / "seed_1" / "metrics.jsonl").read_text()

    assert '"epoch": 3' in rows()
    damaged = tmp_path / "damaged"  # (a copy: its latest checkpoint truncated)
    shutil.copytree(workdir, damaged)
    latest = max((damaged / "seed_1" / "checkpoints").iterdir(), key=lambda p: int(p.name))
    state_file = max(
        (p for p in (latest / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    state_file.write_bytes(state_file.read_bytes()[: state_file.stat().st_size // 2])
    with pytest.raises(
        checkpoint_checks.DamagedCheckpoint,
        match=rf"{latest.name} is damaged: .*; "
        r"move it out of .* and rerun to resume from the checkpoint before it",
    ):
        finetune.run(config, str(damaged), devices=one_device)
    shutil.rmtree(damaged)  # (a copy whose position says epoch 3 instead of 2: before, it
    shutil.copytree(workdir, damaged)  # resumed as if finished, without a word)
    position = damaged / "seed_1" / "checkpoints" / latest.name / "data" / "metadata"
    position.write_text(position.read_text().replace('"epoch": 2', '"epoch": 3', 1))
    with pytest.raises(
        checkpoint_checks.DamagedCheckpoint,
        match=rf"{latest.name} is damaged: "
        r"data/metadata does not match its checksum; move it out",
    ):
        finetune.run(config, str(damaged), devices=one_device)
    resumed = finetune.run(config, str(workdir), devices=one_device)
    assert rows() == reference_rows
    assert resumed["seeds"][0]["dev"] == expected["seeds"][0]["dev"]
    best = str(expected["seeds"][0]["best_step"])
    assert os.listdir(workdir / "seed_1" / "checkpoints") == [best]
    again = finetune.run(config, str(workdir), devices=one_device)
    assert again["seeds"][0]["dev"] == expected["seeds"][0]["dev"] and rows() == reference_rows
    before = (workdir / "config.json").read_text()
    with pytest.raises(
        ConfigError,
        match=r"holds a fine-tuning run with other "
        r"settings \(learning_rate: 0.001 -> 0.002\): use a new --workdir, or "
        r"--overwrite",
    ):
        config.learning_rate = 2e-3
        finetune.run(config, str(workdir), devices=one_device)
    assert (workdir / "config.json").read_text() == before
    assert os.listdir(workdir / "seed_1" / "checkpoints") == [best]
    finetune_loop.check_workdir(config.to_json(), str(workdir), overwrite=True)  # --overwrite
    assert os.listdir(workdir) == ["run.lock"]


def finetune_command(data_root: str, workdir, **overrides) -> list[str]:
    """`python -m bertjax.finetune` on SST-2 with `small`'s settings (and `overrides`)."""
    config = small(config_file("glue.py"), data_root, task="sst2", data_dir=data_root, **overrides)
    defaults = config_file("glue.py")
    return [
        sys.executable,
        "-m",
        "bertjax.finetune",
        "--config=configs/finetune/glue.py",
        f"--workdir={workdir}",
    ] + [f"--config.{key}={value}" for key, value in config.items() if value != defaults[key]]


@pytest.mark.slow  # (three fine-tuning runs, about 30 s)
def test_a_full_disk_while_fine_tuning_is_one_line_and_the_rerun_resumes_exactly(
    data_root, tmp_path
):
    """A seed's checkpoints on a tmpfs with room for one (1200 KiB; one takes about
    800 KiB): the save of epoch 2 (step 6) fails. One
    `error:` line names the step, the file, "No space left on device" and the checkpoint kept,
    with Orbax's tracebacks in WORKDIR/log.txt only, and the process exits at once without
    announcing the failed save. With space again, the same command resumes from epoch 1 (step 3) and
    ends with the metrics of an uninterrupted run."""
    overrides = {"num_train_epochs": 3, "log_every": 1}
    reference = Trainer(finetune_command(data_root, tmp_path / "reference", **overrides))
    assert reference.finish() == 0, reference.output()
    workdir = tmp_path / "run"
    directory, kept = workdir / "seed_1" / "checkpoints", tmp_path / "kept"
    directory.mkdir(parents=True)
    args = finetune_command(data_root, workdir, **overrides)
    run = Trainer(on_a_small_filesystem(args, directory, 1200, f"cp -a {directory} {kept}"))
    run.wait_for("^error: ")
    started = time.time()
    assert run.finish(silence=30) == 1, run.output()  # (not held by Orbax's writer threads)
    seconds, output = time.time() - started, run.output(None)
    error = assert_one_full_disk_line(run, directory, 6, 3, workdir)
    assert "checkpoint step 3 ->" not in output  # (named once the run ends with it kept)
    print(
        f"\n{error.strip()}\n({len(run.lines)} lines printed, "
        f"{len((workdir / 'log.txt').read_text().splitlines())} in the log; exit "
        f"{seconds:.1f} s after the error line)"
    )

    shutil.rmtree(directory)
    shutil.copytree(kept, directory)
    resumed = Trainer(args)
    assert resumed.finish() == 0, resumed.output()
    assert "seed 1: resuming from" in resumed.output(None)

    def summary(path):
        return json.loads((path / "summary.json").read_text())["seeds"][0]["dev"]

    assert summary(workdir) == summary(tmp_path / "reference")
    assert (workdir / "seed_1" / "metrics.jsonl").read_text() == (
        tmp_path / "reference" / "seed_1" / "metrics.jsonl"
    ).read_text()


@pytest.mark.slow  # (three fine-tuning runs, about 30 s)
def test_ctrl_c_while_fine_tuning_saves_at_the_step_and_the_rerun_resumes_exactly(
    data_root, tmp_path
):
    """Ctrl-C after step 4 (within epoch 2 of 3, 3 steps each) saves at the end of step 5,
    exits 130 (as a shell expects of Ctrl-C) and says as its last line, also in log.txt, how
    to continue; the same command resumes from step 5 and ends with the uninterrupted run's
    `metrics.jsonl` and dev metrics."""
    overrides = {"num_train_epochs": 3, "log_every": 1}
    reference = Trainer(finetune_command(data_root, tmp_path / "reference", **overrides))
    assert reference.finish() == 0, reference.output()
    workdir = tmp_path / "run"
    args = finetune_command(data_root, workdir, **overrides)
    run = Trainer(args, pause="step:4")
    run.wait_for_pause()
    run.proc.send_signal(signal.SIGINT)
    run.wait_for("Ctrl-C: saving a checkpoint at the end of this step")
    run.release()
    assert run.finish(silence=60) == 130, run.output()
    assert run.lines[-1] == (
        "Stopped at seed 1 step 5 of 9 (Ctrl-C): checkpoint saved; rerun "
        "the same command to continue\n"
    ), run.output()
    assert "5" in os.listdir(workdir / "seed_1" / "checkpoints")
    assert "Traceback" not in run.output(None)
    assert_console_in_log(run.output(None), workdir / "log.txt")

    resumed = Trainer(args)
    assert resumed.finish() == 0, resumed.output()
    assert f"seed 1: resuming from {workdir}/seed_1/checkpoints/5" in resumed.output(None)

    def summary(path):
        return json.loads((path / "summary.json").read_text())["seeds"][0]["dev"]

    assert summary(workdir) == summary(tmp_path / "reference")
    assert (workdir / "seed_1" / "metrics.jsonl").read_text() == (
        tmp_path / "reference" / "seed_1" / "metrics.jsonl"
    ).read_text()
