"""What a run tells its operator: the steady ETA, the terminal's status line and the console
filter that keeps the libraries' INFO chatter out."""
import io
import logging
import os

import pytest

from bertjax import reporting
from bertjax.schedule import Phase

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
    line = reporting.TerminalLine()
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
    quiet = reporting.QuietLibraries()
    ours = os.path.join(reporting.PACKAGE_DIR, "data", "pipeline.py")
    orbax = "/site-packages/orbax/checkpoint/checkpoint_manager.py"
    assert quiet.filter(record(ours, logging.INFO, "Prepared data for phase short"))
    assert not quiet.filter(record(orbax, logging.INFO, "CheckpointManager created"))
    assert not quiet.filter(record("/site-packages/jax/_src/xla_bridge.py", logging.INFO,
                                   "Unable to initialize backend 'tpu'"))
    assert quiet.filter(record(orbax, logging.WARNING, "Checkpoint write failed"))
    assert not quiet.filter(record("/site-packages/orbax/checkpoint/_src/checkpoint.py",
                                   logging.WARNING, "Metadata file does not exist: /x/state"))
    formatter = reporting.ConsoleFormat()
    assert formatter.format(record(ours, logging.INFO, "hello")) == "hello"
    assert formatter.format(record(orbax, logging.WARNING, "disk")) == "warning (orbax): disk"
    assert formatter.format(record(ours, logging.ERROR, "no space")) == "error: no space"
