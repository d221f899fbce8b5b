"""Per-layer probing (`python -m bertjax.probe`): features of a frozen encoder, one probe per
layer and Table 7 combination, official metrics, probe.json and probe.png. A tiny random-weight
BERT saved as a Hugging Face checkpoint, GLUE TSV and CoNLL files whose labels a probe can read
off the words."""

import dataclasses
import json
import os
import random
import re
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest

from bertjax.families import bert_hf
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models.bert.model import BertConfig, BertForPreTraining, example_inputs
from bertjax.tasks import features, probing

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POSITIVE, NEGATIVE = ["good", "great", "fun", "lovely"], ["bad", "awful", "dull", "boring"]
NAMES, PLACES = ["john", "mary", "anna"], ["paris", "rome", "oslo"]
FILLER = ["the", "movie", "was", "a", "plot", "and", "very", "film", "story", "it"]
VOCAB = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    ".",
    *POSITIVE,
    *NEGATIVE,
    *NAMES,
    *PLACES,
    *FILLER,
]
TINY = BertConfig(
    vocab_size=len(VOCAB),
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """An HF checkpoint (random weights) with vocab.txt, SST-2 TSVs and CoNLL files."""
    root = tmp_path_factory.mktemp("probe")
    rng = random.Random(0)
    model = BertForPreTraining(TINY)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(3), *example_inputs(model))["params"])
    bert_hf.save_hf(TINY, jax.tree.map(np.asarray, params), str(root / "hf"))
    (root / "hf" / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    os.makedirs(root / "glue" / "SST-2")
    for split, count in (("train", 160), ("dev", 60)):
        rows = [
            " ".join([*rng.sample(FILLER, 3), rng.choice(POSITIVE if i % 2 else NEGATIVE)])
            + f"\t{i % 2}"
            for i in range(count)
        ]
        (root / "glue" / "SST-2" / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows))
    os.makedirs(root / "conll")
    for split, count in (("train.txt", 120), ("valid.txt", 40)):
        lines = ["-DOCSTART- -X- -X- O", ""]
        for _ in range(count):
            name, place = rng.choice(NAMES), rng.choice(PLACES)
            words = [(name, "B-PER"), ("was", "O"), ("a", "O"), (place, "B-LOC"), (".", "O")]
            lines += [f"{w} X X {t}" for w, t in rng.sample(words, 5)] + [""]
        (root / "conll" / split).write_text("\n".join(lines) + "\n")
    return str(root)


def test_layer_features_are_the_encoder_outputs(root):
    """Layer k's GLUE feature is the mean of layer k's outputs over the real tokens; CoNLL's
    are the labelled first sub-tokens' vectors."""
    model, params, tokenizer = pretrained_weights.load_encoder(
        pretrained.Source(init_checkpoint=os.path.join(root, "hf"))
    )
    options = features.TaskOptions(data_dir=os.path.join(root, "glue"), max_seq_length=16)
    sst2 = probing.task_adapter("sst2", options, tokenizer).load("dev")
    pooled = probing.layer_features(model, params, sst2, batch_size=16)  # 60 = 3 full + 12
    inputs = sst2.features
    (layers, _), sown = model.apply(
        {"params": params},
        inputs["input_ids"],
        inputs["segment_ids"],
        inputs["input_mask"],
        True,
        all_layers=True,
        mutable=["intermediates"],
    )
    stack = np.concatenate([sown["intermediates"]["encoder"]["embedding_output"][0][None], layers])
    mask = inputs["input_mask"][None, :, :, None]
    np.testing.assert_allclose(pooled, (stack * mask).sum(2) / mask.sum(2), atol=1e-5)
    assert pooled.shape == (3, 60, 32)

    conll = probing.task_adapter(
        "conll2003", dataclasses.replace(options, data_dir=os.path.join(root, "conll")), tokenizer
    )
    dev = conll.load("dev")
    tokens = probing.layer_features(model, params, dev, batch_size=16)
    assert tokens.shape == (3, 5 * 40, 32) and len(probing.probe_labels(dev)) == 200
    # --random_init: the same architecture, fresh weights.
    random_model, random_params, _ = pretrained_weights.load_encoder(
        pretrained.Source(init_checkpoint=os.path.join(root, "hf")), random_init=True
    )
    assert random_model.config == model.config
    assert not np.allclose(
        random_params["embeddings"]["word_embeddings"], params["embeddings"]["word_embeddings"]
    )


