"""The processes of a multi-process run stop together: a lost peer (a host that died, was
preempted or killed with -9) becomes one line on every other host's console, naming the lost
process and this process's last step, and saying to rerun the same command on every host.

JAX's coordination service notices a lost process after the heartbeat timeout (or at once
when the lost process is process 0, which hosts it) and aborts every other process from a
C++ thread, with a stack dump and Python's thread dump; its Python callback for this cannot
be used (jaxlib cannot pass it the status). So in a multi-process run, `watch` sends what
native code writes to stderr (fd 2) to the process's log file, keeps Python's `sys.stderr`
on the console, and handles SIGABRT: the handler reads the abort's reason from the log, prints
the line and exits with `LOST_PEER_STATUS`.

One host's error is every host's error: a process that stops with its own error announces it
in the coordination service's key-value store (`announce_failure`), and every process has a
thread that looks there every second (`watch`): the others print `error: process N of P
(host H) stopped: ...` and exit 1 wherever they are (preparing data, inside a collective, in
a save), after acknowledging, so that the failed process (which may be the coordinator)
waits for them, at most `ACK_WAIT_S`, before it exits; it exits `LEAVE_WITHIN_S` after its
announcement at the latest (what it still does may wait for the others, who are gone).

Joining is bounded too (`joining`): JAX's service gives up waiting for processes that never
register after `--join_timeout_seconds` and aborts every process that did; the abort becomes
one line naming the missing process ids and the coordinator's address, exit `LOST_PEER_STATUS`.

A process that was itself frozen (SIGSTOP, a suspended host) for longer than the others wait
finds them gone when it wakes, and JAX's service or client reports them lost: a clock thread
notices the freeze (bertjax.runtime.stalls), and the process says it was frozen instead of blaming
them. What a failed collective said goes to the log file only: the cause (another process's
line, JAX's abort) is the last line on the console.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import jax
from absl import logging

from bertjax.runtime import console, failures, stalls

JAX_HEARTBEAT_TIMEOUT_SECONDS = 100  # jax.distributed.initialize's default
LOST_PEER_STATUS = 75  # EX_TEMPFAIL: run again
RERUN_ALL = "rerun the same command on every host"
JOIN_TIMEOUT_SECONDS = 120  # --join_timeout_seconds's default
ACK_WAIT_S = 10.0  # how long a failed process waits for the others to read its line
LEAVE_WITHIN_S = 30.0  # a failed process's time from its announcement to its exit, at most
POLL_S = 1.0  # how often every process looks for another's failure
_FAILED = "bertjax/failed/"
_SEEN = "bertjax/seen/"
_EXITING = "bertjax/exiting/"
_JAX_ABORT = "Terminating process because the JAX distributed service detected fatal errors"
_state: dict[str, Any] = {
    "step": None,
    "heartbeat_s": JAX_HEARTBEAT_TIMEOUT_SECONDS,
    "log": None,
    "console": None,
    "handler": None,
    "restore": None,
    "join": None,
    "watching": False,
    "following": False,
    "announced": False,
    "left": False,
}
_leaving = threading.Lock()  # (one process prints one last line: the first to take it)


def reached_step(step: int) -> None:
    """Records that this process has finished training step `step` (for the lost-peer line)."""
    _state["step"] = step


def stalled_line(seconds: float) -> str:
    """The line of a process that was frozen for `seconds` (the others lost it, and its own
    service or client then reports them lost: they are not to blame)."""
    step = _state["step"]
    when = f"after step {step}" if step is not None else "before the first training step"
    return (
        f"this process {console.process_index()} of {console.process_count()} was frozen for "
        f"{seconds:.0f} s (--heartbeat_timeout_seconds={_state['heartbeat_s']}; stopped with "
        "SIGSTOP, or its host suspended?), so the other processes gave up on it and stopped; "
        f"it stopped {when}; {RERUN_ALL} to resume from the last checkpoint"
    )


def lost_peer_line(reason: str) -> str:
    """The line for JAX's abort `reason` (the coordination service's status): which process
    was lost, this process's last step, and what to do; or, if this process itself was
    frozen meanwhile (`stalls.recent`), that."""
    stall = stalls.recent(_state["heartbeat_s"])
    if stall is not None:
        return stalled_line(stall)
    listed = re.search(r"stopped sending heartbeats\):\s*([\d\s,]+)", reason)
    ids = re.findall(r"\d+", listed.group(1)) if listed else re.findall(r"task:(\d+)", reason)
    ids = [i for i in dict.fromkeys(ids) if int(i) != console.process_index()]
    if ids:
        who = (
            f"process{'es' if len(ids) > 1 else ''} {', '.join(ids)} of "
            f"{console.process_count()} (JAX's coordination service reported it stopped sending "
            f"heartbeats; --heartbeat_timeout_seconds={_state['heartbeat_s']})"
        )
    elif console.process_index() != 0:
        who = f"process 0 of {console.process_count()} (the coordinator)"
    else:
        who = f"another process of {console.process_count()}"
    step = _state["step"]
    when = f"after step {step}" if step is not None else "before the first training step"
    return (
        f"lost {who}; this process {console.process_index()} stopped {when}; {RERUN_ALL} to resume from the "
        "last checkpoint"
    )


def join_line(reason: str, timeout_s: float, waited_s: float) -> str:
    """The line for JAX's abort `reason` while joining: the processes that have not joined
    (JAX's service names them once its registration, `timeout_s`, times out) or, without the
    service's answer, the coordinator that has not answered this process for `waited_s` (the
    client waits longer than the service: `distributed._CLIENT_SLACK_S`)."""
    from jax._src import distributed as jax_distributed  # (not public API)

    where = jax_distributed.global_state
    count, index = where.num_processes, where.process_id
    listed = re.search(r"Some timed out task names:\s*([\d\s,]+)", reason)
    missing = re.findall(r"\d+", listed.group(1)) if listed else []
    if missing:
        who = (
            f"process{'es' if len(missing) > 1 else ''} {', '.join(missing)} of {count} "
            f"{'have' if len(missing) > 1 else 'has'} not joined the job at the coordinator "
            f"{where.coordinator_address} within {timeout_s:g} s"
        )
    else:
        who = (
            f"the coordinator {where.coordinator_address} (process 0 of {count}) has not "
            f"answered within {waited_s:.0f} s: it has not started, cannot be reached, or has "
            f"stopped already (it waits {timeout_s:g} s for every process to join)"
        )
    return (
        f"{who}; this process {index} stops (status {LOST_PEER_STATUS}): start every "
        "process with the same command (a process that stopped with an error names it on "
        "its console), then rerun the same command on every host; --join_timeout_seconds "
        "sets how long to wait"
    )


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
        if _state["left"]:  # (its last line printed)
            os._exit(1)
        if _state["announced"]:  # (its own line comes from the main thread: let it finish)
            deadline = time.monotonic() + ACK_WAIT_S
            while not _state["left"] and time.monotonic() < deadline:
                time.sleep(0.1)
            _leave_announced()
        reason = _abort_reason(_state["log"])
        if reason is None:
            line = f"aborted in native code (the details: {_state['log']})"
        elif _state["join"] is not None:
            timeout_s, started = _state["join"]
            line = join_line(reason, timeout_s, time.monotonic() - started)
        else:
            line = lost_peer_line(reason)
        console.error(line, fd=_state["console"])
    finally:  # (whatever happened above: no C++ abort after it)
        os._exit(LOST_PEER_STATUS if reason is not None else 134)


def native_log_path(log_file: str) -> str:
    """Where native stderr goes: the process's log file, or a local file for a remote one."""
    if "://" in log_file:
        return os.path.join(tempfile.gettempdir(), f"bertjax_native.{os.getpid()}.txt")
    return log_file


