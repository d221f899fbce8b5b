"""The command line of every entry point (bertjax/cli.py, console.configure_console): a
config typo or a missing `.py` is one line naming the nearest valid names; a missing
checkpoint is named and nothing is created; the default console holds no library INFO line
and no traceback, and `--verbosity=1` brings the libraries' log back."""

import os
import re
import subprocess
import sys

import pytest

from bertjax import cli
from bertjax.data import wordpiece
from test_faults import assert_console_in_log, command_line
from test_finetune import assert_quiet_console
from test_train import corpus_file  # noqa: F401 (fixture)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {
    **os.environ,
    "PYTHONPATH": REPO_ROOT,
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
}


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--config=configs/tiny.py", "--config.train.totl_steps=5"],
            "--config.train.totl_steps: configs/tiny.py has no field train.totl_steps; did you mean "
            "--config.train.total_steps?",
        ),
        (
            ["--config", "configs/tiny.py", "--config.trian.total_steps=5"],
            "has no field trian; did you mean --config.train.total_steps?",
        ),
        (
            ["--config=configs/tiny.py", "--config.train.zzz=5"],
            "its fields there: allow_changed_data, checkpoint_every,",
        ),
        (
            ["--config=configs/tiny.py", "--config.train.total_steps.x=5"],
            "train.total_steps is a value, not a section",
        ),
        (["--config=configs/tiny"], "no such file; did you mean --config=configs/tiny.py?"),
        (["--config=configs/tny.py"], "did you mean --config=configs/tiny.py"),
        (
            ["--config=configs/finetune/glue.py", "--config.learning_rte=1e-4"],
            "did you mean --config.learning_rate?",
        ),
        (["--config=configs/tiny.py", "--config.train.total_steps=5", "--workdir=w"], None),
    ],
)
def test_config_arguments_are_checked_before_parsing(argv, message, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    found = cli.config_argument_error(["prog", *argv])
    assert found == message if message is None else message in found, found


def run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    "module, args, message",
    [
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.train.totl_steps=5"],
            "did you mean --config.train.total_steps?",
        ),
        (
            "bertjax.train",
            ["--config=configs/tiny", "--workdir={w}"],
            "did you mean --config=configs/tiny.py?",
        ),
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.train.init_checkpoint={m}"],
            "train.init_checkpoint='{m}' does not exist",
        ),
        # Checked from the config before any data work (no SentencePiece model trained first):
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.model.num_attention_heads=3"],
            "error: model.hidden_size=128 is not divisible by model.num_attention_heads=3 (each head "
            "gets hidden_size / num_attention_heads units): set --config.model.num_attention_heads to "
            "a divisor of 128 (e.g. 2 or 4), or --config.model.hidden_size to a multiple of 3",
        ),
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.optimizer.name=adam"],
            "error: optimizer.name='adam' is not one of 'bert_adam', 'adamw', 'lamb', 'stable_adamw'; set "
            "--config.optimizer.name",
        ),
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.model.vocab_size=4000"],
            "error: data.sentencepiece_vocab_size=8000 is larger than model.vocab_size=4000",
        ),
        (
            "bertjax.finetune",
            ["--config=configs/finetune/glue.py", "--workdir={w}", "--config.learning_rte=1e-4"],
            "did you mean --config.learning_rate?",
        ),
        (
            "bertjax.finetune",
            ["--config=configs/finetune/glue", "--workdir={w}"],
            "did you mean --config=configs/finetune/glue.py?",
        ),
        (
            "bertjax.finetune",
            ["--config=configs/finetune/glue.py", "--workdir={w}", "--config.init_checkpoint={m}"],
            "init_checkpoint='{m}' does not exist",
        ),
        (
            "bertjax.extract_features",
            ["--input_file={w}/in.txt", "--output_file={w}/out.jsonl", "--init_checkpoint={m}"],
            "init_checkpoint='{m}' does not exist",
        ),
        (
            "bertjax.extract_features",
            [
                "--input_file={w}/in.txt",
                "--output_file={w}/out.jsonl",
                "--init_checkpoint={m}",
                "--layers=-1,last",
            ],
            "error: --layers='-1,last' is not a comma-separated list of integers (e.g. 1,2,3); set "
            "--layers",
        ),
        (
            "bertjax.extract_features",
            [
                "--input_file={w}/in.txt",
                "--output_file={w}/out.jsonl",
                "--init_checkpoint={m}",
                "--batch_size=0",
            ],
            "error: --batch_size=0 is out of range: it must be >= 1; set --batch_size",
        ),
        (
            "bertjax.probe",
            ["--init_checkpoint={m}", "--workdir={w}", "--task=sst2"],
            "init_checkpoint='{m}' does not exist",
        ),
        (
            "bertjax.probe",
            ["--init_checkpoint={m}", "--workdir={w}", "--seeds=1,x"],
            "error: --seeds='1,x' is not a comma-separated list of integers (e.g. 1,2,3); set --seeds",
        ),
        ("bertjax.convert", ["{m}", "{w}"], "SRC='{m}' does not exist"),
    ],
)
def test_each_mistake_is_one_line_and_creates_nothing(module, args, message, tmp_path):
    names = {"w": tmp_path / "workdir", "m": tmp_path / "missing"}
    result = run(module, *(a.format(**names) for a in args))
    assert result.returncode == 1, result.stderr[-3000:]
    assert_quiet_console(result.stdout + result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message.format(**names) in errors[0], result.stderr[-3000:]
    assert not names["w"].exists() and not names["m"].exists()


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("bertjax.train", ["--config=configs/tiny.py", "--work_dir=w"], "did you mean --workdir?"),
        (
            "bertjax.train",
            ["--config=configs/tiny.py", "--workdir={w}", "--config.train.total_steps=abc"],
            "--config.train.total_steps=abc: invalid literal for int() with base 10: 'abc' (a "
            "value of type int is due); set --config.train.total_steps",
        ),
        ("bertjax.train", ["--config=configs/tiny.py"], "--workdir is required"),
        (
            "bertjax.finetune",
            ["--config=configs/finetune/glue.py", "--workdir={w}", "--config.num_train_epochs"],
            "--config.num_train_epochs has no value: give --config.num_train_epochs=VALUE",
        ),
        ("bertjax.prepare", ["--config=configs/tiny.py", "--outptu={w}"], "did you mean --output?"),
        ("bertjax.probe", ["--init_checkpoint={m}", "--work_dir={w}"], "did you mean --workdir?"),
        (
            "bertjax.extract_features",
            ["--input_file=a", "--output_file=b", "--init_checkpoint={m}", "--max_seq_len=64"],
            "did you mean --max_seq_length?",
        ),
        ("bertjax.tools.aot", ["--config=configs/tiny.py", "--targte=v4-8"], "--target?"),
        ("bertjax.tools.bench", ["--confg=configs/tiny.py"], "did you mean --config?"),
        ("bertjax.tools.bench_data", ["--config=configs/tiny.py", "--cache=x"], "--cache_dir?"),
        ("bertjax.convert", ["{m}", "{w}", "--scna_layers"], "did you mean --scan_layers?"),
    ],
)
def test_a_flag_mistake_is_one_line_on_every_entry_point(module, args, message, tmp_path):
    """absl's (argparse's) own parse errors: one `error:` line naming the flag (the nearest
    defined one for a typo) and exit 2, not `FATAL Flags parsing error` and usage text."""
    names = {"w": tmp_path / "workdir", "m": tmp_path / "missing"}
    result = run(module, *(a.format(**names) for a in args))
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [f"error: {result.stderr[7:].strip()}"]
    assert message.format(**names) in result.stderr, result.stderr
    assert not names["w"].exists()


