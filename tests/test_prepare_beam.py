"""`python -m bertjax.prepare --runner=beam`: the Beam DirectRunner (two worker processes)
writes the same shards as the local job. Marked `beam`: run in the Beam environment
(`pip install -e '.[beam,test]'` in its own virtual environment; .ci/run's last stage)."""

import json
import sys

import pytest

from bertjax import prepare
from bertjax.data import beam_prepare, shard_sources
from test_pipeline import make_config, wordpiece_corpus, wordpiece_vocab  # noqa: F401

BEAM_OPTIONS = "--runner=DirectRunner --direct_num_workers=2 --direct_running_mode=multi_processing"


@pytest.mark.beam
def test_the_direct_runner_writes_the_local_jobs_shards(
    wordpiece_corpus, wordpiece_vocab, tmp_path, monkeypatch
):
    import apache_beam as beam

    created, create = [], beam.Create  # what the driver puts into the pipeline
    monkeypatch.setattr(beam, "Create", lambda values: (created.extend(values), create(values))[1])
    config = make_config(
        wordpiece_corpus,
        **{
            "data.tokenizer": "wordpiece",
            "data.vocab_file": wordpiece_vocab,
            "data.shard_bytes": 3000,
        },
    )  # several shards, so the workers share them
    metas = {}
    for runner in ("local", "beam"):
        output = tmp_path / runner
        prepare.prepare_all(config, str(output), runner, BEAM_OPTIONS)
        metas[runner] = {
            path.parent.name: json.loads(path.read_text()) for path in output.glob("*/meta.json")
        }
    assert len(metas["local"]) == 2  # both phases
    for phase, local in metas["local"].items():
        beam = metas["beam"][phase]
        assert local["shards"] >= 4 and local["train_instances"] > 0
        assert beam["files"] == local["files"]  # every file's bytes, SHA-256 and rows
        keys = (
            "shards",
            "documents",
            "tokens",
            "train_instances",
            "eval_instances",
            "eval_documents",
            "settings",
        )
        assert {k: beam.get(k) for k in keys} == {k: local.get(k) for k in keys}
    assert not list(tmp_path.glob("beam/*/counts"))  # the workers' counts are gone
    # The driver sent descriptors (a position and a count), not text: the workers read it.
    assert {type(shard) for shard in created} == {shard_sources.ShardSource}
    assert sum(shard.documents for shard in created) == sum(
        meta["documents"] for meta in metas["beam"].values()
    )


def test_without_beam_the_runner_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # an import of it fails
    with pytest.raises(
        beam_prepare.BeamMissing,
        match=r"pip install -e '\.\[beam\]' in its "
        "own virtual environment",
    ):
        beam_prepare.shard_runner(["--runner=DirectRunner"])