def _native_stderr_to(path: str) -> None:
    """Native code's stderr (fd 2) to `path` from now on; Python's (and absl's) to the
    console, whose descriptor the abort handler writes to; SIGABRT to `_on_abort`."""
    native = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stderr.flush()
    if _state["console"] is None:
        console = os.dup(2)
        stream = os.fdopen(
            console,
            "w",
            buffering=1,
            encoding=sys.stderr.encoding,
            errors="backslashreplace",
            closefd=False,
        )
        handler = logging.get_absl_handler().python_handler
        _state["restore"] = (sys.stderr, handler.stream)
        if handler.stream is sys.stderr:
            handler.stream = stream
        sys.stderr = stream
        _state["console"] = console
        _state["handler"] = ctypes.CFUNCTYPE(None, ctypes.c_int)(_on_abort)  # (kept alive)
        _set_sigabrt(ctypes.cast(_state["handler"], ctypes.c_void_p))
    os.dup2(native, 2)
    os.close(native)
    _state["log"] = path


def _set_sigabrt(handler: ctypes.c_void_p | int) -> None:
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(signal.SIGABRT, handler)


def _native_stderr_back() -> None:
    """Undoes `_native_stderr_to`: stderr and SIGABRT as they were."""
    sys.stderr.flush()
    _set_sigabrt(signal.SIG_DFL)
    os.dup2(_state["console"], 2)
    os.close(_state["console"])
    sys.stderr, logging.get_absl_handler().python_handler.stream = _state["restore"]
    _state.update(console=None, log=None, handler=None)


