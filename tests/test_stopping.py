"""Every process can be stopped (issue 34): SIGTERM and Ctrl-C end a process whose main thread
is stuck in native code, where Python's signal handlers never run, within BERTJAX_STOP_SECONDS,
with one line naming what it was stuck in; and JAX's preemption notifier, whose SIGTERM
handler bertjax.runtime.stopping takes over, still sees every notice."""

import ast
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Blocks the main thread in native code as XLA's waits do: a futex that a signal does not
# interrupt (POSIX: pthread_mutex_timedlock never fails with EINTR), so no Python signal handler
# runs until it returns. BLOCK_S seconds (or without end).
PRELUDE = """
import ctypes, os, sys, time
from bertjax.runtime import distributed, stopping
libc = ctypes.CDLL(None, use_errno=True)
mutex = ctypes.create_string_buffer(64)  # (zeroed: PTHREAD_MUTEX_INITIALIZER on glibc)
libc.pthread_mutex_lock(mutex)

class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

def block_natively(seconds):
    until = Timespec(int(time.time() + seconds), 0)
    libc.pthread_mutex_timedlock(mutex, ctypes.byref(until))

masks = [line.split()[1] for line in open("/proc/self/status")  # (blocked, ignored: as
         if line.startswith(("SigBlk", "SigIgn"))]                # started, before the watch)
stopping.watch()
print("ready", masks, flush=True)
"""


def start(body: str, grace_s: float) -> subprocess.Popen:
    """A Python process running PRELUDE then `body`, with BERTJAX_STOP_SECONDS=grace_s, once it
    printed `ready` (the watchdog started)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + body],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "JAX_PLATFORMS": "cpu",
            "BERTJAX_STOP_SECONDS": str(grace_s),
        },
    )
    ready = proc.stdout.readline().strip()
    assert ready.startswith("ready"), proc.communicate()
    proc.signal_masks = ready  # (blocked, ignored: for the messages below)
    return proc


def stop_stuck(proc: subprocess.Popen, signum: int) -> tuple[int, float, str, str]:
    """Sends `signum` once the process says it is stuck; its status, the seconds it took to
    end, stdout and stderr."""
    assert proc.stdout.readline().strip() == "stuck"
    time.sleep(0.5)  # (in the native wait by now)
    sent = time.monotonic()
    proc.send_signal(signum)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(
            f"signal {signum} did not end the process; its signal masks at "
            f"the start: {proc.signal_masks}"
        ) from None
    return proc.returncode, time.monotonic() - sent, out, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_process_stuck_in_native_code_stops_within_the_grace_time(signum):
    """The main thread blocked without end in a native wait (as in a stalled save or a hung
    compilation): the signal ends the process after BERTJAX_STOP_SECONDS (3 s) with one line
    naming what it was doing and what a rerun does, and 128 + the signal's number. Before
    bertjax.runtime.stopping, both waited for ever."""
    proc = start(
        "distributed.initialize()\nstopping.take_sigterm()\n"
        "stopping.now_doing('building the model (compiling)')\n"
        "print('stuck', flush=True)\nlibc.pthread_mutex_lock(mutex)\n",
        grace_s=3,
    )
    status, seconds, out, err = stop_stuck(proc, signum)
    assert status == 128 + signum, (status, out, err)
    assert 3 <= seconds < 30, seconds
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
    assert errors == [
        f"error: stop requested ({name}) 3 s ago, but this process is still "
        "building the model (compiling) (outside bertjax's code); exiting "
        "without finishing it: a rerun of the same command resumes from the "
        "last complete checkpoint (to wait longer, set BERTJAX_STOP_SECONDS)"
    ], err
    assert "Traceback" not in err


def test_a_second_ctrl_c_ends_a_stuck_process_at_once():
    """A second Ctrl-C does not wait for the grace time (600 s here)."""
    proc = start(
        "stopping.now_doing('writing checkpoint 8')\nprint('stuck', flush=True)\n"
        "libc.pthread_mutex_lock(mutex)\n",
        grace_s=600,
    )
    assert proc.stdout.readline().strip() == "stuck"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 10, (proc.returncode, err)
    assert "Second Ctrl-C: exiting without saving" in out
    assert (
        "error: stopped by a second Ctrl-C while writing checkpoint 8; a rerun of the same "
        "command resumes from the last complete checkpoint" in err
    )


def test_jax_still_sees_a_sigterm_that_arrives_while_the_main_thread_is_stuck():
    """SIGTERM while the main thread is in a native wait for 2 s: once it returns, JAX's
    preemption sync point (where a run saves and stops) is reached: the watchdog passed the
    notice on to JAX's own handler. The process then ends normally, within the grace time."""
    proc = start(
        "distributed.initialize()\nstopping.take_sigterm()\n"
        "from jax.experimental import multihost_utils\n"
        "print('stuck', flush=True)\nblock_natively(2)\n"
        "for step in range(1, 200):\n"
        "    if multihost_utils.reached_preemption_sync_point(step):\n"
        "        print('sync point at step', step, flush=True)\n        break\n"
        "    time.sleep(0.1)\n",
        grace_s=60,
    )
    status, seconds, out, err = stop_stuck(proc, signal.SIGTERM)
    assert status == 0 and seconds < 30, (status, out, err)
    assert "sync point at step" in out, (out, err)


