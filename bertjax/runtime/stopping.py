"""Every bertjax process can be stopped: SIGTERM and Ctrl-C end it within a bounded time
(`BERTJAX_STOP_SECONDS`, default 60), also while its main thread is stuck in native code (a
save or upload that stalls, a compilation or allocation that hangs), where Python's own
signal handlers never get to run.

How: Python's C-level signal handler writes each signal's number to a socket
(`signal.set_wakeup_fd`) at once, whatever the main thread is doing; a watchdog thread reads
it. A stop then proceeds as before (the loop saves at the end of its step and exits), but if
the process is still alive `BERTJAX_STOP_SECONDS` later, the watchdog prints one line naming
what it was stuck in and exits at once with 128 + the signal's number, abandoning the stuck
work: a checkpoint is sealed only after it is complete, so an abandoned save is never
trusted, and a rerun resumes from the last complete one. A second Ctrl-C exits at once.

SIGTERM is also JAX's preemption notice: `jax.distributed` installs a native handler for it
that the preemption sync point (Orbax's save on preemption) relies on. `take_sigterm` puts
Python's handler in its place and the watchdog calls JAX's handler for every SIGTERM, so JAX
sees each notice as before. The default of 60 s leaves a stopping run the time to save a
checkpoint of BERT-large (about 4 GB with Adam's moments) at 100 MB/s; a spot VM's notice
is 30 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from bertjax.runtime import console, failures

VARIABLE = "BERTJAX_STOP_SECONDS"
DEFAULT_SECONDS = 60.0
_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
_state: dict[str, Any] = {
    "doing": "starting up",
    "watching": False,
    "native_sigterm": None,
    "requested": None,
}


def grace_seconds() -> float:
    """How long a stop may take before the watchdog ends the process (BERTJAX_STOP_SECONDS)."""
    value = os.environ.get(VARIABLE, "")
    try:
        seconds = float(value) if value else DEFAULT_SECONDS
    except ValueError:
        raise ValueError(
            f"environment variable {VARIABLE}={value!r} is not a number of seconds"
        ) from None
    if seconds <= 0:
        raise ValueError(f"environment variable {VARIABLE}={value!r} must be positive")
    return seconds


@contextlib.contextmanager
def doing(what: str) -> Iterator[None]:
    """Names what the main thread is doing in the block (`saving checkpoint 8`), for the
    watchdog's line if a stop finds it stuck there."""
    before, _state["doing"] = _state["doing"], what
    try:
        yield
    finally:
        _state["doing"] = before


def now_doing(what: str) -> None:
    """Names what the main thread is doing from now on (`training step 12`)."""
    _state["doing"] = what


def _where_main_is() -> str:
    """`bertjax/training/checkpoint.py:283 in wait`: the main thread's innermost bertjax frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    while frame is not None:
        path = frame.f_code.co_filename.replace(os.sep, "/")
        if "/bertjax/" in path:
            return (
                f"bertjax/{path.rsplit('/bertjax/', 1)[1]}:{frame.f_lineno} in "
                f"{frame.f_code.co_name}"
            )
        frame = frame.f_back
    return "outside bertjax's code"


def _leave(line: str, status: int) -> None:
    """`cli.leave(line, status, at_once=True)` (which cli, importing this module, owns)."""
    console.note(console.error_line(line))
    failures.leave(line, status, at_once=True)


def _call_native_sigterm() -> None:
    handler = _state["native_sigterm"]
    if handler is not None:
        handler(signal.SIGTERM)


def _watch(reader: socket.socket) -> None:
    """The watchdog thread: each signal as it arrives, and the deadline of a requested stop."""
    grace, deadline = grace_seconds(), None
    while True:
        reader.settimeout(None if deadline is None else max(0.0, deadline - time.monotonic()))
        try:
            received = reader.recv(64)
        except TimeoutError:
            signum = _state["requested"]
            _leave(
                f"stop requested ({_NAMES[signum]}) {grace:g} s ago, but this process is "
                f"still {_state['doing']} ({_where_main_is()}); exiting without finishing "
                "it: a rerun of the same command resumes from the last complete checkpoint "
                f"(to wait longer, set {VARIABLE})",
                128 + signum,
            )
            continue
        for signum in received:
            if signum == signal.SIGTERM:
                _call_native_sigterm()
            if signum not in _NAMES:
                continue
            if signum == signal.SIGINT and _state["requested"] == signal.SIGINT:
                console.say("Second Ctrl-C: exiting without saving")
                _leave(
                    f"stopped by a second Ctrl-C while {_state['doing']}; a rerun of the "
                    "same command resumes from the last complete checkpoint",
                    130,
                )
            if _state["requested"] is None:
                _state["requested"] = signum
                deadline = time.monotonic() + grace


def watch() -> None:
    """Starts the watchdog (once per process, from the main thread): from now on a Ctrl-C or
    a SIGTERM that Python handles ends the process within `grace_seconds()`. A process started
    with SIGINT ignored (as a non-interactive shell starts `cmd &`) takes it back: Ctrl-C and
    `kill -INT` stop every bertjax process."""
    if _state["watching"] or threading.current_thread() is not threading.main_thread():
        return
    grace_seconds()  # (a malformed setting: said now, not when a stop needs it)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # (inherited, e.g. from a shell's
        signal.signal(signal.SIGINT, signal.default_int_handler)  # `cmd &`: Ctrl-C stops it)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    _state.update(watching=True, sockets=(reader, writer))
    threading.Thread(
        target=_watch, args=(reader,), name="bertjax-stop-watchdog", daemon=True
    ).start()


class _SigAction(ctypes.Structure):
    """glibc's `struct sigaction` on Linux (x86-64 and arm64): the handler, the mask, the
    flags, then room to spare."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_char * 128),
        ("flags", ctypes.c_int),
        ("rest", ctypes.c_char * 128),
    ]


_SA_SIGINFO = 4  # (the handler takes (signum, siginfo, context))


def take_sigterm() -> None:
    """Once `jax.distributed` has installed its native SIGTERM handler (the preemption
    notifier): Python's handler takes its place, so that the watchdog sees every SIGTERM,
    and the watchdog passes each one on to JAX's handler."""
    watch()
    if _state["native_sigterm"] is not None or not _state["watching"]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    current = _SigAction()
    if libc.sigaction(signal.SIGTERM, None, ctypes.byref(current)) != 0 or current.handler in (
        None,
        0,
        1,
    ):  # (SIG_DFL, SIG_IGN: nothing native to pass on)
        return
    if current.flags & _SA_SIGINFO:
        native = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
            current.handler
        )
        _state["native_sigterm"] = lambda signum: native(signum, None, None)
    else:
        _state["native_sigterm"] = ctypes.CFUNCTYPE(None, ctypes.c_int)(current.handler)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # (the watchdog acts on it)
