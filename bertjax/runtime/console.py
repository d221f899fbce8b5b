"""What the console shows and what the run's log file keeps: bertjax's one reporter. The
lines a process prints (`say`; `chief_print`, process 0's alone; `warning`), the one `error:`
line (`error_line`, printed by `error`), the terminal's status line, the console's library
log filters (`configure_console`, every entry point) and the log file (`logging_to`), which
holds every console line of the run besides the libraries' records. Library modules print
nothing themselves: every line goes through here."""

from __future__ import annotations

import collections
import contextlib
import logging as std_logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from absl import logging

from bertjax.runtime import backend_env, files


def process_index() -> int:
    """This process's index in `jax.distributed`'s job (0 alone), read from the job's setup:
    valid before JAX's backend starts (whose start may be what failed) and without importing
    JAX (`bertjax.prepare` starts about 3 s sooner without it)."""
    return _job_state()[0]


def process_count() -> int:
    """The processes of `jax.distributed`'s job (1 alone), as `process_index` reads it."""
    return _job_state()[1]


def _job_state() -> tuple[int, int]:
    if "jax" not in sys.modules:
        return 0, 1
    from jax._src import distributed  # (not public API: jax.process_index starts the backend)

    state = distributed.global_state
    return (state.process_id, state.num_processes) if state.client is not None else (0, 1)


class TerminalLine:
    """A status line redrawn in place (tqdm-style) when stdout is a terminal, never written
    otherwise; printed lines and log records clear it first."""

    def __init__(self) -> None:
        self.shown = False

    def show(self, text: str) -> None:
        if process_index() == 0 and sys.stdout.isatty():
            sys.stdout.write("\r\033[K" + text)
            sys.stdout.flush()
            self.shown = True

    def clear(self) -> None:
        if self.shown:
            sys.stdout.write("\r\033[K")
            sys.stdout.flush()
            self.shown = False


TERMINAL = TerminalLine()  # the process's one console


def say(line: str, err: bool = False) -> None:
    """`line` on this process's console (stdout; stderr with `err`), whichever process it is,
    the terminal's status line cleared first."""
    TERMINAL.clear()
    print(line, file=sys.stderr if err else sys.stdout, flush=True)


def chief_print(line: str) -> None:
    """`line` from process 0 only: progress and notices, which every process computes alike."""
    if process_index() == 0:
        say(line)


def warning(message: str) -> None:
    """`warning: message` on stderr, from whichever process meets it."""
    say(f"warning: {message}", err=True)


def error_line(message: str) -> str:
    """`error: message`, the one line that says what went wrong and what to do: the only
    place bertjax writes the prefix (the console's own error records included)."""
    return f"error: {message}"


def error(message: str, fd: int | None = None) -> None:
    """`error_line(message)` on stderr; with `fd`, written to that descriptor at once, as
    from a signal handler or a native thread (no Python stream, no status line touched)."""
    if fd is not None:
        os.write(fd, (error_line(message) + "\n").encode())
        return
    say(error_line(message), err=True)


PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # bertjax/
# Library warnings that describe nothing wrong: Orbax reading one item of a checkpoint alone
# (the metadata file is the whole checkpoint's, one directory up).
HARMLESS_WARNINGS = (("/orbax/", "Metadata file does not exist"),)


class QuietLibraries(std_logging.Filter):
    """The default console: bertjax's own log lines and the libraries' warnings, without the
    libraries' INFO chatter (Orbax: tens of lines per save; JAX probing for TPU/GPU backends;
    jax.distributed's start-up) or the warnings in HARMLESS_WARNINGS. While a run's log file
    is open (`log_file`), the libraries' errors (with their tracebacks) go there only: bertjax
    says in one line what failed."""

    def __init__(self) -> None:
        super().__init__()
        self.log_file: str | None = None

    def filter(self, record: std_logging.LogRecord) -> bool:
        ours = record.pathname.startswith(PACKAGE_DIR)
        if record.levelno < std_logging.WARNING or (
            record.levelno >= std_logging.ERROR and self.log_file
        ):
            return ours
        return not any(
            where in record.pathname and record.getMessage().startswith(text)
            for where, text in HARMLESS_WARNINGS
        )


