"""File locks between real processes: a live holder is named and refused (or waited for), a
lock left by a dead process is taken over, and two processes preparing the same cache entry
prepare it once and read the same data."""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from bertjax import locks
from bertjax.data import pipeline
from test_pipeline import config, corpus_file, documents, short_phase  # noqa: F401 (fixtures)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys, time\nfrom bertjax import locks\n"
        "with locks.exclusive(sys.argv[1], 'the test lock'):\n"
        "    print('held', flush=True)\n    time.sleep(float(sys.argv[2]))\n")


def holder(path: str, seconds: float) -> subprocess.Popen:
    """Another process that holds the lock `path` for `seconds` (started when this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path, str(seconds)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": REPO_ROOT}, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_holder_is_named_and_a_dead_ones_lock_taken_over(tmp_path):
    path = str(tmp_path / "run.lock")
    proc = holder(path, 60)
    try:
        with pytest.raises(locks.LockHeld, match=rf"the test lock is in use by pid {proc.pid} on "
                                                 r"host .* \(started .*\) \(lock file "):
            with locks.exclusive(path, "the test lock"):
                pass
    finally:
        proc.kill()  # dies holding it: the lock file still names it
        proc.wait()
    assert json.loads(open(path).read())["pid"] == proc.pid
    with locks.exclusive(path, "the test lock") as stale:
        assert stale["pid"] == proc.pid and not locks.pid_alive(proc.pid)
        assert json.loads(open(path).read())["pid"] == os.getpid()
    assert open(path).read() == ""  # released cleanly: nothing stale for the next one
    with locks.exclusive(path, "the test lock") as stale:
        assert stale is None


def test_a_waiting_process_gets_the_lock_when_the_holder_ends(tmp_path):
    path = str(tmp_path / "entry.lock")
    proc = holder(path, 1.0)
    start = time.time()
    with locks.exclusive(path, "the entry", wait=True) as stale:
        waited = time.time() - start
    proc.wait()
    assert stale is None and 0.3 < waited < 30


def test_two_processes_preparing_one_cache_entry_prepare_it_once(config, tmp_path):
    """A second process that finds the entry being prepared waits and reuses it: one
    preparation (the first's directory, renamed in place), the same rows in both, as many
    as meta.json counts."""
    cache = str(tmp_path / "cache")
    tokenizer = pipeline.load_or_train_tokenizer(config.data, cache)  # both find it there
    script = ("import sys\nsys.path.insert(0, 'tests')\n"
              "import test_pipeline as t\nfrom bertjax.data import pipeline\n"
              "c = t.make_config(sys.argv[1])\n"
              "tok = pipeline.load_or_train_tokenizer(c.data, sys.argv[2])\n"
              "print(len(pipeline.prepare(c.data, t.short_phase(c), tok, sys.argv[2])['train']))\n")
    first = subprocess.Popen([sys.executable, "-c", script, config.data.input_files, cache],
                             cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                             stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (building := [n for n in os.listdir(cache) if n.startswith("short_") and ".tmp" in n]):
        assert first.poll() is None and time.time() < deadline, "the first never prepared"
        time.sleep(0.005)
    assert building[0].endswith(f".tmp{first.pid}")
    inode = os.stat(os.path.join(cache, building[0])).st_ino
    second = pipeline.prepare(config.data, short_phase(config), tokenizer, cache)
    assert first.wait(120) == 0 and int(first.stdout.read()) == len(second["train"])
    (directory,) = [n for n in os.listdir(cache) if n.startswith("short_")]
    assert os.stat(os.path.join(cache, directory)).st_ino == inode  # the first's preparation
    meta = json.load(open(os.path.join(cache, directory, "meta.json")))
    assert meta["train_instances"] == len(second["train"])
    again = pipeline.prepare(config.data, short_phase(config), tokenizer, cache)
    np.testing.assert_array_equal(again["train"].features["input_ids"],
                                  second["train"].features["input_ids"])