@contextlib.contextmanager
def joining(timeout_s: float) -> Iterator[None]:
    """Around `jax.distributed.initialize` (whose service gives up on processes that have not
    registered after `timeout_s`): JAX's abort on that becomes one line (`join_line`). Native
    stderr goes to a temporary file meanwhile (`watch` then sends it to the run's log)."""
    path = os.path.join(tempfile.gettempdir(), f"bertjax_join.{os.getpid()}.txt")
    _native_stderr_to(path)
    _state["join"] = (timeout_s, time.monotonic())
    try:
        yield
    finally:
        _state["join"] = None
        _native_stderr_back()
        with contextlib.suppress(OSError):
            os.remove(path)


def watch(log_file: str, heartbeat_timeout_seconds: int | None) -> None:
    """In a multi-process run: native stderr to `log_file` (see the module's note), Python's
    stderr kept on the console, a lost peer reported as one line, and another process's
    failure ending this one (`_watch_peers`)."""
    _state["heartbeat_s"] = heartbeat_timeout_seconds or JAX_HEARTBEAT_TIMEOUT_SECONDS
    if console.process_count() == 1 or _state["watching"]:
        return
    _state["watching"] = True
    follow_failures()
    stalls.watch(_state["heartbeat_s"])
    if not os.path.dirname(log_file):
        return  # (no workdir named: the run stops with that error)
    path = native_log_path(log_file)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    _native_stderr_to(path)
    logging.info("native stderr of process %d -> %s", console.process_index(), path)


def follow_failures() -> None:
    """In a multi-process run, from the moment it has joined (before JAX's backend starts,
    which waits for every process's devices): another process's announced failure ends this
    one (`_watch_peers`), and this one's own last line waits for the others to read it."""
    if console.process_count() == 1 or _state["following"]:
        return
    _state["following"] = True
    failures.before_leaving(_after_own_line)
    threading.Thread(target=_watch_peers, name="bertjax-peers", daemon=True).start()


def client() -> Any:
    """JAX's coordination client, whose key-value store the processes share."""
    from jax._src import distributed as jax_distributed  # (not public API)

    return jax_distributed.global_state.client


def _others_done(directory: str) -> set[str] | None:
    """The process ids with a key under `directory`; None once the coordinator is gone."""
    try:
        return {key.rsplit("/", 1)[-1] for key, _ in client().key_value_dir_get(directory)}
    except Exception:  # noqa: BLE001 (the coordinator lost: nobody left to ask)
        return None


def announce_failure(error: BaseException) -> None:
    """Tells the other processes that this one stops with `error` (best effort: the
    coordinator may be gone); once its line is printed, `failures.leave` waits until they
    have read it (`_after_own_line`). Once per process; not for a failed collective (a
    JaxRuntimeError, as when a peer is lost: `leave_if_peer_lost` waits for the reason)."""
    if (
        not jax.distributed.is_initialized()
        or console.process_count() == 1
        or _state["announced"]
        or isinstance(error, jax.errors.JaxRuntimeError)
    ):
        return
    _leaving.acquire()  # (from now on the watcher leaves this process's line to it)
    message = failures.os_error_line(error) if isinstance(error, OSError) else str(error)
    message = message.strip().splitlines()[0] if message.strip() else type(error).__name__
    try:
        client().key_value_set(
            f"{_FAILED}{console.process_index()}",
            f"{socket.gethostname()}\n{message}",
            allow_overwrite=True,
        )
    except Exception:  # noqa: BLE001 (the coordinator itself lost: nothing to tell)
        return
    _state["announced"] = message
    # (the others are going: what is left to do here, e.g. waiting for a save that needed
    # them, may never end)
    timer = threading.Timer(LEAVE_WITHIN_S, _leave_announced)
    timer.daemon = True
    timer.start()


def _leave_announced() -> None:
    """This process's announced line, if it has not printed its last line yet, and exit 1."""
    if not _state["left"]:
        console.error(_state["announced"], fd=_state["console"] or 2)
    os._exit(1)