class ConsoleFormat(std_logging.Formatter):
    """Plain lines: the message alone for INFO, `warning: ...` / `error: ...` above it; a
    library's line names the library (`error (orbax): ...`), so that `error: ` starts only
    bertjax's own one-line account of what went wrong and what to do."""

    def format(self, record: std_logging.LogRecord) -> str:
        TERMINAL.clear()
        message = super().format(record)
        if record.levelno < std_logging.WARNING:
            return message
        level = "warning" if record.levelno < std_logging.ERROR else "error"
        library = library_name(record.pathname)
        if library:
            return f"{level} ({library}): {message}"
        return error_line(message) if level == "error" else f"warning: {message}"


def library_name(pathname: str) -> str | None:
    """The top-level package of a log record's source file outside bertjax (None: ours)."""
    if pathname.startswith(PACKAGE_DIR):
        return None
    parts = pathname.replace(os.sep, "/").split("/")
    for marker in ("site-packages", "dist-packages"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1].removesuffix(".py")
    return os.path.basename(pathname).removesuffix(".py") or None


def log_file(workdir: str) -> str:
    """A run's log file (`logging_to`): every console line, and every record at INFO or above
    (the libraries' included). For a workdir on an object store (which cannot append) a local
    file under the temporary directory, named after the workdir."""
    index = process_index()
    if files.is_remote(workdir):
        workdir = os.path.join(
            tempfile.gettempdir(), "bertjax_logs", re.sub(r"[^A-Za-z0-9._-]+", "_", workdir)
        )
        os.makedirs(workdir, exist_ok=True)
    return os.path.join(workdir, "log.txt" if index == 0 else f"log.{index}.txt")


class LogFileFormat(std_logging.Formatter):
    """`TIME LEVEL FILE:LINE] message` for a log record; `TIME console] line` for a line the
    console showed (`printed`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(pathname)s:%(lineno)d] %(message)s")

    def format(self, record: std_logging.LogRecord) -> str:
        if record.name == PRINTED:
            return f"{self.formatTime(record)} console] {record.getMessage()}"
        return super().format(record)


PRINTED = "bertjax.runtime.console"  # the logger name of the records `printed` makes


def printed(line: str) -> std_logging.LogRecord:
    """A log file's record of a line the console showed."""
    return std_logging.makeLogRecord(
        {"name": PRINTED, "msg": line, "levelno": std_logging.INFO, "levelname": "INFO"}
    )


class _LogFile(std_logging.FileHandler):
    """The run's log file. A write that fails (a full disk) is dropped without a traceback:
    the console has shown what matters, and the run's own writers name the disk's state."""

    def handleError(self, record: std_logging.LogRecord) -> None:
        del record

    def close(self) -> None:
        with contextlib.suppress(OSError):  # (its last flush)
            super().close()


class _RunLog:
    """Where a run's lines go besides the console: the open log file's handler; before it
    opens (from `configure_console` on), a buffer that it then receives first; after it
    closes, its path, for the run's last line (`note`)."""

    def __init__(self) -> None:
        self.handler: std_logging.Handler | None = None
        self.early: collections.deque | None = None
        self.last_path: str | None = None

    def take(self, record: std_logging.LogRecord) -> None:
        if self.handler is not None:
            self.handler.handle(record)
        elif self.early is not None:
            self.early.append(record)


RUN_LOG = _RunLog()
EARLY_RECORDS = 100_000  # kept before a log file opens (an entry point that opens none)


class _Early(std_logging.Handler):
    """Root-logger handler keeping the records that come before the run's log file opens."""

    def emit(self, record: std_logging.LogRecord) -> None:
        if RUN_LOG.handler is None:
            RUN_LOG.take(record)


class _Echo:
    """sys.stdout that also hands each complete line to the run's log (`RUN_LOG`); the
    terminal's status line (written after a carriage return) stays on the console."""

    def __init__(self, console: TextIO) -> None:
        self.console, self.pending, self.lock = console, "", threading.RLock()

    def write(self, text: str) -> int:
        with self.lock:  # (a text file is not safe to write from several threads at once)
            written = self.console.write(text)
            if text.startswith("\r"):
                return written
            *lines, self.pending = (self.pending + text).split("\n")
            for line in lines:
                RUN_LOG.take(printed(line))
        return written

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.console, name)


