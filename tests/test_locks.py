"""File locks between real processes: a live holder is named and refused (or waited for), a
lock left by a dead process is taken over (and logged), and two processes preparing the same
cache entry prepare it once and read the same data. The other processes hold their lock until
the test releases them (a line on their stdin), so that the waiting paths are always taken."""

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from absl import logging as absl_logging

from bertjax.data import corpus_source, pipeline
from bertjax.data.settings import DataSettings
from bertjax.runtime import locks
from test_pipeline import config, corpus_file, documents, short_phase  # noqa: F401 (fixtures)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = (
    "import sys\nfrom bertjax.runtime import locks\n"
    "with locks.exclusive(sys.argv[1], 'the test lock'):\n"
    "    print('held', flush=True)\n    sys.stdin.readline()\n"
)
TIMEOUT = 120  # seconds; only a failing test waits this long


def start(args: list[str]) -> subprocess.Popen:
    """A Python process whose stdin (to release it) and stdout the test holds."""
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def holder(path: str) -> subprocess.Popen:
    """Another process that holds the lock `path` until released or killed."""
    proc = start(["-c", HOLD, path])
    assert proc.stdout.readline().strip() == "held"
    return proc


class Warnings(logging.Handler):
    """Collects bertjax's warnings (absl's logger); `seen(text)` waits for one containing it."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self._new = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self._new:
            self.messages.append(record.getMessage())
            self._new.notify_all()

    def seen(self, text: str) -> bool:
        with self._new:
            return self._new.wait_for(lambda: any(text in m for m in self.messages), TIMEOUT)


@contextlib.contextmanager
def warnings() -> Iterator[Warnings]:
    handler = Warnings()
    logger = absl_logging.get_absl_logger()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def in_thread(function) -> tuple[threading.Thread, list]:
    """Runs `function` in a started thread; the list gets its result."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    return thread, result


def test_a_live_holder_is_named_and_a_dead_ones_lock_taken_over(tmp_path):
    path = str(tmp_path / "run.lock")
    proc = holder(path)
    try:
        with (
            pytest.raises(
                locks.LockHeld,
                match=rf"the test lock is in use by pid {proc.pid} on "
                r"host .* \(started .*\) \(lock file ",
            ),
            locks.exclusive(path, "the test lock"),
        ):
            pass
    finally:
        proc.kill()  # dies holding it: the lock file still names it
        proc.wait()
    assert json.loads(Path(path).read_text())["pid"] == proc.pid
    with warnings() as logged, locks.exclusive(path, "the test lock") as stale:
        assert stale["pid"] == proc.pid and not locks.pid_alive(proc.pid)
        assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    taken_over = f"Taking over the lock of the test lock on {path}: pid {proc.pid} on host "
    assert len(logged.messages) == 1 and logged.messages[0].startswith(taken_over), logged.messages
    assert Path(path).read_text() == ""  # released cleanly: nothing stale for the next one
    with locks.exclusive(path, "the test lock") as stale:
        assert stale is None


def test_a_waiting_process_gets_the_lock_when_the_holder_ends(tmp_path):
    path = str(tmp_path / "entry.lock")
    proc = holder(path)
    released = threading.Event()

    def wait_for_the_lock():
        with locks.exclusive(path, "the entry", wait=True) as stale:
            return stale, released.is_set(), json.loads(open(path).read())["pid"]

    with warnings() as logged:
        thread, result = in_thread(wait_for_the_lock)
        assert logged.seen(f"the entry is in use by pid {proc.pid} on host "), logged.messages
        assert thread.is_alive()  # waiting
        released.set()
        proc.stdin.close()  # the holder leaves its `with` block and exits
        thread.join(TIMEOUT)
    assert proc.wait(TIMEOUT) == 0
    assert result == [(None, True, os.getpid())]  # got it only after the release, not stale


def test_two_processes_preparing_one_cache_entry_prepare_it_once(config, tmp_path):
    """A second process that finds the entry being prepared waits and reuses it: one
    preparation (the first's directory, renamed in place), the same rows in both, as many
    as meta.json counts. The first pauses with its data written, before meta.json."""
    cache = str(tmp_path / "cache")
    tokenizer = corpus_source.load_or_train_tokenizer(
        DataSettings.of(config.data), cache
    )  # both find it there
    script = (
        "import sys\nsys.path.insert(0, 'tests')\n"
        "import test_pipeline as t\nfrom bertjax.data import corpus_source, pipeline\n"
        "from bertjax.data.settings import DataSettings\n"
        "from bertjax.data import prepared_files\n"
        "records = prepared_files.shard_records\n"
        "def pause(directory):\n"
        "    print(directory, flush=True)\n    sys.stdin.readline()\n"
        "    return records(directory)\n"
        "prepared_files.shard_records = pause\n"
        "c = t.make_config(sys.argv[1])\n"
        "tok = corpus_source.load_or_train_tokenizer(DataSettings.of(c.data), sys.argv[2])\n"
        "print(len(pipeline.prepare(DataSettings.of(c.data), t.short_phase(c), tok, sys.argv[2])['train']))\n"
    )
    first = start(["-c", script, config.data.input_files, cache])
    building = first.stdout.readline().strip()
    assert building.endswith(f".tmp{first.pid}") and os.path.isdir(building), building
    inode = os.stat(building).st_ino
    with warnings() as logged:
        thread, result = in_thread(
            lambda: pipeline.prepare(
                DataSettings.of(config.data), short_phase(config), tokenizer, cache
            )
        )
        assert logged.seen(f"is in use by pid {first.pid} on host "), logged.messages
        assert thread.is_alive()  # waiting for the first
        first.stdin.close()
        thread.join(TIMEOUT)
    (second,) = result
    assert first.wait(TIMEOUT) == 0 and int(first.stdout.read()) == len(second["train"])
    (directory,) = [n for n in os.listdir(cache) if n.startswith("short_")]
    assert os.path.join(cache, directory) == building.rsplit(".tmp", 1)[0]
    assert os.stat(os.path.join(cache, directory)).st_ino == inode  # the first's preparation
    meta = json.loads(Path(os.path.join(cache, directory, "meta.json")).read_text())
    assert meta["train_instances"] == len(second["train"])
    again = pipeline.prepare(DataSettings.of(config.data), short_phase(config), tokenizer, cache)
    np.testing.assert_array_equal(
        again["train"].features["input_ids"], second["train"].features["input_ids"]
    )
