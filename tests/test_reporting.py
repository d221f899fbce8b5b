"""What a run tells its operator: the steady ETA, the terminal's status line and the console
filter that keeps the libraries' INFO chatter out."""

import io
import logging
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bertjax.runtime import console, failures, files
from bertjax.training import reporting
from bertjax.training.phase_schedule import Phase

PHASES = [Phase("short", 128, 20, 32, 0, 90), Phase("long", 512, 80, 32, 90, 100)]


def test_step_clock_excludes_compilation_and_pauses():
    clock = reporting.StepClock()
    clock.tick("short", 1, now=0.0)  # step 1 compiled: it only starts the clock
    assert clock.seconds_per_step("short") is None
    for step, now in [(2, 30.0), (3, 30.5), (4, 31.0), (5, 31.5), (6, 40.0), (7, 40.5)]:
        clock.tick("short", step, now=now)  # 2 waited for data, 6 for an evaluation
    assert clock.seconds_per_step("short") == 0.5  # the median ignores both pauses
    clock.tick("short", 10, now=42.0)  # a window of 3 steps (fine-tuning's logging)
    clock.tick("long", 91, now=60.0)  # another phase: its own clock, started by its compile
    assert clock.seconds_per_step("long") is None


def test_eta_covers_every_phase_and_estimates_the_unmeasured_one():
    clock = reporting.StepClock()
    for step in range(1, 12):
        clock.tick("short", step, now=float(step))  # 1 s per step
    cost = {"short": 1.0, "long": 4.0}
    # 79 short steps at 1 s, then 10 long steps estimated at 4 s (the cost ratio).
    assert reporting.eta_seconds(clock, PHASES, 11, cost) == pytest.approx(79 + 40)
    for step, now in [(91, 100.0), (92, 103.0), (93, 106.0)]:
        clock.tick("long", step, now=now)  # measured: 3 s per long step
    assert reporting.eta_seconds(clock, PHASES, 93, cost) == pytest.approx(7 * 3)
    assert reporting.eta_seconds(reporting.StepClock(), PHASES, 0, cost) is None


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_only_on_a_terminal(monkeypatch, capsys):
    line = console.TerminalLine()
    line.show("hidden")  # pytest's captured stdout is not a terminal
    assert capsys.readouterr().out == "" and not line.shown
    terminal = Terminal()
    monkeypatch.setattr("sys.stdout", terminal)
    line.show(reporting.status_bar(25, 100, 65.0, width=8))
    assert terminal.getvalue() == "\r\033[K25/100 |##......| 25% eta 1m05s"
    line.clear()
    assert terminal.getvalue().endswith("\r\033[K") and not line.shown


def record(pathname: str, level: int, message: str) -> logging.LogRecord:
    return logging.LogRecord("absl", level, pathname, 1, message, None, None)


def test_console_keeps_our_lines_and_library_warnings_only():
    quiet = console.QuietLibraries()
    ours = os.path.join(console.PACKAGE_DIR, "data", "pipeline.py")
    orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    assert quiet.filter(record(ours, logging.INFO, "Prepared data for phase short"))
    assert not quiet.filter(record(orbax, logging.INFO, "CheckpointManager created"))
    assert not quiet.filter(
        record(
            "/site-packages/jax/_src/xla_bridge.py",
            logging.INFO,
            "Unable to initialize backend 'tpu'",
        )
    )
    assert quiet.filter(record(orbax, logging.WARNING, "Checkpoint write failed"))
    assert not quiet.filter(
        record(
            "/site-packages/orbax/checkpoint/_src/checkpoint.py",
            logging.WARNING,
            "Metadata file does not exist: /x/state",
        )
    )
    formatter = console.ConsoleFormat()
    assert formatter.format(record(ours, logging.INFO, "hello")) == "hello"
    assert formatter.format(record(orbax, logging.WARNING, "disk")) == "warning (orbax): disk"
    assert formatter.format(record(ours, logging.ERROR, "no space")) == "error: no space"


def test_with_a_log_file_library_errors_and_other_threads_tracebacks_go_there_only(
    tmp_path, monkeypatch, capsys
):
    """While a run's log file is open: a library's error (with its traceback) reaches the file
    and not the console; what another thread writes to stderr (a library printing its own
    traceback) goes to the file, the main thread's writes to the console. Afterwards the
    console is as before."""
    from absl import logging as absl_logging

    quiet = console.QuietLibraries()
    monkeypatch.setattr(absl_logging.get_absl_handler(), "filters", [quiet])
    orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    ours = os.path.join(console.PACKAGE_DIR, "train.py")
    path = str(tmp_path / "log.txt")
    with console.logging_to(path):
        assert quiet.log_file == path and not quiet.filter(record(orbax, logging.ERROR, "x"))
        assert quiet.filter(record(ours, logging.ERROR, "our one line"))
        try:
            raise ValueError("RESOURCE_EXHAUSTED [os_error_code='28']")
        except ValueError:
            logging.getLogger("orbax").error("save failed", exc_info=True)
        thread = threading.Thread(target=lambda: sys.stderr.write("Traceback (thread)\n"))
        thread.start()
        thread.join()
        sys.stderr.write("main thread line\n")
    assert quiet.log_file is None and quiet.filter(record(orbax, logging.ERROR, "x"))
    log = Path(path).read_text()
    assert "save failed" in log and "Traceback (most recent call last)" in log
    assert "Traceback (thread)" in log and "main thread line" not in log
    assert capsys.readouterr().err == "main thread line\n"


