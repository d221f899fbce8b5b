"""Tests for the offline preparation job (bertjax.prepare), reading its output with
data.prepared_dir (whole, and as P processes' shares), the held-out split by instances, and
the missing `__main__` guard of a script that prepares with worker processes."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from bertjax import prepare
from bertjax.data import pipeline, tokenization
from bertjax.data.settings import DataSettings
from test_pipeline import (  # noqa: F401
    REPO_ROOT,
    make_config,
    phases_of,
    short_phase,
    unmasked_ids,
    wordpiece_corpus,
    wordpiece_vocab,
    write_documents,
)


def wordpiece_config(corpus: str, vocab: str, **overrides):
    return make_config(
        corpus, **{"data.tokenizer": "wordpiece", "data.vocab_file": vocab, **overrides}
    )


def test_training_reads_the_prepared_job_and_refuses_other_settings(
    wordpiece_corpus, wordpiece_vocab, tmp_path
):
    config = wordpiece_config(wordpiece_corpus, wordpiece_vocab)
    output = str(tmp_path / "prepared")
    lines = prepare.prepare_all(config, output)
    assert len(lines) == len(phases_of(config)) == 2
    assert lines[0].startswith("Prepared phase short (64 tokens): ") and output in lines[0]
    # Both phases read one tokenization of the corpus, removed when they were prepared.
    assert not list(pathlib.Path(output).glob("tokens_*"))
    tokenizer = tokenization.WordPieceTokenizer(wordpiece_vocab)
    cached = pipeline.prepare(
        DataSettings.of(config.data), short_phase(config), tokenizer, str(tmp_path / "cache")
    )
    config.data.prepared_dir = output
    read = pipeline.prepare(DataSettings.of(config.data), short_phase(config), tokenizer, "")
    for split in ("train", "eval"):
        for name, array in cached[split].features.items():
            np.testing.assert_array_equal(read[split].features[name], array)

    assert prepare.prepare_all(config_without_dir(config), output)[0].startswith(
        "Already prepared (kept) phase short"
    )
    config.data.dupe_factor = 3
    with pytest.raises(
        pipeline.DataError,
        match=r"made with other settings \(data.dupe_factor: "
        r"2 there, 3 here\); prepare it again",
    ):
        pipeline.prepare(DataSettings.of(config.data), short_phase(config), tokenizer, "")
    with pytest.raises(pipeline.DataError, match=r"data\.dupe_factor: 2 there, 3 here"):
        prepare.prepare_all(config_without_dir(config), output)


def config_without_dir(config):
    config = config.copy_and_resolve_references()
    config.data.prepared_dir = ""
    return config


def test_a_two_document_corpus_holds_out_instances(wordpiece_corpus, wordpiece_vocab, tmp_path):
    """One of two documents would be half the tokens: a tenth of the instances is held out
    instead, the same instances a run without held-out data makes, none lost or repeated."""
    blocks = pathlib.Path(wordpiece_corpus).read_text().strip().split("\n\n")
    sentences = [s for block in blocks for s in block.split("\n")]
    two = write_documents(tmp_path / "two.txt", [sentences[:300], sentences[300:]])
    tokenizer = tokenization.WordPieceTokenizer(wordpiece_vocab)
    splits = {}
    for fraction in (0.1, 0.0):
        config = wordpiece_config(two, wordpiece_vocab, **{"data.eval_fraction": fraction})
        splits[fraction] = pipeline.prepare(
            DataSettings.of(config.data),
            short_phase(config),
            tokenizer,
            str(tmp_path / str(fraction)),
        )
    meta = json.loads(next((tmp_path / "0.1").glob("short_*/meta.json")).read_text())
    assert meta["eval_instance_route_shards"] == 1 and "eval_documents" not in meta
    assert pipeline.held_out_route(meta).startswith("held out by instances in 1 of 1 shards")
    held, total = len(splits[0.1]["eval"]), len(splits[0.0]["train"])
    assert abs(held - 0.1 * total) < 0.03 * total

    def rows(*split_list):
        return sorted(
            map(bytes, np.concatenate([unmasked_ids(split.features) for split in split_list]))
        )

    assert rows(splits[0.1]["train"], splits[0.1]["eval"]) == rows(splits[0.0]["train"])


def test_a_script_without_the_main_guard_gets_an_error_not_a_hang(
    wordpiece_corpus, wordpiece_vocab, tmp_path
):
    """With a vocabulary of real size (a tokenizer larger than a pipe's buffer, which hung the
    parent when it went to the workers' start)."""
    vocab = tmp_path / "vocab.txt"
    vocab.write_text(
        pathlib.Path(wordpiece_vocab).read_text() + "".join(f"[unused{i}]\n" for i in range(30_000))
    )
    script = tmp_path / "user_script.py"
    script.write_text(
        textwrap.dedent(f"""
        import runpy
        from bertjax.data import pipeline, tokenization
        from bertjax.data.settings import DataSettings
        from bertjax.training.phase_schedule import Phase
        config = runpy.run_path({str(REPO_ROOT / "configs" / "base.py")!r})["get_config"]()
        config.data.source, config.data.input_files = "text", {wordpiece_corpus!r}
        config.data.num_workers, config.data.shard_bytes = 2, 4096
        tokenizer = tokenization.WordPieceTokenizer({str(vocab)!r})
        pipeline.prepare(DataSettings.of(config.data), Phase("short", 64, 10, 8, 0, 10), tokenizer,
                         {str(tmp_path / "cache")!r})
        """)
    )
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        check=False,
    )
    assert result.returncode != 0
    assert 'put the code that starts it under `if __name__ == "__main__":`' in result.stderr
    assert "a data preparation worker process died" in result.stderr.splitlines()[-1]


