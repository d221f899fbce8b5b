"""bertjax.runtime.distributed: one-process fallback and clear errors, in fresh processes."""

import os
import subprocess
import sys

import pytest

SNIPPET = "from bertjax.runtime import distributed; import jax; print(distributed.initialize(), jax.process_count())"


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", SNIPPET],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_single_process_gets_a_local_coordinator():
    result = _run({})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["local", "1"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"JAX_COORDINATOR_ADDRESS": "localhost:1234"}, "without both the number of processes"),
        (
            {
                "JAX_COORDINATOR_ADDRESS": "localhost:1234",
                "JAX_NUM_PROCESSES": "two",
                "JAX_PROCESS_ID": "0",
            },
            "JAX_NUM_PROCESSES='two' is not an integer",
        ),
    ],
)
def test_incomplete_coordinator_settings_are_named(env, message):
    result = _run(env)
    assert result.returncode != 0
    assert message in result.stderr


@pytest.mark.parametrize(
    "flags, line",
    [
        ({"join_timeout_seconds": 0}, "--join_timeout_seconds=0 is out of bounds"),
        ({"join_timeout_seconds": -5}, "--join_timeout_seconds=-5 is out of bounds"),
        ({"heartbeat_timeout_seconds": 0}, "--heartbeat_timeout_seconds=0 is out of bounds"),
        (
            {"join_timeout_seconds": 9999999999},
            "--join_timeout_seconds=9999999999 is out of bounds",
        ),
        (
            {"heartbeat_timeout_seconds": 9999999999},
            "--heartbeat_timeout_seconds=9999999999 is out of bounds",
        ),
    ],
)
def test_timeouts_out_of_bounds_are_refused_before_joining(monkeypatch, flags, line):
    """Issue 53: --join_timeout_seconds=0 silently meant 120 s, and 9999999999 (either
    timeout) reached JAX's C++ side, which takes 32-bit seconds: a 27-line TypeError on every
    host. Both are refused now, before anything joins."""
    import jax

    from bertjax.runtime import distributed

    def joined(*args, **kwargs):
        raise AssertionError(f"joined with {args} {kwargs}")

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", joined)
    with pytest.raises(distributed.DistributedSetupError) as refused:
        distributed.initialize("localhost:1", 2, 0, **flags)
    assert str(refused.value) == f"{line}: give 1 to 604800 seconds (a week)"


def test_an_out_of_bounds_timeout_is_one_line_on_the_console(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bertjax.train",
            "--config=configs/tiny.py",
            f"--workdir={tmp_path}",
            "--join_timeout_seconds=9999999999",
        ],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --join_timeout_seconds=9999999999 is out of bounds: give 1 to 604800 seconds "
        "(a week)"
    ], result.stderr
