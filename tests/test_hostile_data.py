"""Bad data: hostile corpora give counted skips or one clear DataError (never a crash or a
hang), corrupted or truncated prepared shards are named, and an interrupted preparation is
redone without duplicates."""

import json
import os
import random
import re
import shutil
import subprocess
import time

import numpy as np
import pytest

from bertjax.data import corpus_source, default_corpus, loaders, pipeline
from bertjax.data.settings import DataSettings
from test_pipeline import make_config, only_dir, phases_of

DOCS = [doc for doc in default_corpus.default_corpus() if len(doc) >= 2][:60]
NORMAL = ("\n\n".join("\n".join(doc) for doc in DOCS) + "\n").encode()
WORDS = random.Random(0).choices(["alpha", "beta", "gamma", "the", "of"], k=200_000)


def fifty_mb_line() -> bytes:
    line = " ".join(WORDS).encode()
    return line * (50_000_000 // len(line) + 1)


SENTENCES = sum(len(doc) for doc in DOCS)


# name -> (file contents, expected: counters that must be > 0 | {counter: exact value} | a
# DataError message part)
HOSTILE = {
    "binary file beside text": ([os.urandom(100_000), NORMAL], ["skipped_binary_files"]),
    "invalid UTF-8": ([NORMAL.replace(b"the ", b"the \xff\xc3(", 40)], ["invalid_utf8_lines"]),
    # NUL bytes split and drop nothing: the clean corpus's documents and sentences.
    "NUL bytes": (
        [NORMAL.replace(b" a ", b" a\x00\x00 ")],
        {"documents": len(DOCS), "sentences": SENTENCES},
    ),
    "a 50 MB single line": (
        [NORMAL, fifty_mb_line()],
        ["truncated_long_lines", "long_sentences_cut"],
    ),
    "only blank lines": ([b"\n \n\t\r\n" * 5000], "no non-blank sentences"),
    # Every sentence a document: pairs still form (A and a random B from another document).
    "one-sentence documents": (
        ["\n\n".join(s for d in DOCS for s in d).encode()],
        {"documents": SENTENCES, "sentences": SENTENCES, "eval_documents": round(SENTENCES / 10)},
    ),
    # One document: trained on, with nothing to hold out (a held-out split needs 2).
    "a single document": (
        ["\n".join(s for d in DOCS for s in d).encode()],
        {"documents": 1, "sentences": SENTENCES, "eval_documents": 0, "eval_instances": 0},
    ),
    "10,000-character words": (
        [NORMAL, b"\n".join(b"x" * 10_000 + b" end." for _ in range(20))],
        ["long_sentences_cut"],
    ),
    "mixed encodings": (
        [
            (NORMAL[:20_000].decode() + "Café, naïve.\n").encode("latin-1", "replace"),
            NORMAL[20_000:40_000].decode().encode("utf-16"),
            NORMAL[40_000:],
        ],
        ["invalid_utf8_lines", "utf16_files"],
    ),
}


def write_inputs(tmp_path, contents: list[bytes]) -> str:
    paths = [tmp_path / f"input_{i}.txt" for i in range(len(contents))]
    for path, data in zip(paths, contents):
        path.write_bytes(data)
    return ",".join(map(str, paths))


def prepare_inputs(tmp_path, input_files: str) -> list[loaders.PhaseData]:
    """What `python -m bertjax.train` runs before training: SentencePiece training on the
    corpus, preparation (cached in tmp_path/cache) and the loaders."""
    config = make_config(
        input_files,
        **{
            "long_phase.fraction": 0.0,
            "data.text_format": "auto",
            "data.dupe_factor": 1,
            "data.sentencepiece_vocab_size": 300,
            "model.vocab_size": 300,
        },
    )
    cache = str(tmp_path / "cache")
    tokenizer = corpus_source.load_or_train_tokenizer(DataSettings.of(config.data), cache)
    return loaders.prepare_data(
        DataSettings.of(config.data), phases_of(config), config.model.vocab_size, tokenizer, cache
    )


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_corpus_gives_counted_skips_or_a_clear_error(name, tmp_path):
    contents, expected = HOSTILE[name]
    start = time.time()
    if isinstance(expected, str):
        with pytest.raises(pipeline.DataError, match=expected):
            prepare_inputs(tmp_path, write_inputs(tmp_path, contents))
        outcome = "DataError"
    else:
        (phase_data,) = prepare_inputs(tmp_path, write_inputs(tmp_path, contents))
        assert len(phase_data.train.split) >= 16
        meta = json.loads((only_dir(tmp_path / "cache") / "meta.json").read_text())
        counters = {**meta["corpus"], **meta}
        if isinstance(expected, dict):
            assert {k: counters.get(k, 0) for k in expected} == expected, counters
        for counter in [] if isinstance(expected, dict) else expected:
            assert counters[counter] > 0, (counter, counters)
        outcome = {k: v for k, v in counters.items() if isinstance(v, int) and v}
    print(f"\n{name}: {time.time() - start:.1f} s: {outcome}")


@pytest.fixture(scope="module")
def prepared_once(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("prepared")
    input_files = write_inputs(tmp_path, [NORMAL])
    prepare_inputs(tmp_path, input_files)
    return tmp_path, input_files


@pytest.fixture
def prepared(prepared_once, tmp_path):
    """A private copy of the prepared cache (the cache key does not depend on its location)."""
    source, input_files = prepared_once
    shutil.copytree(source / "cache", tmp_path / "cache")
    return tmp_path, input_files, only_dir(tmp_path / "cache")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda path: path.write_bytes(path.read_bytes()[:-100]), "changed since preparation"),
        (
            lambda path: path.write_bytes(path.read_bytes()[:-1] + b"\x01"),
            "changed since preparation",
        ),
        (lambda path: path.unlink(), "missing"),
    ],
    ids=["truncated", "corrupted", "deleted"],
)
def test_corrupted_or_truncated_shard_is_named(prepared, damage, message):
    tmp_path, input_files, directory = prepared
    shard = directory / "train" / "shard_00000" / "input_ids.npy"
    damage(shard)
    with pytest.raises(pipeline.DataError, match=message) as error:
        prepare_inputs(tmp_path, input_files)
    assert str(shard) in str(error.value)


