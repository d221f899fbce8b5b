"""Starts JAX's multi-controller runtime (`jax.distributed`) exactly once per process.

Every bertjax run initialises it, even a single process: JAX's preemption sync point
(`multihost_utils.reached_preemption_sync_point`), which Orbax uses to save on SIGTERM, only
works once the runtime is up. Where the coordinator comes from, in order:

1. explicit arguments (the `--coordinator_address`, `--num_processes`, `--process_id` flags);
2. the environment variables `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`;
3. JAX's cluster auto-detection (TPU VMs, GKE, SLURM, ...), with no arguments;
4. otherwise a one-process job with a coordinator on a free localhost port. Its heartbeat
   timeout defaults to a week: there is no other process whose death it could detect, and JAX's
   default (100 s) would abort a run that was merely paused (SIGSTOP, a suspended VM) on resume.

Joining waits at most `join_timeout_seconds` (default `peers.JOIN_TIMEOUT_SECONDS`; both
timeouts are bounded, 1 s to `MAX_TIMEOUT_SECONDS`: `check_timeout`) for every process to
register: then each process that did ends with one line naming the ones
that did not and the coordinator's address (`peers.joining`), exit `peers.LOST_PEER_STATUS`.
Once joined, a process follows the others' failures (`peers.follow_failures`) while JAX's
backend starts, which waits for every process's devices: a process whose devices cannot
start (its host name does not resolve, say) says why in one line, and so do the others
(`start_devices`).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator
from typing import Any

import jax
from absl import logging

from bertjax.errors import UserError
from bertjax.runtime import console, peers

LOCAL_HEARTBEAT_TIMEOUT_SECONDS = 7 * 24 * 3600
# The longest --join_timeout_seconds and --heartbeat_timeout_seconds: a week (JAX's C++ side
# takes 32-bit seconds, and a longer wait for a peer is a hang).
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600


class DistributedSetupError(UserError, ValueError):
    """The coordinator settings are incomplete or malformed."""


def free_port() -> int:
    """A TCP port on localhost that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(
            f"environment variable {name}={value!r} is not an integer"
        ) from None


# A process waits this much longer than the service for the others to register, so that the
# service's answer (naming the missing processes) comes first.
_CLIENT_SLACK_S = 20


@contextlib.contextmanager
def _registration_timeout(seconds: int) -> Iterator[None]:
    """JAX's coordination service started by `jax.distributed.initialize` in the block gives
    up on processes that have not registered after `seconds` and names them to those that did
    (jax.distributed passes no such setting: its service would wait for as long as the
    clients' initialization timeout, and they would abort without the names)."""
    from jax._src import distributed as jax_distributed  # (not public API)

    library = jax_distributed._jax

    class WithRegistrationTimeout:
        def __getattr__(self, name: str) -> Any:
            return getattr(library, name)

        @staticmethod
        def get_distributed_runtime_service(*args: Any, **kwargs: Any) -> Any:
            return library.get_distributed_runtime_service(
                *args, cluster_register_timeout=seconds, **kwargs
            )

    jax_distributed._jax = WithRegistrationTimeout()
    try:
        yield
    finally:
        jax_distributed._jax = library


def start_devices() -> None:
    """Starts JAX's backend (which waits for every process's devices). Where this host's
    cannot start: DistributedSetupError saying why (the others read it: `peers`). Where
    another process's never came (it stopped without a word): one line naming it, exit
    `peers.LOST_PEER_STATUS`."""
    try:
        jax.devices()
    except RuntimeError as e:
        missing, line = devices_failure(str(e), socket.gethostname())
        if missing:
            peers.leave(line, peers.LOST_PEER_STATUS)
        raise DistributedSetupError(line) from None