def test_a_process_started_with_ctrl_c_ignored_still_stops_on_it():
    """A non-interactive shell starts `cmd &` with SIGINT ignored, and the child inherits
    that (here: a launcher that ignores it and execs the child, as the shell does; not
    Popen's preexec_fn, whose fork in this multithreaded JAX process JAX warns of): the
    watchdog takes SIGINT back, so Ctrl-C stops it."""
    child = PRELUDE + "print('stuck', flush=True)\nlibc.pthread_mutex_lock(mutex)\n"
    launcher = (
        "import os, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "os.execv(sys.executable, [sys.executable, '-c', sys.argv[1]])\n"
    )
    jax.numpy.zeros(1).block_until_ready()  # (JAX running here, as in the whole suite)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proc = subprocess.Popen(
            [sys.executable, "-c", launcher, child],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO_ROOT,
            env={
                **os.environ,
                "PYTHONPATH": REPO_ROOT,
                "JAX_PLATFORMS": "cpu",
                "BERTJAX_STOP_SECONDS": "2",
            },
        )
    assert not [w for w in caught if "os.fork()" in str(w.message)]
    ready = proc.stdout.readline()
    # (blocked, ignored): SIGINT ignored
    assert ready.startswith("ready") and int(ast.literal_eval(ready[5:])[1], 16) & 2, ready
    proc.signal_masks = ready
    status, _seconds, _, err = stop_stuck(proc, signal.SIGINT)
    assert status == 130 and "error: stop requested (Ctrl-C) 2 s ago" in err, (status, err)


def test_a_malformed_grace_time_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "bertjax.train", "--config=configs/tiny.py", "--workdir=unused"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={
            **os.environ,
            "PYTHONPATH": REPO_ROOT,
            "JAX_PLATFORMS": "cpu",
            "BERTJAX_STOP_SECONDS": "soon",
        },
        timeout=120,
        check=False,
    )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: environment variable BERTJAX_STOP_SECONDS='soon' is not a number of seconds"
    ), result.stderr


CTRL_C_WHILE_WRITING = """
import os, signal, sys, threading, time
from bertjax.runtime import console, failures

def ctrl_c_soon():  # (once the main thread is writing)
    time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGINT)

console.configure_console(0)
with console.logging_to(sys.argv[1]):
    for _ in range(int(sys.argv[2])):
        with failures.CtrlC(forward_as_sigterm=False) as ctrl_c:
            sender = threading.Thread(target=ctrl_c_soon)
            sender.start()
            while not ctrl_c.requested:
                sys.stdout.write("a line the main thread writes\\n")
            sender.join()
"""


def test_the_ctrl_c_notice_reaches_the_log_whatever_the_main_thread_was_writing(tmp_path):
    """Ctrl-C's notice is printed by a thread, not inside the signal handler: a handler runs
    inside whatever the main thread was doing, and its write into a log write it interrupted
    was dropped ("reentrant call inside BufferedWriter"; a fine-tuning run's log.txt lacked
    the line once in CI). Here each of 300 Ctrl-Cs lands while the main thread writes lines."""
    path, rounds = str(tmp_path / "log.txt"), 300
    done = subprocess.run(
        [sys.executable, "-c", CTRL_C_WHILE_WRITING, path, str(rounds)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = Path(path).read_text(encoding="utf-8")
    assert log.count("Ctrl-C: saving a checkpoint at the end of this step, then exiting") == rounds
