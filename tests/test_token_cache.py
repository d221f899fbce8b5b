"""Tests for bertjax.data.token_cache: the corpus is tokenized once whatever the number of
phases, and the prepared bytes are those of a preparation that tokenizes every phase."""

import collections
import json
import pathlib

import numpy as np
import pytest

from bertjax.data import corpus_source, loaders, pipeline, token_cache, tokenize_corpus
from bertjax.data.settings import DataSettings
from test_pipeline import config, corpus_file, documents, make_config, phases_of, sp_tokenizer  # noqa: F401


@pytest.fixture
def counted(monkeypatch):
    """How many documents were tokenized (one worker: in this process)."""
    seen = []
    real = tokenize_corpus.tokenize_documents

    def tokenize_documents(docs, tokenizer):
        docs = list(docs)
        seen.append(len(docs))
        return real(docs, tokenizer)

    monkeypatch.setattr(tokenize_corpus, "tokenize_documents", tokenize_documents)
    return seen


def prepared_files(directory: pathlib.Path) -> dict:
    return json.loads((directory / "meta.json").read_text())["files"]


def build_phases(cfg, tokenizer, parent: pathlib.Path, phases) -> dict[str, dict]:
    out = {}
    for phase in phases:
        directory = parent / f"{phase.name}_{phase.max_seq_length}"
        pipeline.build(str(directory), DataSettings.of(cfg.data), phase, tokenizer)
        out[phase.name] = prepared_files(directory)
    return out


def test_every_phase_reads_the_tokens_of_one_tokenization(config, sp_tokenizer, tmp_path, counted):
    size = pathlib.Path(config.data.input_files).stat().st_size
    cfg = make_config(config.data.input_files, **{"data.shard_bytes": size // 3})
    phases = phases_of(cfg)
    assert len(phases) == 2
    both = build_phases(cfg, sp_tokenizer, tmp_path / "both", phases)
    shards = json.loads((tmp_path / "both" / "long_128" / "meta.json").read_text())["shards"]
    assert shards >= 3 and len(counted) == shards  # each shard's documents tokenized once
    assert sum(counted) == 300
    (tokens,) = (tmp_path / "both").glob("tokens_*")
    assert len(list(tokens.glob("shard_*/counts.json"))) == shards
    # The long phase alone, tokenizing its shards itself: the same bytes.
    alone = build_phases(cfg, sp_tokenizer, tmp_path / "alone", phases[1:])
    assert alone["long"] == both["long"]
    # Another shard size (shards of other documents) or tokenizer: other entries.
    other = make_config(config.data.input_files, **{"data.shard_bytes": size // 2})
    named = lambda c: pipeline.tokens_directory(  # noqa: E731
        str(tmp_path / "both" / "short_64"),
        corpus_source.Derived(DataSettings.of(c.data), sp_tokenizer),
    )
    assert named(cfg) == str(tokens)
    assert len({named(cfg), named(other)}) == 2


def test_a_damaged_entry_is_tokenized_again(config, sp_tokenizer, tmp_path, counted):
    phase = phases_of(config)[0]
    first = build_phases(config, sp_tokenizer, tmp_path / "a", [phase])
    (entry,) = (tmp_path / "a").glob("tokens_*/shard_00000")
    ids = entry / "ids.npy"
    ids.write_bytes(ids.read_bytes()[:-10])  # truncated
    (tmp_path / "a" / f"short_{phase.max_seq_length}").rename(tmp_path / "a" / "old")
    again = build_phases(config, sp_tokenizer, tmp_path / "a", [phase])
    assert again == first and len(counted) == 2
    documents, _ = token_cache._load(str(entry))
    assert sum(len(d) for d in documents) > 0


def test_a_shard_without_tokens_is_stored_and_read_back(tmp_path, sp_tokenizer):
    stored = token_cache.tokenized_shard(str(tmp_path), 0, lambda: [["   "], ["\t"]], sp_tokenizer)
    assert stored == (
        [],
        {"empty_sentences": 2, "empty_documents": 2, "long_sentences_cut": 0, "tokens": 0},
    )
    again = token_cache.tokenized_shard(
        str(tmp_path), 0, lambda: pytest.fail("read again"), sp_tokenizer
    )
    assert again == stored
    text = [["the cat sat.", "on a mat"], ["a dog"]]
    fresh, counts = tokenize_corpus.tokenize_documents(text, sp_tokenizer)
    stored, stored_counts = token_cache.tokenized_shard(
        str(tmp_path), 1, lambda: text, sp_tokenizer
    )
    assert stored_counts == counts
    assert [[s.tolist() for s in d] for d in stored] == [[s.tolist() for s in d] for d in fresh]
    assert all(isinstance(s, np.ndarray) for d in stored for s in d)


def test_what_the_phases_derive_from_the_corpus_is_computed_once(
    config, sp_tokenizer, tmp_path, monkeypatch
):
    """The corpus's identity (a glob and a size per file) and the special tokens: once for
    every phase, whether the phases are prepared or reused (issue 35; 3 and 2 per phase
    before)."""
    calls = collections.Counter()
    for name in ("source_identity", "specials_of"):
        real = getattr(corpus_source, name)
        monkeypatch.setattr(
            corpus_source,
            name,
            lambda *args, real=real, name=name: calls.update([name]) or real(*args),
        )
    phases = phases_of(config)
    assert [p.name for p in phases] == ["short", "long"]
    for _ in ("prepared", "reused"):
        calls.clear()
        prepared = loaders.prepare_data(
            DataSettings.of(config.data),
            phases,
            sp_tokenizer.vocab_size,
            sp_tokenizer,
            str(tmp_path),
            0,
            1,
        )
        assert len(prepared) == 2
        assert dict(calls) == {"source_identity": 1, "specials_of": 1}