@contextlib.contextmanager
def logging_to(path: str | None) -> Iterator[None]:
    """Writes to `path` for the block (None: nothing; as on object stores) every line the
    console shows, what came before it in this process (from `configure_console` on) first,
    and every log record at INFO or above, the libraries' with their tracebacks; the quiet
    console leaves the libraries' errors to it."""
    if path is None or "://" in path:
        yield
        return
    handler = _LogFile(path, encoding="utf-8")
    handler.setLevel(std_logging.INFO)
    handler.setFormatter(LogFileFormat())
    for record in RUN_LOG.early or ():
        handler.handle(record)
    if RUN_LOG.early:
        RUN_LOG.early.clear()
    quiet = [f for f in logging.get_absl_handler().filters if isinstance(f, QuietLibraries)]
    root, console, stdout = std_logging.getLogger(), sys.stderr, sys.stdout
    root.addHandler(handler)
    RUN_LOG.handler, RUN_LOG.last_path = handler, path
    if not isinstance(stdout, _Echo):
        sys.stdout = _Echo(stdout)
    for f in quiet:
        f.log_file = path
        sys.stderr = _OtherThreadsTo(handler, console)
    try:
        yield
    finally:
        for f in quiet:
            f.log_file = None
        sys.stderr, sys.stdout, RUN_LOG.handler = console, stdout, None
        root.removeHandler(handler)
        handler.close()


def log_only(message: str) -> None:
    """Keeps `message` in the run's log file (or with the records kept for it), not on the
    console: detail that must not come after a line that says what went wrong."""
    caller = sys._getframe(1)  # (where the log file says it came from)
    RUN_LOG.take(
        std_logging.LogRecord(
            "bertjax",
            std_logging.INFO,
            caller.f_code.co_filename,
            caller.f_lineno,
            message,
            None,
            None,
        )
    )


def note(line: str) -> None:
    """Appends `line` (already shown on the console: a run's last one, e.g. its `error:`
    line) to the log file this process's run has written and closed, if any."""
    if RUN_LOG.last_path and RUN_LOG.handler is None:
        # (OSError: a full disk; the console has it)
        with contextlib.suppress(OSError), open(RUN_LOG.last_path, "a", encoding="utf-8") as f:
            f.write(LogFileFormat().format(printed(line)) + "\n")


class _OtherThreadsTo:
    """sys.stderr for a quiet console with a log file: what the main thread and bertjax's own
    threads (named `bertjax-...`, e.g. the stop watchdog's exit line) write goes to the
    console, what other threads write (the tracebacks a library's background writer prints
    itself) to the log file, under its handler's lock: a text file is not safe to write from
    several threads at once (Orbax's writers of a failed save print their tracebacks
    together, and unlocked writes interleaved them and once left bytes that are not UTF-8)."""

    def __init__(self, log: std_logging.StreamHandler, console: TextIO) -> None:
        self.log, self.console = log, console

    def write(self, text: str) -> int:
        thread = threading.current_thread()
        if thread is threading.main_thread() or thread.name.startswith("bertjax-"):
            return self.console.write(text)
        # (typeshed types Handler.lock Optional; Handler.__init__ always creates it)
        with self.log.lock, contextlib.suppress(OSError, ValueError):  # type: ignore[union-attr]
            self.log.stream.write(text)
            self.log.stream.flush()
        return len(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.console, name)


def configure_console(verbosity: int = 0) -> None:
    """The one place that decides what the libraries may print (every entry point calls it).
    Verbosity 0 (the default): QuietLibraries and plain lines; 1 or more (`--verbosity=1`):
    absl's full log of every library, DEBUG included. From here on, what the console shows
    and the records at INFO or above are kept for a run's log file (`logging_to`). On a
    host without accelerators, JAX uses the CPU without trying the others
    (`backend_env.cpu_unless_accelerated`)."""
    backend_env.cpu_unless_accelerated()
    logging.use_absl_handler()
    handler = logging.get_absl_handler()
    if verbosity >= 1:
        logging.set_verbosity(logging.DEBUG)
    elif not any(isinstance(f, QuietLibraries) for f in handler.filters):
        handler.addFilter(QuietLibraries())
        handler.setFormatter(ConsoleFormat())
    if RUN_LOG.early is None:
        RUN_LOG.early = collections.deque(maxlen=EARLY_RECORDS)
        early = _Early()
        early.setLevel(std_logging.INFO)
        std_logging.getLogger().addHandler(early)
        sys.stdout = _Echo(sys.stdout)