def devices_failure(error: str, hostname: str) -> tuple[bool, str]:
    """For JAX's error `error` while starting its backend on the host `hostname`: whether it
    waited in vain for other processes' devices, and the line that says what to do."""
    count, index = console.process_count(), console.process_index()
    waited_for = sorted(set(re.findall(r"local_topology/\w+/(\d+)", error)), key=int)
    if waited_for and "timed out" in error:
        plural = len(waited_for) > 1
        return True, (
            f"process{'es' if plural else ''} {', '.join(waited_for)} of {count} joined the "
            f"job but {'their' if plural else 'its'} devices never came (JAX's backend waits "
            "for every process's): stopped or stuck while starting them, see "
            f"{'their consoles' if plural else 'its console'}; this process {index} stops "
            f"(status {peers.LOST_PEER_STATUS}): {peers.RERUN_ALL}"
        )
    cause = error.strip().splitlines()[0] if error.strip() else "no reason given"
    cause = re.sub(r"\s*\(set JAX_PLATFORMS=.*\)$", "", cause)
    try:
        socket.getaddrinfo(hostname, None)
        hint = "; fix that, then " + peers.RERUN_ALL
    except OSError:
        hint = (
            f"; this host's name {hostname!r} does not resolve to an address (JAX's "
            "collectives bind to it): add it to /etc/hosts or the DNS, then " + peers.RERUN_ALL
        )
    return False, f"JAX could not start this host's devices ({cause}){hint}"


def check_timeout(flag: str, seconds: int) -> None:
    """Refuses `--flag=seconds` outside 1 s to `MAX_TIMEOUT_SECONDS` in one line. (0 cannot
    mean "do not wait": every process must register, and the service would give up on the
    others before they could.)"""
    if not 1 <= seconds <= MAX_TIMEOUT_SECONDS:
        raise DistributedSetupError(
            f"--{flag}={seconds} is out of bounds: give 1 to {MAX_TIMEOUT_SECONDS} seconds (a week)"
        )


def _join(join_timeout_seconds: int, **kwargs: Any) -> None:
    """`jax.distributed.initialize(**kwargs)`, waiting at most `join_timeout_seconds` for
    every process (see the module's note)."""
    with peers.joining(join_timeout_seconds), _registration_timeout(join_timeout_seconds):
        jax.distributed.initialize(
            initialization_timeout=join_timeout_seconds + _CLIENT_SLACK_S, **kwargs
        )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_seconds: int | None = None,
    join_timeout_seconds: int | None = None,
) -> str:
    """Initialises `jax.distributed` once; returns how: "explicit", "cluster", "local" or "already"."""
    join = peers.JOIN_TIMEOUT_SECONDS if join_timeout_seconds is None else join_timeout_seconds
    check_timeout("join_timeout_seconds", join)
    if heartbeat_timeout_seconds is not None:
        check_timeout("heartbeat_timeout_seconds", heartbeat_timeout_seconds)
    if jax.distributed.is_initialized():
        return "already"
    extra: dict[str, Any] = {}  # (initialize's keywords)
    if heartbeat_timeout_seconds is not None:
        extra["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise DistributedSetupError(
                f"coordinator {coordinator_address} given without both the number of "
                "processes and this process's id (--num_processes/--process_id or "
                "JAX_NUM_PROCESSES/JAX_PROCESS_ID)"
            )
        _join(
            join,
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            **extra,
        )
        how = "explicit"
    else:
        try:
            _join(join, **extra)  # TPU VMs and other detected clusters
            how = "cluster"
        except ValueError:  # no cluster detected: this process is the whole job
            extra.setdefault("heartbeat_timeout_seconds", LOCAL_HEARTBEAT_TIMEOUT_SECONDS)
            jax.distributed.initialize(f"localhost:{free_port()}", 1, 0, **extra)
            how = "local"
    peers.follow_failures()
    start_devices()
    log = logging.info if jax.process_count() > 1 else logging.debug  # one process: nothing new
    log(
        "jax.distributed (%s): process %d of %d, %d local / %d global devices",
        how,
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return how
