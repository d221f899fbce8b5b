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

A lost peer (a host that died, was preempted or killed) is reported by the coordination
service after the heartbeat timeout; every other process then prints one line naming the
process and its own last step, and exits at once (`LOST_PEER_STATUS`), instead of JAX's
C++ abort with its stack dump.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from typing import Any, Iterator, NoReturn

import jax
from absl import logging


LOCAL_HEARTBEAT_TIMEOUT_SECONDS = 7 * 24 * 3600
JAX_HEARTBEAT_TIMEOUT_SECONDS = 100  # jax.distributed.initialize's default
LOST_PEER_STATUS = 75  # EX_TEMPFAIL: rerun
_progress = {"step": None, "heartbeat_s": JAX_HEARTBEAT_TIMEOUT_SECONDS}
_FAILED = "bertjax/failed/"
RERUN_ALL = "rerun the same command on every host"


class DistributedSetupError(ValueError):
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
        raise DistributedSetupError(f"environment variable {name}={value!r} is not an integer") from None


def initialize(coordinator_address: str | None = None,
               num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_seconds: int | None = None) -> str:
    """Initialises `jax.distributed` once; returns how: "explicit", "cluster", "local" or "already"."""
    if jax.distributed.is_initialized():
        return "already"
    extra = {}
    if heartbeat_timeout_seconds:
        extra["heartbeat_timeout_seconds"] = heartbeat_timeout_seconds
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None:
        num_processes = _env_int("JAX_NUM_PROCESSES")
    if process_id is None:
        process_id = _env_int("JAX_PROCESS_ID")
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise DistributedSetupError(f"coordinator {coordinator_address} given without both the number of "
                             "processes and this process's id (--num_processes/--process_id or "
                             "JAX_NUM_PROCESSES/JAX_PROCESS_ID)")
    _progress["heartbeat_s"] = heartbeat_timeout_seconds or JAX_HEARTBEAT_TIMEOUT_SECONDS
    with _reporting_lost_peers():
        if coordinator_address:
            jax.distributed.initialize(coordinator_address, num_processes, process_id, **extra)
            how = "explicit"
        else:
            try:
                jax.distributed.initialize(**extra)  # TPU VMs and other detected clusters
                how = "cluster"
            except ValueError:  # no cluster detected: this process is the whole job
                extra.setdefault("heartbeat_timeout_seconds", LOCAL_HEARTBEAT_TIMEOUT_SECONDS)
                jax.distributed.initialize(f"localhost:{free_port()}", 1, 0, **extra)
                how = "local"
    log = logging.info if jax.process_count() > 1 else logging.debug  # one process: nothing new
    log("jax.distributed (%s): process %d of %d, %d local / %d global devices", how,
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count())
    return how


def reached_step(step: int) -> None:
    """Records that this process has finished training step `step` (for the lost-peer line)."""
    _progress["step"] = step


def lost_peer_line(status: str) -> str:
    """The line for the coordination service's error `status`: which process was lost, this
    process's last step, and what to do."""
    listed = re.search(r"stopped sending heartbeats\):\s*([\d\s,]+)", status)
    ids = re.findall(r"\d+", listed.group(1)) if listed else re.findall(r"task:(\d+)", status)
    ids = [i for i in dict.fromkeys(ids) if int(i) != jax.process_index()]
    if ids:
        who = f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)}"
    elif jax.process_index() != 0:
        who = "process 0 (the coordinator)"
    else:
        who = "another process"
    step = _progress["step"]
    when = f"after step {step}" if step is not None else "before the first training step"
    return (f"lost {who} of {jax.process_count()} (no heartbeat for "
            f"{_progress['heartbeat_s']} s); this process {jax.process_index()} stopped {when}; "
            f"{RERUN_ALL} to resume from the last checkpoint")


def _on_lost_peer(status: Any) -> NoReturn:
    """JAX's missed-heartbeat callback (on one of its threads): one line, then exit at once
    (a normal exit would wait for the lost process at JAX's shutdown barrier)."""
    print(f"error: {lost_peer_line(str(status))}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_PEER_STATUS)


@contextlib.contextmanager
def _reporting_lost_peers() -> Iterator[None]:
    """While JAX creates its coordination client, gives it `_on_lost_peer` as the callback
    that JAX's initialize does not expose (its default aborts the process)."""
    from jax._src import distributed as jax_distributed  # (private: no public hook)
    native = jax_distributed._jax
    original = native.get_distributed_runtime_client

    def client(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("missed_heartbeat_callback", _on_lost_peer)
        return original(*args, **kwargs)

    native.get_distributed_runtime_client = client
    try:
        yield
    finally:
        native.get_distributed_runtime_client = original


def leave_if_peer_lost(error: BaseException) -> None:
    """For an error raised by a collective in a multi-process run (a peer's connection
    closed): waits for the heartbeat callback to name the lost process (it exits), and exits
    with a line of its own if none comes; returns for any other error."""
    if jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return
    logging.info("a collective failed: %s", error)
    deadline = time.time() + _progress["heartbeat_s"] + 10
    while time.time() < deadline:
        failed = announced_failure()
        if failed:
            print(f"error: {failed}; {RERUN_ALL}", file=sys.stderr, flush=True)
            os._exit(1)
        time.sleep(1)
    _on_lost_peer(f"a collective failed: {str(error).splitlines()[0][:200]}")


def client() -> Any:
    """JAX's coordination client (its key-value store is not public API)."""
    from jax._src import distributed as jax_distributed
    return jax_distributed.global_state.client


def announce_failure(message: str) -> None:
    """Tells the other processes that this one stops with `message` (best effort: the
    coordinator may be gone)."""
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    try:
        client().key_value_set(f"{_FAILED}{jax.process_index()}", message, allow_overwrite=True)
    except Exception:  # noqa: BLE001 (the coordinator itself lost: nothing to tell)
        pass


def announced_failure() -> str | None:
    """`process N stopped: MESSAGE` for the first process that announced a failure, if any."""
    failed = client().key_value_dir_get(_FAILED)
    if not failed:
        return None
    key, message = sorted(failed)[0]
    return f"process {key.rsplit('/', 1)[-1]} stopped: {message}"
