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
"""
from __future__ import annotations

import os
import socket

import jax
from absl import logging

from bertjax.errors import UserError


LOCAL_HEARTBEAT_TIMEOUT_SECONDS = 7 * 24 * 3600


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
