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
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --join_timeout_seconds=9999999999 is out of bounds: give 1 to 604800 seconds "
        "(a week)"
    ], result.stderr


GLOO_FAILED = (
    "Unable to initialize backend 'cpu': [enforce fail at external/gloo/gloo/transport/tcp/"
    "device.cc:99] rv == 0. -2 vs 0 (set JAX_PLATFORMS='' to automatically choose an "
    "available backend)"
)


def test_devices_that_cannot_start_say_why_and_name_an_unresolvable_host():
    from bertjax.runtime import distributed

    missing, line = distributed.devices_failure(GLOO_FAILED, "no-such-host-53.invalid")
    assert not missing
    assert line == (
        "JAX could not start this host's devices (Unable to initialize backend 'cpu': "
        "[enforce fail at external/gloo/gloo/transport/tcp/device.cc:99] rv == 0. -2 vs 0); "
        "this host's name 'no-such-host-53.invalid' does not resolve to an address (JAX's "
        "collectives bind to it): add it to /etc/hosts or the DNS, then rerun the same "
        "command on every host"
    )
    missing, line = distributed.devices_failure("INTERNAL: no devices", "localhost")
    assert not missing and line == (
        "JAX could not start this host's devices (INTERNAL: no devices); fix that, then "
        "rerun the same command on every host"
    )


def test_devices_of_other_processes_that_never_came_are_named():
    from bertjax.runtime import distributed

    error = (
        "Unable to initialize backend 'cpu': INTERNAL: Getting local topologies failed: "
        "Error 1: GetKeyValue() timed out with key: cpu:local_topology/cpu/3 and duration: 2m"
        "\nError 2: GetKeyValue() timed out with key: cpu:local_topology/cpu/1 and duration: 2m"
    )
    missing, line = distributed.devices_failure(error, "localhost")
    assert missing
    assert line.startswith("processes 1, 3 of ") and "joined the job but their devices" in line
    assert line.endswith("(status 75): rerun the same command on every host")
