"""The processes of a multi-process run stop together: a lost peer (a host that died, was
preempted or killed with -9) becomes one line on every other host's console, naming the lost
process and this process's last step, and saying to rerun the same command on every host.

JAX's coordination service notices a lost process after the heartbeat timeout (or at once
when the lost process is process 0, which hosts it) and aborts every other process from a
C++ thread, with a stack dump and Python's thread dump; its Python callback for this cannot
be used (jaxlib cannot pass it the status). So in a multi-process run, `watch` sends what
native code writes to stderr (fd 2) to the process's log file, keeps Python's `sys.stderr`
on the console, and handles SIGABRT: the handler reads the abort's reason from the log, prints
the line and exits with `LOST_PEER_STATUS`. A process that stops with its own error first
announces it (`announce_failure`) so that the others, waiting for it, stop too.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import tempfile
import time
from typing import Any, NoReturn

import jax
from absl import logging

from bertjax import failures

JAX_HEARTBEAT_TIMEOUT_SECONDS = 100  # jax.distributed.initialize's default
LOST_PEER_STATUS = 75  # EX_TEMPFAIL: run again
RERUN_ALL = "rerun the same command on every host"
_FAILED = "bertjax/failed/"
_JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"
_state: dict[str, Any] = {"step": None, "heartbeat_s": JAX_HEARTBEAT_TIMEOUT_SECONDS,
                          "log": None, "console": None, "handler": None}


def reached_step(step: int) -> None:
    """Records that this process has finished training step `step` (for the lost-peer line)."""
    _state["step"] = step


def lost_peer_line(reason: str) -> str:
    """The line for JAX's abort `reason` (the coordination service's status): which process
    was lost, this process's last step, and what to do."""
    listed = re.search(r"stopped sending heartbeats\):\s*([\d\s,]+)", reason)
    ids = re.findall(r"\d+", listed.group(1)) if listed else re.findall(r"task:(\d+)", reason)
    ids = [i for i in dict.fromkeys(ids) if int(i) != jax.process_index()]
    if ids:
        who = (f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)} of "
               f"{jax.process_count()} (no heartbeat for {_state['heartbeat_s']} s)")
    elif jax.process_index() != 0:
        who = f"process 0 of {jax.process_count()} (the coordinator)"
    else:
        who = f"another process of {jax.process_count()}"
    step = _state["step"]
    when = f"after step {step}" if step is not None else "before the first training step"
    return (f"lost {who}; this process {jax.process_index()} stopped {when}; {RERUN_ALL} to resume from the "
            "last checkpoint")


def _abort_reason(log_path: str) -> str | None:
    """The coordination service's status in JAX's abort message at the end of `log_path`."""
    with open(log_path, "rb") as f:
        f.seek(max(0, os.path.getsize(log_path) - (64 << 10)))
        tail = f.read().decode("utf-8", "replace")
    at = tail.rfind(_JAX_ABORT)
    return tail[at:].split("*** Check failure stack trace", 1)[0] if at >= 0 else None


def _on_abort(signum: int) -> None:
    """SIGABRT (on the aborting thread): one line on the console, then exit at once."""
    del signum
    reason = None
    try:
        sys.stdout.flush()
        reason = _abort_reason(_state["log"])
        line = (lost_peer_line(reason) if reason is not None else
                f"aborted in native code (the details: {_state['log']})")
        os.write(_state["console"], f"error: {line}\n".encode())
    finally:  # (whatever happened above: no C++ abort after it)
        os._exit(LOST_PEER_STATUS if reason is not None else 134)


def native_log_path(log_file: str) -> str:
    """Where native stderr goes: the process's log file, or a local file for a remote one."""
    if "://" in log_file:
        return os.path.join(tempfile.gettempdir(), f"bertjax_native.{os.getpid()}.txt")
    return log_file


def watch(log_file: str, heartbeat_timeout_seconds: int | None) -> None:
    """In a multi-process run: native stderr to `log_file` (see the module's note), Python's
    stderr kept on the console, and a lost peer reported as one line."""
    _state["heartbeat_s"] = heartbeat_timeout_seconds or JAX_HEARTBEAT_TIMEOUT_SECONDS
    if jax.process_count() == 1 or _state["log"] or not os.path.dirname(log_file):
        return  # (no workdir named: the run stops with that error)
    path = native_log_path(log_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    native = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    console = os.dup(2)
    os.dup2(native, 2)
    os.close(native)
    stream = os.fdopen(console, "w", buffering=1, encoding=sys.stderr.encoding,
                       errors="backslashreplace", closefd=False)
    handler = logging.get_absl_handler().python_handler
    if handler.stream is sys.stderr:
        handler.stream = stream
    sys.stderr = stream
    _state.update(log=path, console=console)
    _state["handler"] = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_abort)  # (kept alive)
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGABRT, ctypes.cast(_state["handler"], ctypes.c_void_p))
    logging.info("native stderr of process %d -> %s", jax.process_index(), path)


def client() -> Any:
    """JAX's coordination client, whose key-value store the processes share."""
    from jax._src import distributed as jax_distributed  # (not public API)
    return jax_distributed.global_state.client


def announce_failure(error: BaseException) -> None:
    """Tells the other processes that this one stops with `error` (best effort: the
    coordinator may be gone)."""
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return
    message = failures.os_error_line(error) if isinstance(error, OSError) else str(error)
    try:
        client().key_value_set(f"{_FAILED}{jax.process_index()}", message, allow_overwrite=True)
    except Exception:  # noqa: BLE001 (the coordinator itself lost: nothing to tell)
        pass


def announced_failure() -> str | None:
    """`process N stopped: MESSAGE` for the first process that announced a failure, if any
    (None also when the coordinator cannot be asked)."""
    try:
        failed = client().key_value_dir_get(_FAILED)
    except Exception:  # noqa: BLE001 (the coordinator lost: JAX's abort follows)
        return None
    if not failed:
        return None
    key, message = sorted(failed)[0]
    return f"process {key.rsplit('/', 1)[-1]} stopped: {message}"


def leave_if_peer_lost(error: BaseException) -> None:
    """For an error raised by a collective in a multi-process run (a peer's connection
    closed): stops with the line of a peer that announced its failure, or waits for JAX's
    abort on the lost peer (see `watch`); returns for any other error."""
    if jax.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return
    logging.info("a collective failed: %s", error)
    deadline = time.time() + _state["heartbeat_s"] + 10
    while time.time() < deadline:
        failed = announced_failure()
        if failed:
            leave(f"{failed}; {RERUN_ALL}")
        time.sleep(1)
    leave(f"a collective with the other processes failed ({str(error).splitlines()[0][:200]}) "
          f"after step {_state['step']}; {RERUN_ALL} to resume from the last checkpoint")


def leave(message: str) -> NoReturn:
    """`error: message` and exit at once (a normal exit waits for the others at JAX's
    shutdown barrier)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)