def test_an_empty_or_missing_tokenizer_file_is_one_line(tmp_path):
    """A 0-byte tokenizer.json (a failed download) is the run's one `error:` line, not a
    ValueError's traceback; a missing one names the path."""
    empty = tmp_path / "tokenizer.json"
    empty.write_bytes(b"")
    result = run(
        "bertjax.train",
        "--config=configs/modernbert_tiny.py",
        f"--workdir={tmp_path / 'w'}",
        f"--config.data.vocab_file={empty}",
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: tokenizer file is empty: {empty} (0 bytes: a failed download or copy?); name a "
        "complete file, or copy it again"
    ]
    with pytest.raises(FileNotFoundError, match=f"^tokenizer file not found: {tmp_path}/no.json"):
        wordpiece.read_bytes(str(tmp_path / "no.json"), "tokenizer file")


def test_verbosity_brings_the_library_log_back(tmp_path):
    result = run(
        "bertjax.train",
        "--config=configs/tiny.py",
        f"--workdir={tmp_path}/w",
        "--config.data.source=text",  # (refused once the processes have joined)
        f"--config.data.input_files={tmp_path}/missing.txt",
        "--verbosity=1",
    )
    assert result.returncode == 1
    # absl's own format, e.g. "I1123 12:36:38.721490 1401 distributed.py:77] jax.distributed..."
    assert re.search(r"^I\d{4} .* distributed\.py:\d+\] ", result.stderr, re.MULTILINE), (
        result.stderr[-3000:]
    )


