"""How a run meets the world outside it: Ctrl-C saves like a preemption notice (and the run
then exits with the signal's status, `Stopped`), and an OS
error (a full disk, a missing permission, a directory where a file belongs) becomes one line
naming the file, also when it happens in a background writer thread or inside a library that
reports it as text (Orbax's TensorStore)."""

from __future__ import annotations

import errno
import logging as std_logging
import os
import queue
import re
import signal
import sys
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

from absl import logging

from bertjax.runtime import console

HINTS = {
    errno.ENOSPC: "free some space, then rerun the same command to resume",
    errno.EDQUOT: "free some space, then rerun the same command to resume",
    errno.EACCES: "check the permissions of the file and the directories above it",
    errno.EPERM: "check the permissions of the file and the directories above it",
    errno.EROFS: "the file system is read-only: use a writable directory",
    errno.EISDIR: "a directory is given where a file is expected",
    errno.ENOTDIR: "a file is given where a directory is expected",
}


def os_error_line(error: OSError) -> str:
    """`No space left on device: /w/metrics.jsonl (free some space, ...)`, one line."""
    if error.errno is None or not error.strerror:  # raised by bertjax with its own message
        return str(error)
    where = f": {error.filename}" if error.filename else ""
    hint = HINTS.get(error.errno)
    return f"{error.strerror}{where}" + (f" ({hint})" if hint else "")


def first_line(error: BaseException, limit: int = 300) -> str:
    """The start of an error's message (TensorStore's run to many lines)."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


# TensorStore's account of a failed write: `Failed writing: "FILE": ... [os_error_code='28']`.
_LIBRARY_ERRNO = re.compile(r"os_error_code='(\d+)'")
_LIBRARY_FILE = re.compile(r'Failed writing: "([^"]+)"')


def library_os_error(error: BaseException) -> OSError | None:
    """The OSError (with its file where named) that a library's error text reports, e.g.
    Orbax's RESOURCE_EXHAUSTED for a full disk; None if it reports none."""
    code, file = _LIBRARY_ERRNO.search(str(error)), _LIBRARY_FILE.search(str(error))
    if not code:
        return None
    return OSError(
        int(code.group(1)), os.strerror(int(code.group(1))), file.group(1) if file else None
    )


_BEFORE_LEAVING: list[Callable[[], None]] = []


def before_leaving(hook: Callable[[], None]) -> None:
    """`hook()` runs after `leave`'s line is printed in a multi-process job, before the exit
    (`bertjax.runtime.peers`: until the other processes have read this one's failure)."""
    _BEFORE_LEAVING.append(hook)


def _joined_other_processes() -> bool:
    """Whether this process belongs to a multi-process `jax.distributed` job."""
    if "jax" not in sys.modules:
        return False
    from jax._src import distributed as jax_distributed  # (not public API)

    state = jax_distributed.global_state
    return state.client is not None and (state.num_processes or 1) > 1


def leave(message: str, status: int = 1, at_once: bool = False) -> NoReturn:
    """Ends the program with `error: message` on stderr and exit `status`; `at_once` without
    joining other threads (Orbax's writers of a failed save, or the workers a Ctrl-C left,
    wait for minutes for signals that never come, and a normal exit joins them). A process of
    a multi-process job always leaves at once: a normal exit waits at JAX's shutdown barrier
    for the other processes, which may never come."""
    console.error(message)
    if _joined_other_processes():
        for hook in _BEFORE_LEAVING:
            hook()
    if at_once or _joined_other_processes():
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


