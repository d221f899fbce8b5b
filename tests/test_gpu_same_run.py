"""benchmarks/gpu/same_run.py, the prepared GPU comparison, end to end on the CPU with
configs/tiny.py: the resume check (slow), the transformers half (`parity`: torch)."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "benchmarks", "gpu", "same_run.py"
)
_spec = importlib.util.spec_from_file_location("same_run", SCRIPT)
assert _spec and _spec.loader
same_run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(same_run)


def test_missing_wheels_are_one_error_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(same_run, "NEEDED", ("jax", "no_such_module_51"))
    assert same_run.main(["--dry_run", f"--out={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no_such_module_51 not importable") and err.count("\n") == 1


@pytest.mark.slow
def test_resume_check_is_bit_exact_and_sees_a_difference(tmp_path, monkeypatch):
    args = ["--dry_run", "--skip_compare", "--resume_steps=2", "--resume_batch=8"]
    assert same_run.main([*args, f"--out={tmp_path}"]) == 0
    record = json.loads((tmp_path / "resume_check.json").read_text())
    assert record["bit_exact"] and record["leaves"] > 10 and record["steps"] == [2, 2]
    # a resume that loses the state's step (so the dropout keys) must not pass
    import jax

    real_device_get = jax.device_get
    calls = []

    def device_get_losing_step(tree):
        calls.append(1)
        out = real_device_get(tree)
        return out.replace(step=out.step * 0) if len(calls) == 1 else out

    monkeypatch.setattr(jax, "device_get", device_get_losing_step)
    assert same_run.main([*args, f"--out={tmp_path}"]) == 3
    assert not json.loads((tmp_path / "resume_check.json").read_text())["bit_exact"]


@pytest.mark.slow
@pytest.mark.parity
def test_dry_run_times_bertjax_beside_transformers(tmp_path):
    pytest.importorskip("torch")  # (the `slow` stage runs without the parity extra)
    pytest.importorskip("transformers")
    args = ["--dry_run", "--steps=1", "--rounds=1", "--resume_steps=1", "--resume_batch=8"]
    assert same_run.main([*args, f"--out={tmp_path}"]) == 0
    record = json.loads((tmp_path / "same_run_L32_B8.json").read_text())
    assert record["speedup_vs_hf_eager"] > 0
    assert record["hf_eager"]["torch"] and record["bertjax"]