def test_a_training_run_says_what_it_does(corpus_file, tmp_path):
    """Start-up in a few lines (the table in a file), checkpoints, the ETA and the
    `stop_after_steps` exit, with no library INFO line (the phase switch: test_train)."""
    workdir = tmp_path / "run"
    result = subprocess.run(
        command_line(
            corpus_file,
            str(tmp_path / "cache"),
            str(workdir),
            **{
                "train.total_steps": 4,
                "long_phase.fraction": 0.0,
                "train.stop_after_steps": 3,
                "train.checkpoint_every": 2,
                "train.log_every": 1,
            },
        ),
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert_quiet_console(output)
    assert "Prepared data for phase short (64 tokens): " in result.stderr
    assert f"full table: {workdir}/startup_report.txt" in result.stdout
    assert "Bytes per device" in (workdir / "startup_report.txt").read_text()
    assert f"checkpoint step 2 -> {workdir}/checkpoints/2" in result.stdout
    assert re.search(r"^step 3/4 \[short L=64\] .* eta \d+m\d\ds$", result.stdout, re.MULTILINE)
    assert (
        "Stopped after 3 steps (step 3 of 4); rerun the same command to continue" in result.stdout
    )
    assert f"{workdir}/config.json: resolved config" in result.stdout
    assert f"{workdir}/log.txt: the full log" in result.stdout
    assert len(result.stdout.splitlines()) <= 15, result.stdout
    assert (
        result.stdout.splitlines()[-1]
        == "Stopped after 3 steps (step 3 of 4); rerun the same command to continue"
    )
    assert "Done in" not in result.stdout and "Ran for " in result.stdout  # (not finished)
    assert_console_in_log(output, workdir / "log.txt")  # every line, those before it opened


def test_a_run_refused_while_preparing_data_leaves_no_workdir_behind(tmp_path):
    """A corpus of blank lines is refused once the tokenizer trains on it: a workdir the run
    made is gone (no lock file left); one that was there keeps what the user put in it."""
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n   \n\n")
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("mine")
    for workdir in (tmp_path / "new", existing):
        result = run(
            "bertjax.train",
            "--config=configs/tiny.py",
            f"--workdir={workdir}",
            "--config.data.source=text",
            f"--config.data.input_files={blank}",
        )
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
        assert "could not train a SentencePiece model" in errors[0], errors
    assert not (tmp_path / "new").exists()
    assert (existing / "notes.txt").read_text() == "mine"


def test_a_model_config_file_that_builds_no_model_is_one_line(tmp_path):
    """Fine-tuning's model from `model_config`: named with the file, before any data work."""
    model_config = tmp_path / "bert_config.json"
    model_config.write_text('{"hidden_size": 128, "num_attention_heads": 3}')
    result = run(
        "bertjax.finetune",
        "--config=configs/finetune/glue.py",
        f"--workdir={tmp_path / 'w'}",
        "--config.task=sst2",
        f"--config.model_config={model_config}",
    )
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert_quiet_console(result.stdout + result.stderr)
    assert errors[0] == (
        f"error: model_config {model_config}: hidden_size=128 is not divisible "
        "by num_attention_heads=3 (each head gets hidden_size / "
        "num_attention_heads units): set num_attention_heads to a divisor of "
        "128 (e.g. 2 or 4), or hidden_size to a multiple of 3"
    )
    assert not (tmp_path / "w").exists()
