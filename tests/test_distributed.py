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
