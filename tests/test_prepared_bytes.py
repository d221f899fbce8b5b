"""Prepared data's bytes are pinned to `pipeline.FORMAT_VERSION`: the version is part of the
prepared-data cache key and of the settings `data.prepared_dir` checks, so data prepared by an
older bertjax is reused only where its bytes are those this version writes. When a change makes
the same config and seed give other bytes (e.g. a new masking random stream), bump
FORMAT_VERSION and pin the new digest below."""

from __future__ import annotations

import hashlib
import os
import random
import runpy

import numpy as np
import pytest

from bertjax.data import pipeline, tokenization
from bertjax.data.settings import DataSettings
from bertjax.training.phase_schedule import Phase

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The digest of the stored arrays of both splits, per version (4: bertjax at acace1b, masks
# from Python's random per instance; 5: masks from masking.py's counter-based stream).
DIGESTS = {
    4: "4fa30acaf99243f1ce13b517aa45ac7c8512eb69fdf3770017b66217b8813c44",
    5: "a05ec68c3f5231204c81e4a8ca21705dbe793fad56df52a52edb1fa222e7b04f",
}

WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "hill", "and", "then", "slept"]
PIECES = ["un", "##der", "##ness", "##ly", "quiet", "sudden"]


def data_config(corpus: str, vocab: str, **overrides) -> DataSettings:
    """configs/base.py's data settings on `corpus` with `vocab`, a fixed seed, one worker."""
    d = runpy.run_path(os.path.join(REPO_ROOT, "configs", "base.py"))["get_config"]().data
    d.update(
        {
            "source": "text",
            "input_files": corpus,
            "text_format": "lines",
            "tokenizer": "wordpiece",
            "vocab_file": vocab,
            "do_lower_case": True,
            "strip_accents": "auto",
            "masked_lm_prob": 0.15,
            "mask_token_prob": 0.8,
            "random_token_prob": 0.1,
            "short_seq_prob": 0.1,
            "dupe_factor": 2,
            "masking": "static",
            "whole_word_mask": False,
            "eval_fraction": 0.1,
            "shard_bytes": 16 << 20,
            "num_workers": 1,
            "prepared_dir": "",
            "seed": 12345,
            **overrides,
        }
    )
    return DataSettings.of(d)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[str, str]:
    """A 120-document corpus of fixed words and its WordPiece vocabulary."""
    root = tmp_path_factory.mktemp("bytes")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join([*tokenization.SPECIAL_TOKENS, *WORDS, *PIECES, "."]) + "\n")
    rng = random.Random(0)
    surface = [*WORDS, "underness", "quietly", "suddenly"]
    documents = [
        [
            " ".join(rng.choice(surface) for _ in range(rng.randint(4, 12))) + "."
            for _ in range(rng.randint(2, 9))
        ]
        for _ in range(120)
    ]
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(doc) for doc in documents) + "\n")
    return str(corpus), str(vocab)


def digest(splits) -> str:
    h = hashlib.sha256()
    for name in ("train", "eval"):
        stored = splits[name].stored
        for key in sorted(stored):
            h.update(key.encode() + np.ascontiguousarray(stored[key]).tobytes())
    return h.hexdigest()


def test_prepared_bytes_are_those_of_the_format_version(files, tmp_path):
    d = data_config(*files)
    tokenizer = tokenization.load_tokenizer("wordpiece", d.vocab_file, True, None)
    splits = pipeline.prepare(d, Phase("short", 32, 5, 8, 0, 10), tokenizer, str(tmp_path))
    assert len(splits["train"]) > 300
    assert DIGESTS.get(pipeline.FORMAT_VERSION) == digest(splits), (
        f"the prepared bytes are not format {pipeline.FORMAT_VERSION}'s: bump "
        "pipeline.FORMAT_VERSION and pin the new digest"
    )


def test_data_of_an_older_format_is_prepared_again_and_named(files, tmp_path, monkeypatch, caplog):
    d = data_config(*files)
    tokenizer = tokenization.load_tokenizer("wordpiece", d.vocab_file, True, None)
    phase = Phase("short", 32, 5, 8, 0, 10)
    current = pipeline.FORMAT_VERSION
    monkeypatch.setattr(pipeline, "FORMAT_VERSION", current - 1)  # as an older bertjax
    pipeline.prepare(d, phase, tokenizer, str(tmp_path))
    (older,) = tmp_path.glob("short_32_*")
    monkeypatch.setattr(pipeline, "FORMAT_VERSION", current)
    with caplog.at_level("INFO"):
        pipeline.prepare(d, phase, tokenizer, str(tmp_path))
    assert len(list(tmp_path.glob("short_32_*"))) == 2  # prepared again, not reused
    assert f"{older} holds prepared data of an older format" in caplog.text
