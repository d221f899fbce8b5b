"""`python -m bertjax.tools.bench` end to end: a tiny config, a few steps, the HF comparison."""

import importlib.util
import json
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest

from bertjax.models import flops
from bertjax.models.bert.model import BertConfig

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--config=configs/tiny.py",
    "--config.model.vocab_size=512",
    "--config.model.hidden_size=32",
    "--config.model.intermediate_size=64",
    "--config.train.global_batch_size=8",
    "--config.data.max_seq_length=32",
    "--config.data.max_predictions_per_seq=5",
]


def _smallest_config():
    """configs/tiny.py at one layer of 16, 8 rows of 16 tokens: what `bench.run` takes."""
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", "tiny.py"))["get_config"]()
    config.model.update(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    config.train.global_batch_size = 8
    config.data.update(max_seq_length=16, max_predictions_per_seq=2)
    return config


def run_bench(*args: str) -> subprocess.CompletedProcess:
    # Two fake CPU devices: per-chip rates are checked without an 8-device compile.
    env = dict(
        os.environ, PYTHONPATH=REPO_ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=2"
    )
    return subprocess.run(
        [sys.executable, "-m", "bertjax.tools.bench", *TINY, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_bench_with_hf_comparison(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    result = run_bench(
        "--steps=1", "--rounds=2", "--compare=hf", "--peak_tflops=0.5", f"--out={out}"
    )
    assert result.returncode == 0, result.stderr
    record = json.loads(out.read_text())
    config = BertConfig(
        vocab_size=512,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    assert record["model_flops_per_step"] == 8 * flops.train_flops_per_sequence(config, 32, 5)
    assert record["machine"]["devices"] == 2 and record["config"]["batch"] == 8
    bertjax, hf = record["bertjax"], record["hf_eager"]
    assert "hf_compile" not in record  # torch.compile is compared on a GPU only
    assert hf["device"] == "cpu" and hf["attention"] == "sdpa" and hf["autocast"] == "None"
    assert len(bertjax["step_times_s"]) == len(hf["step_times_s"]) == 2
    assert bertjax["tokens_per_second"] == pytest.approx(8 * 32 / (bertjax["step_ms"] / 1e3))
    assert bertjax["tokens_per_second_per_chip"] == pytest.approx(bertjax["tokens_per_second"] / 2)
    assert record["speedup_vs_hf_eager"] == pytest.approx(hf["step_ms"] / bertjax["step_ms"])
    # bertjax ran on 2 (fake) devices, the reference on one.
    assert hf["mfu"] == pytest.approx(2 * record["mfu"] / record["speedup_vs_hf_eager"])
    assert record["mfu"] == pytest.approx(record["model_tflops_per_second"] / (2 * 0.5))
    assert "bertjax / hf_eager throughput" in result.stdout and "MFU" in result.stdout
    assert record["command"].endswith(f"--out={out}")


def test_bench_without_torch_or_transformers_says_how_to_install_them_and_still_measures(
    monkeypatch,
):
    """--compare=hf where torch and transformers are missing (a fresh `.[test]` environment;
    both are hidden here, whatever this environment has): one line with the install command,
    the rest of the record (bertjax's own timings) as usual."""
    from bertjax.tools import bench

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("torch", "transformers") else find_spec(name, *a),
    )
    config = _smallest_config()
    lines = []
    record = bench.run(config, 1, 1, "hf", 0.5, log=lines.append)
    missing = "torch and transformers not installed (pip install -e '.[parity]')"
    assert record["compare_skipped"] == missing
    assert f"no Hugging Face comparison: {missing}" in lines
    assert "hf_eager" not in record and len(record["bertjax"]["step_times_s"]) == 1


def test_synthetic_packed_batch_has_the_layout_of_packed_rows():
    """`--packed=3 --padding=0.25`: three instances per row, each with its own positions and
    [CLS] slot, the last quarter of the row padding; real tokens are counted without it."""
    from bertjax.tools.bench_report import throughput
    from bertjax.tools.bench_step import synthetic_batch

    batch = synthetic_batch(2, 16, 3, 50, padding=0.25, packed=3)
    np.testing.assert_array_equal(batch["instance_ids"][0], [1] * 4 + [2] * 4 + [3] * 4 + [0] * 4)
    np.testing.assert_array_equal(batch["position_ids"][1], [0, 1, 2, 3] * 3 + [0] * 4)
    np.testing.assert_array_equal(batch["next_sentence_positions"], [[0, 4, 8]] * 2)
    assert batch["masked_lm_ids"].shape == (2, 5)  # packing.predictions_per_row(16, 3, .15, 3)
    assert (np.take_along_axis(batch["instance_ids"], batch["masked_lm_positions"], 1) > 0).all()
    assert set(batch["masked_lm_positions"].ravel()).isdisjoint({0, 4, 8})
    assert (batch["input_ids"][:, 12:] == 0).all() and (batch["input_mask"][:, 12:] == 0).all()
    assert throughput(2.0, 2, 16, 1, padding=0.25)["real_tokens_per_second"] == 12.0
    unpacked = synthetic_batch(2, 16, 3, 50)
    assert "instance_ids" not in unpacked and unpacked["input_mask"].all()
    short = synthetic_batch(2, 16, 10, 50, padding=0.5)  # 8 real tokens: 7 can be masked
    np.testing.assert_array_equal(short["masked_lm_weights"].sum(axis=1), [7, 7])
    assert (short["masked_lm_positions"][:, :7] > 0).all() and short[
        "masked_lm_positions"
    ].max() < 8
    with pytest.raises(ValueError, match="too few"):
        synthetic_batch(2, 16, 3, 50, padding=0.9, packed=3)


def test_bench_times_the_step_on_xlas_dense_ops_in_alternating_rounds():
    """--compare=xla_dense: a second trainer of the same config with model.dense_impl=xla,
    timed in the same rounds, its rates and bertjax's speedup over it in the record and a
    line. (On the CPU both run XLA's ops: "auto" picks the Triton kernels on a GPU only.)"""
    from bertjax.tools import bench

    config = _smallest_config()
    lines = []
    record = bench.run(config, 2, 2, "xla_dense", 0.5, log=lines.append)
    dense = record["xla_dense"]
    assert len(dense["step_times_s"]) == len(record["bertjax"]["step_times_s"]) == 4
    assert record["speedup_vs_xla_dense"] == pytest.approx(
        np.median(dense["step_times_s"]) / np.median(record["bertjax"]["step_times_s"])
    )
    assert config.model.dense_impl == "auto"  # the reference's copy, not the config, changed
    assert any(line.startswith("xla_dense (model.dense_impl=xla): step ") for line in lines)
