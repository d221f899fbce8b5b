"""Optimizers (`bertjax.training.optim.register`) and corpus sources
(`bertjax.data.corpora.register`) are registries: the built-in ones are found by name, an
unknown name is one line listing the registered ones, and an optimizer and a source defined in
tests/ (`toy_optimizer`: SGD with momentum; `toy_source`: JSON Lines files) register with no
edit to shared code, pass the config checks and pretrain."""

import json
import os
import pickle

import jax
import numpy as np
import optax
import pytest

import toy_optimizer
import toy_source
from bertjax import train
from bertjax.checkpoints import checkpoint
from bertjax.data import corpora, corpus, corpus_source, shard_sources
from bertjax.data.errors import DataError
from bertjax.data.settings import DataSettings
from bertjax.errors import ConfigError
from bertjax.training import optim, validate
from test_train import cache_dir, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixtures)

BUILTIN_OPTIMIZERS = "'bert_adam', 'adamw', 'lamb', 'stable_adamw'"


@pytest.fixture
def toy_sgd(monkeypatch):
    """The toy optimizer registered for one test (the registry restored after it)."""
    optim.names()  # (the built-in optimizers first)
    monkeypatch.setattr(optim, "_OPTIMIZERS", dict(optim._OPTIMIZERS))
    return optim.register("toy_sgd", toy_optimizer.sgd_momentum)


@pytest.fixture
def jsonl(monkeypatch):
    """The toy source registered for one test (the registry restored after it)."""
    corpora.names()  # (the built-in sources first)
    monkeypatch.setattr(corpora, "_SOURCES", dict(corpora._SOURCES))
    return corpora.register(toy_source.SOURCE)


@pytest.fixture
def jsonl_file(corpus_file, tmp_path) -> str:
    """The text corpus's documents as JSON Lines, one `{"text": ...}` per document."""
    documents = list(corpus.read_text_files([corpus_file]))
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": "\n".join(d)}) + "\n" for d in documents))
    return str(path)


def test_the_built_in_optimizers_and_sources_are_registered():
    assert optim.names() == ("bert_adam", "adamw", "lamb", "stable_adamw")
    assert corpora.names() == ("default", "text", "tfds")
    with pytest.raises(
        ConfigError,
        match=f"^optimizer.name='sgd' is not one of {BUILTIN_OPTIMIZERS}: an optimizer must be "
        r"registered \(bertjax.training.optim.register\)",
    ):
        optim.get("sgd")
    with pytest.raises(
        DataError,
        match="^data.source='jsonl' is not one of 'default', 'text', 'tfds': a source must be "
        r"registered \(bertjax.data.corpora.register\)",
    ):
        corpora.get("jsonl")


def test_a_registered_optimizer_is_built_and_checked_by_name(toy_sgd, corpus_file, cache_dir):
    assert optim.names() == ("bert_adam", "adamw", "lamb", "stable_adamw", "toy_sgd")
    cfg = optim.OptimizerConfig(
        peak_learning_rate=0.1, warmup_steps=0, total_steps=10, name="toy_sgd", b1=0.5
    )
    params = {"dense": {"kernel": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32)}}
    grads = jax.tree.map(lambda p: p * 3.0, params)  # (norm 6: clipped to 1)
    reference = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.add_decayed_weights(0.01, mask={"dense": {"kernel": True, "bias": False}}),
        optax.sgd(optax.linear_schedule(0.1, 0.0, 10), momentum=0.5),
    )

    def two_updates(tx: optax.GradientTransformation) -> list:
        state, updates = tx.init(params), []
        for _ in range(2):
            update, state = tx.update(grads, state, params)
            updates.append(update)
        return updates

    actual, expected = two_updates(optim.make_optimizer(cfg)), two_updates(reference)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), actual, expected)
    config = tiny_config(corpus_file, cache_dir)
    config.optimizer.name = "toy_sgd"
    validate.pretraining(config)  # (accepted: registered)
    config.optimizer.name = "adam"
    with pytest.raises(
        ConfigError, match=f"^optimizer.name='adam' is not one of {BUILTIN_OPTIMIZERS}, 'toy_sgd';"
    ):
        validate.pretraining(config)


def test_a_registered_source_is_checked_read_cut_and_sent_to_workers(
    jsonl, jsonl_file, corpus_file
):
    data = {**tiny_config("", "").data.to_dict(), "source": "jsonl", "input_files": jsonl_file}
    settings = DataSettings.of(data)
    expected = list(corpus.read_text_files([corpus_file]))
    assert list(corpus_source.read_documents(settings, 0, 1, corpus.CorpusStats())) == expected
    assert corpus_source.source_identity(settings)["format"] == "jsonl"
    for index in range(2):
        reader = corpus_source.corpus_reader(settings, index, 2)
        shards = list(shard_sources.cut(reader, corpus.CorpusStats(), shard_bytes=2000))
        assert len(shards) >= 2
        travelled = pickle.loads(pickle.dumps(reader))  # (as a worker process gets it)
        read = [d for shard in shards for d in travelled.read(shard)]
        assert read == expected[index::2]
    with pytest.raises(DataError, match=r"needs --config\.data\.input_files"):
        corpus_source.corpus_reader(DataSettings.of({**data, "input_files": ""}), 0, 1)
    with pytest.raises(
        DataError,
        match=r"^data\.source='json' is not one of 'default', 'text', 'tfds', 'jsonl'; set "
        r"--config\.data\.source$",
    ):
        DataSettings.of({**data, "source": "json"})


def test_a_tiny_run_pretrains_with_a_registered_optimizer_and_source(
    toy_sgd, jsonl, jsonl_file, tmp_path
):
    config = tiny_config(
        jsonl_file,
        str(tmp_path / "cache"),
        **{"train.total_steps": 3, "long_phase.fraction": 0.0, "optimizer.warmup_steps": 1},
    )
    config.data.source, config.optimizer.name = "jsonl", "toy_sgd"
    final = train.train_and_evaluate(config, str(tmp_path / "run"), devices=jax.devices()[:1])
    assert np.isfinite(final["mlm_loss"])
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2, 3]
    meta = checkpoint.read_meta(str(tmp_path / "run" / "checkpoints"))
    assert meta["schedule"]["optimizer"]["name"] == "toy_sgd"
    assert meta["data"]["source"] == {
        "files": [[jsonl_file, os.path.getsize(jsonl_file)]],
        "format": "jsonl",
    }