def test_a_new_build_names_the_older_format_beside_it(
    wordpiece_corpus, wordpiece_vocab, tmp_path, caplog
):
    """...and neither reads nor names another process's unfinished build beside it."""
    old = tmp_path / "short_64_0123456789abcdef"
    old.mkdir()
    (old / "meta.json").write_text(json.dumps({"train_instances": 5, "files": {}}))
    unfinished = tmp_path / "short_64_fedcba9876543210.tmp4242"  # another process, writing
    unfinished.mkdir()
    (unfinished / "meta.json").write_text('{"train_instances": 5, "fi')
    config = wordpiece_config(wordpiece_corpus, wordpiece_vocab)
    tokenizer = tokenization.WordPieceTokenizer(wordpiece_vocab)
    with caplog.at_level("INFO"):
        pipeline.prepare(
            DataSettings.of(config.data), short_phase(config), tokenizer, str(tmp_path)
        )
        pipeline.prepare(
            DataSettings.of(config.data), short_phase(config), tokenizer, str(tmp_path)
        )
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "older format" in line] == [
        f"{old} holds prepared data of an older format (prepared again above); delete it to "
        "free its space"
    ]
    assert [line.split(" for phase")[0] for line in lines if " for phase short" in line] == [
        "Prepared data",
        "Reusing prepared data",
    ]


def test_the_command_refuses_to_read_and_write_in_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.prepare",
            "--config=configs/base.py",
            f"--output={tmp_path / 'out'}",
            "--config.data.prepared_dir=elsewhere",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: data.prepared_dir is set: this job writes prepared data, it does not read it; "
        "unset --config.data.prepared_dir"
    )
    assert not (tmp_path / "out").exists()


def test_the_command_prepares_without_importing_orbax(wordpiece_corpus, wordpiece_vocab, tmp_path):
    """Start-up: `python -m bertjax.prepare` imports neither Orbax nor gcsfs (checkpoints'
    libraries, about 1.2 s of CPU on the 2-core machine)."""
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "bertjax.prepare",
            "--config=configs/base.py",
            f"--output={tmp_path / 'out'}",
            "--config.data.source=text",
            f"--config.data.input_files={wordpiece_corpus}",
            "--config.data.text_format=lines",
            f"--config.data.vocab_file={wordpiece_vocab}",
            "--config.data.dupe_factor=1",
            "--config.data.num_workers=1",
            "--config.long_phase.fraction=0",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Prepared phase short (128 tokens)" in result.stdout
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "bertjax.data.shard_job" in imported
    assert not {m for m in imported if m.split(".")[0] in ("orbax", "gcsfs")}