def test_threads_writing_tracebacks_at_once_leave_every_line_whole_in_the_log(
    tmp_path, monkeypatch
):
    """Orbax's writers of a failed save print their tracebacks at the same moment while the
    main thread logs: every write reaches the log file whole and once, and the file is UTF-8
    (unlocked, such writes interleaved, and once left a byte that was not)."""
    from absl import logging as absl_logging

    monkeypatch.setattr(absl_logging.get_absl_handler(), "filters", [console.QuietLibraries()])
    path = tmp_path / "log.txt"
    threads, writes = 8, 400
    expected = {
        f"thread {t} write {w} \u00e9\u2014\u2026 " + "x" * (w % 97)
        for t in range(threads)
        for w in range(writes)
    }
    with console.logging_to(str(path)):
        workers = [
            threading.Thread(
                target=lambda t=t: [
                    sys.stderr.write(
                        f"thread {t} write {w} \u00e9\u2014\u2026 " + "x" * (w % 97) + "\n"
                    )
                    for w in range(writes)
                ]
            )
            for t in range(threads)
        ]
        for worker in workers:
            worker.start()
        for n in range(writes):
            logging.getLogger("orbax").warning("record %d \u00e9", n)
        for worker in workers:
            worker.join()
    lines = path.read_bytes().decode("utf-8").splitlines()
    written = [line for line in lines if line.startswith("thread ")]
    assert sorted(written) == sorted(expected)
    assert sum(" record " in line for line in lines) == writes


def test_a_library_error_text_names_its_os_error():
    """TensorStore's RESOURCE_EXHAUSTED text becomes the OSError it reports."""
    error = ValueError(
        'RESOURCE_EXHAUSTED: Error writing "a" in OCDBT database: Failed writing: '
        '"/w/checkpoints/8.orbax-checkpoint-tmp/d/3f": Failed to write 25 bytes to '
        "file 57: No space left on device [os_error_code='28']"
    )
    assert failures.os_error_line(failures.library_os_error(error)) == (
        "No space left on device: /w/checkpoints/8.orbax-checkpoint-tmp/d/3f (free some space, "
        "then rerun the same command to resume)"
    )
    assert failures.library_os_error(ValueError("INTERNAL: something else")) is None


def test_an_append_that_does_not_fit_leaves_no_partial_line(tmp_path, monkeypatch):
    """A full disk takes half of an appended row (os.write writes part of it and returns the
    count, no error): before, the half line stayed and a resumed fine-tuning then failed to
    read metrics.jsonl with a traceback. Now the part is taken back, and it is ENOSPC."""
    path = tmp_path / "metrics.jsonl"
    files.write_text(str(path), '{"step": 1}\n', append=True)
    write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: write(fd, data[: len(data) // 2]))
    with pytest.raises(OSError) as raised:
        files.write_text(str(path), '{"step": 2, "loss": 0.5}\n', append=True)
    monkeypatch.undo()
    assert failures.os_error_line(raised.value).startswith(f"No space left on device: {path} (")
    assert path.read_text() == '{"step": 1}\n'


def test_the_log_file_keeps_every_printed_line_and_the_last_one(tmp_path, capsys):
    """While a run's log file is open, each line printed (also in pieces, or several in one
    write) is in it with its time, the terminal's status line is not; the console shows the
    same as without it; a line noted after the file closed (the run's `error:`) goes at its
    end."""
    path = tmp_path / "log.txt"
    with console.logging_to(str(path)):
        print("Model: 1,234 parameters", flush=True)
        sys.stdout.write("step 1/4 loss 9.7")
        sys.stdout.write("\r\033[K1/4 |##......| 25%")  # (a status line is never mid-line)
        sys.stdout.write("\nDone in 0m01s\n  /w/log.txt: the full log\n")
    console.note("error: no space left")
    assert capsys.readouterr().out == (
        "Model: 1,234 parameters\nstep 1/4 loss 9.7"
        "\r\033[K1/4 |##......| 25%\nDone in 0m01s\n"
        "  /w/log.txt: the full log\n"
    )
    lines = path.read_text().splitlines()
    assert [line.split(" console] ", 1)[1] for line in lines] == [
        "Model: 1,234 parameters",
        "step 1/4 loss 9.7",
        "Done in 0m01s",
        "  /w/log.txt: the full log",
        "error: no space left",
    ]
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} console] ", line) for line in lines)


def test_a_log_file_on_a_full_disk_costs_the_console_nothing(capsys):
    """/dev/full (every write fails with ENOSPC) as the log file: the printed lines reach the
    console, with no `--- Logging error ---` traceback, and noting the last line is silent."""
    with console.logging_to("/dev/full"):
        print("step 1/4 loss 9.7", flush=True)
        logging.getLogger("orbax").info("Saving checkpoint at step 4")
    console.note("error: no space left")
    captured = capsys.readouterr()
    assert captured.out == "step 1/4 loss 9.7\n" and captured.err == "", captured


def test_errors_python_can_only_ignore_stay_off_the_console(tmp_path):
    """Issue 43: an init_checkpoint that failed to restore printed 7 to 18 tracebacks of the
    reads Orbax had in flight, completing on its closed event loop (reported from native
    threads) or collected at exit ("Exception ignored in: <coroutine ...>"). Those go to the
    log now; a bug's traceback in the main thread still reaches the console."""
    script = """if True:
        import sys, threading
        from bertjax.runtime import failures
        failures.one_line_thread_errors()
        class Abandoned:
            def __del__(self):
                raise RuntimeError("Event loop is closed (collected)")
        Abandoned()
        def native_callback():
            try:
                raise RuntimeError("Event loop is closed (a native thread)")
            except RuntimeError:
                sys.excepthook(*sys.exc_info())
        thread = threading.Thread(target=native_callback)
        thread.start()
        thread.join()
        raise ValueError("a bug")
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": root},
        timeout=60,
        check=False,
    )
    assert "Event loop is closed" not in result.stderr, result.stderr
    assert result.stderr.rstrip().endswith("ValueError: a bug"), result.stderr