def test_interrupted_preparation_is_redone_once(prepared):
    """A crash mid-preparation leaves only a `.tmpPID` directory: the rerun removes it and
    writes the same shards once."""
    tmp_path, input_files, directory = prepared

    def shards() -> dict[str, np.ndarray]:
        return {str(p.relative_to(directory)): np.load(p) for p in directory.glob("*/*/*.npy")}

    before = shards()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that has just ended: its leftovers may go, a live one's never
    os.rename(directory, f"{directory}.tmp{dead.pid}")  # as if killed before the final rename
    prepare_inputs(tmp_path, input_files)
    assert not [name for name in os.listdir(tmp_path / "cache") if ".tmp" in name]
    after = shards()
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name])


def truncate_half(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    "damaged, damage",
    [
        ("meta.json", truncate_half),
        ("sentencepiece model", truncate_half),
        ("sentencepiece model", lambda path: path.write_bytes(b"not a model at all")),
    ],
    ids=["truncated meta.json", "truncated model", "replaced model"],
)
def test_a_damaged_cache_file_is_named_with_the_fix(prepared, damaged, damage):
    """One line naming the damaged file and what to delete, no traceback."""
    tmp_path, input_files, directory = prepared
    path = (
        directory / "meta.json"
        if damaged == "meta.json"
        else next((tmp_path / "cache").glob("sentencepiece_*.model"))
    )
    damage(path)
    fix = (
        f"delete {directory} to prepare the data again"
        if damaged == "meta.json"
        else f"delete it and {str(path)[: -len('.model')]}.vocab to train it again"
    )
    with pytest.raises(pipeline.DataError) as error:
        prepare_inputs(tmp_path, input_files)
    assert str(path) in str(error.value) and str(error.value).endswith(fix), error.value


def test_meta_json_row_total_is_checked(prepared):
    """Shards that verify but hold fewer rows than meta.json counts (a shard lost with its
    record) are refused, naming the directory and both totals."""
    tmp_path, input_files, directory = prepared
    meta = json.loads((directory / "meta.json").read_text())
    rows = meta["train_instances"]
    (directory / "meta.json").write_text(json.dumps({**meta, "train_instances": rows + 7}))
    with pytest.raises(
        pipeline.DataError,
        match=re.escape(
            f"prepared data {directory} holds {rows} train rows, its meta.json says {rows + 7}; "
            f"delete {directory} to prepare it again"
        ),
    ):
        prepare_inputs(tmp_path, input_files)