def test_table_7_layer_sets():
    sets = probing.layer_sets(12)
    assert sets["embeddings"] == ([0], "mix") and sets["layer_12"] == ([12], "mix")
    assert sets["second_to_last"] == ([11], "mix") and sets["last"] == ([12], "mix")
    assert sets["concat_last_four"] == ([9, 10, 11, 12], "concat")
    assert sets["weighted_sum_last_four"] == ([9, 10, 11, 12], "mix")
    assert sets["weighted_sum_all"] == (list(range(1, 13)), "mix")
    assert probing.layer_sets(2)["concat_last_four"] == ([1, 2], "concat")


def test_unknown_and_regression_tasks_are_refused():
    with pytest.raises(ValueError, match="'stsb' is a regression"):
        probing.task_adapter("stsb", features.TaskOptions(), None)
    with pytest.raises(ValueError, match="unknown GLUE task 'nonesuch'"):
        probing.task_adapter("nonesuch", features.TaskOptions(), None)


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--task=nonesuch", "unknown GLUE task 'nonesuch'"),
        (
            "--vocab_file={tmp}/broken.model",
            "--vocab_file={tmp}/broken.model: not a sentencepiece model",
        ),
    ],
)
def test_what_the_probes_cannot_read_is_one_line(root, tmp_path, flag, message):
    """A reader's, an unknown task's or a tokenizer file's error is a UserError: one `error:`
    line, exit 1."""
    (tmp_path / "broken.model").write_bytes(b"not a model")
    command = [
        sys.executable,
        "-m",
        "bertjax.probe",
        f"--init_checkpoint={root}/hf",
        f"--workdir={tmp_path}/out",
        "--max_seq_length=16",  # (the model's 32 positions)
        flag.format(tmp=tmp_path),
    ]
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        check=False,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(tmp=tmp_path) in errors[0], result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_probe_cli_writes_json_table_and_plot(root, tmp_path):
    """Here without matplotlib (a package that fails to import shadows it): probe.json, the
    per-layer table and one line about the missing plot, exit 0; the plot drawn from the
    record where matplotlib is installed."""
    out, no_matplotlib = tmp_path / "out", tmp_path / "no_matplotlib" / "matplotlib"
    no_matplotlib.mkdir(parents=True)
    (no_matplotlib / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    command = [
        sys.executable,
        "-m",
        "bertjax.probe",
        f"--init_checkpoint={root}/hf",
        "--task=sst2,conll2003",
        f"--glue_dir={root}/glue",
        f"--conll_dir={root}/conll",
        f"--workdir={out}",
        "--seeds=1,2",
        "--epochs=30",
        "--batch_size=16",
        "--learning_rate=1e-2",
        "--max_seq_length=16",
    ]
    result = subprocess.run(
        command,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": f"{no_matplotlib.parent}{os.pathsep}{REPO_ROOT}"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"Wrote {out}/probe.json; no probe.png: {out}/probe.png needs matplotlib: "
        "pip install -e '.[plot]'" in result.stdout
    )
    for task, metric in (("sst2", "accuracy"), ("conll2003", "f1")):
        assert f"{task} (dev {metric}, mean ± std over seeds):" in result.stdout
    assert re.search(r"^  layer_2 +\d\.\d{4} ± \d\.\d{4}", result.stdout, re.MULTILINE)
    assert result.stdout.count("  best") == 2  # one per task
    record = json.loads((out / "probe.json").read_text())
    assert record["num_layers"] == 2 and not record["random_init"]
    names = ["embeddings", "layer_1", "layer_2", *probing.COMBINATIONS]
    for task, metric in (("sst2", "accuracy"), ("conll2003", "f1")):
        entry = record["tasks"][task]
        assert entry["metric"] == metric and list(entry["results"]) == names
        results = entry["results"]
        for name in names:
            assert len(results[name][metric]["values"]) == 2
        assert results["second_to_last"] == results["layer_1"]
        assert results["last"] == results["layer_2"]
        # The words carry the labels: every layer of even a random encoder shows them.
        assert results["embeddings"][metric]["mean"] > 0.9, (task, results["embeddings"])
    pytest.importorskip("matplotlib")
    probing.plot(record, str(out / "probe.png"), "hf")
    assert (out / "probe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