def _after_own_line() -> None:
    """Once this process's last line is printed (`failures.leave`): a lost coordinator is no
    news from now on; the others are waited for if it announced its failure, and
    the coordinator leaves last (`_last_out`)."""
    _state["left"] = True
    if _state["announced"]:
        _wait_for(_SEEN, _FAILED)
    _last_out()


def _last_out() -> None:
    """Before this process exits: process 0, which hosts the coordination service, waits (at
    most `ACK_WAIT_S`) for the others to exit, since its exit aborts those still running (a
    lost coordinator); the others say they are exiting."""
    if console.process_index() == 0:
        _wait_for(_EXITING)
    else:
        with contextlib.suppress(Exception):  # (the coordinator gone: nobody to tell)
            client().key_value_set(
                f"{_EXITING}{console.process_index()}", "1", allow_overwrite=True
            )


def _wait_for(*directories: str) -> None:
    """Waits (at most `ACK_WAIT_S`) until every other process has a key in one of
    `directories` of the coordination service's store (or the coordinator is gone)."""
    others = {str(i) for i in range(console.process_count())} - {str(console.process_index())}
    deadline = time.monotonic() + ACK_WAIT_S
    while time.monotonic() < deadline:
        found = [_others_done(directory) for directory in directories]
        done = [keys for keys in found if keys is not None]
        if len(done) < len(found) or others <= set().union(*done):
            return
        time.sleep(0.1)


def announced_failure() -> str | None:
    """`process N of P (host H) stopped: MESSAGE` for the first other process that announced
    a failure, if any (None also when the coordinator cannot be asked)."""
    try:
        failed = client().key_value_dir_get(_FAILED)
    except Exception:  # noqa: BLE001 (the coordinator lost: JAX's abort follows)
        return None
    failed = [(int(key.rsplit("/", 1)[-1]), value) for key, value in failed]
    failed = sorted((index, value) for index, value in failed if index != console.process_index())
    if not failed:
        return None
    index, value = failed[0]
    host, _, message = value.partition("\n")
    return f"process {index} of {console.process_count()} (host {host}) stopped: {message}"


def _watch_peers() -> None:
    """The thread that ends this process once another has announced its failure."""
    while True:
        time.sleep(POLL_S)
        failed = announced_failure()
        if failed and _leaving.acquire(blocking=False):
            with contextlib.suppress(Exception):  # (tell the failed one it was heard)
                client().key_value_set(
                    f"{_SEEN}{console.process_index()}", "1", allow_overwrite=True
                )
            _leave_now(failed, lambda: _wait_for(_SEEN, _FAILED))


def leave_if_peer_lost(error: BaseException) -> None:
    """For an error raised by a collective in a multi-process run (a peer's connection
    closed): waits for the line of a peer that announced its failure (`_watch_peers`) or for
    JAX's abort on the lost peer (see `watch`), at most the heartbeat timeout and 10 s more;
    returns for any other error."""
    if console.process_count() == 1 or not isinstance(error, jax.errors.JaxRuntimeError):
        return
    console.log_only(f"a collective failed: {error}")  # (the cause's line comes on the console)
    time.sleep(_state["heartbeat_s"] + 10)
    leave(
        f"a collective with the other processes failed ({str(error).splitlines()[0][:200]}) "
        f"after step {_state['step']}; {RERUN_ALL} to resume from the last checkpoint"
    )


def leave_on_bug(error: BaseException) -> None:
    """For an unexpected error (a bug) in a multi-process run: the others are told, its
    traceback printed, and the process ends at once (a normal exit would wait for the others
    at JAX's shutdown barrier). Returns in a one-process run (the caller re-raises)."""
    if not jax.distributed.is_initialized() or console.process_count() == 1:
        return
    announce_failure(error)
    traceback.print_exception(error, file=sys.stderr)
    failures.leave(
        f"{type(error).__name__}: {failures.first_line(error)} (a bug: the traceback is above)"
    )


def leave(message: str, status: int = 1) -> NoReturn:
    """`error: message` and exit at once with `status` (a normal exit waits for the others at
    JAX's shutdown barrier)."""
    _leaving.acquire(blocking=False)
    _leave_now(message, status=status)


def _leave_now(message: str, then: Callable[[], Any] = lambda: None, status: int = 1) -> NoReturn:
    console.error(message)
    sys.stdout.flush()
    _state["left"] = True  # (a coordinator gone from now on is no news)
    then()
    _last_out()
    os._exit(status)