def one_line_thread_errors() -> None:
    """An OSError that ends a background thread (e.g. TensorBoard's writer on a full disk) is
    logged as one line instead of a traceback; the main thread meets it at the next flush.
    Errors that native threads report (`sys.excepthook` off the main thread) and errors
    Python can only ignore (`sys.unraisablehook`) go to the log, not the console: e.g. the
    reads Orbax had in flight when a restore failed, completing on its closed event loop
    ("Event loop is closed"), or its coroutines collected at exit."""
    default = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError):
            logging.error(
                "thread %s stopped: %s",
                getattr(args.thread, "name", "?"),
                os_error_line(args.exc_value),
            )
        else:
            default(args)

    threading.excepthook = hook
    sys.unraisablehook = lambda unraisable: _log_ignored(unraisable.exc_value, unraisable.object)
    main_excepthook = sys.excepthook

    def excepthook(
        kind: type[BaseException], value: BaseException, trace: types.TracebackType | None
    ) -> None:
        if threading.current_thread() is threading.main_thread():
            main_excepthook(kind, value, trace)
        else:
            _log_ignored(value, threading.current_thread())

    sys.excepthook = excepthook


def _log_ignored(error: BaseException | None, where: object) -> None:
    """`error`, which nothing handles, to the run's log file while it is open (kept until it
    opens), else nowhere (after the run's last line, or at exit)."""
    try:
        text = f"ignored in {where!r}: " + "".join(traceback.format_exception(error)).rstrip()
        console.RUN_LOG.take(
            std_logging.makeLogRecord(
                {
                    "msg": text,
                    "levelno": std_logging.INFO,
                    "levelname": "INFO",
                    "name": "bertjax.ignored",
                    "pathname": __file__,
                }
            )
        )
    except Exception:  # noqa: BLE001 (interpreter shutdown: nowhere left to write)
        pass


class CtrlC:
    """While active (a context manager; signals need the main thread), the first SIGINT
    sets `requested`: the loop then saves at the end of the step and stops. In a
    multi-process job it is forwarded as SIGTERM, JAX's preemption notice, so that every
    process saves at the same step. A second SIGINT exits at once (status 130: `stopping`'s
    watchdog, which also sees it while the main thread is stuck in native code)."""

    NOTICE = (
        "Ctrl-C: saving a checkpoint at the end of this step, then exiting (Ctrl-C again "
        "to exit at once)"
    )

    def __init__(self, forward_as_sigterm: bool) -> None:
        self.forward_as_sigterm = forward_as_sigterm
        self.requested = False
        self._previous: Any = None
        # The handler's line is printed by a thread: a handler runs inside whatever the main
        # thread was doing, and a write to the log file it interrupted would drop the line
        # ("reentrant call inside BufferedWriter"). SimpleQueue.put is safe in a handler.
        self._notices: queue.SimpleQueue = queue.SimpleQueue()
        self._printer: threading.Thread | None = None

    def _handle(self, signum: int, frame: types.FrameType | None) -> None:
        del signum, frame
        if self.requested:
            return
        self.requested = True
        self._notices.put(self.NOTICE)
        if self.forward_as_sigterm:
            os.kill(os.getpid(), signal.SIGTERM)

    def _print_notices(self) -> None:
        for notice in iter(self._notices.get, None):
            console.say(notice)

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._printer = threading.Thread(
                target=self._print_notices, daemon=True, name="bertjax-ctrl-c"
            )
            self._printer.start()
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Gives SIGINT back to the handler before (a KeyboardInterrupt) before the block ends."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None
        if self._printer is not None:  # (its notice printed before the run's next lines)
            self._notices.put(None)
            self._printer.join()
            self._printer = None


# The signals that stop a run with a checkpoint saved, as its last line names them.
STOPPING: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "preemption notice, SIGTERM"}


class Stopped(Exception):
    """The run stopped before its end on `signum` (Ctrl-C, or a preemption notice) after
    saving, and printed `stopped_line`: the process exits with `status`, 128 + the signal's
    number (130 for Ctrl-C, 143 for SIGTERM), as a shell reports a process the signal ended,
    so that nothing reads the unfinished run as done and a supervisor restarts it."""

    def __init__(self, signum: int) -> None:
        super().__init__(STOPPING[signum])
        self.status = 128 + signum


def stopped_line(where: str, signum: int) -> str:
    """A stopped run's last line: `Stopped at step 53 of 120 (Ctrl-C): checkpoint saved;
    rerun the same command to continue`."""
    return (
        f"Stopped at {where} ({STOPPING[signum]}): checkpoint saved; rerun the same "
        "command to continue"
    )
