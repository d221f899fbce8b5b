"""Fault injection on real `python -m bertjax.train` processes: SIGTERM (preemption), kill -9
at a random step and during an async checkpoint write, and the loss of one process of a
two-process job. Every resumed run's per-step losses must equal, bit for bit, those of one
uninterrupted reference run (shared by the tests of this module)."""
import contextlib
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from bertjax import distributed
from test_train import base_config, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_STEPS = 24  # 18 short-phase steps, then 6 long-phase ones
STEP_LINE = re.compile(r"^step (\d+)/")
# Compiled programs are shared between the runs through JAX's persistent cache.
COMPILE_CACHE = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def command_line(corpus_file: str, cache_dir: str, workdir: str, **overrides) -> list[str]:
    """`python -m bertjax.train` with test_train's tiny config, as command-line overrides."""
    config = tiny_config(corpus_file, cache_dir, **{"train.total_steps": TOTAL_STEPS,
                                                    "train.keep_checkpoints": 3, **overrides})
    defaults = base_config()
    flags = [f"--config.{section}.{field}={value}"
             for section in config for field, value in config[section].items()
             if value != defaults[section][field]]
    return [sys.executable, "-m", "bertjax.train", "--config=configs/base.py",
            f"--workdir={workdir}", *flags]


class Trainer:
    """One training subprocess (one CPU device) whose output lines are read by a thread."""

    def __init__(self, args: list[str], extra_env: dict | None = None):
        env = {**os.environ, "PYTHONPATH": REPO_ROOT, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=1", **COMPILE_CACHE,
               **(extra_env or {})}
        self.proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._queue.put(line)
        self._queue.put(None)

    def wait_for_step(self, step: int, timeout: float = 240) -> None:
        """Blocks until the process has logged step `step` (or later)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, f"exited before step {step}:\n{self.output()}"
            match = STEP_LINE.match(line)
            if match and int(match.group(1)) >= step:
                return
        raise AssertionError(f"no step {step} within {timeout} s:\n{self.output()}")

    def finish(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def output(self, last_chars: int | None = 4000) -> str:
        """What the run printed (its end, for assertion messages; None: all of it)."""
        text = "".join(self.lines)
        return text if last_chars is None else text[-last_chars:]


def run_to_end(args: list[str]) -> str:
    trainer = Trainer(args)
    assert trainer.finish() == 0, trainer.output()
    return trainer.output(last_chars=None)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    """Prepared data and, through the environment, compiled programs of this module's runs."""
    COMPILE_CACHE["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("jax_cache"))
    return str(tmp_path_factory.mktemp("faults_cache"))


@pytest.fixture(scope="module")
def reference(corpus_file, cache_dir, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of the uninterrupted run (it also prepares the shared data cache)."""
    workdir = tmp_path_factory.mktemp("reference")
    run_to_end(command_line(corpus_file, cache_dir, str(workdir)))
    losses = {m["step"]: m["loss"] for m in read_metrics(workdir)}
    assert sorted(losses) == list(range(1, TOTAL_STEPS + 1))
    return losses


def assert_matches_reference(workdir, reference: dict[int, float]) -> list[int]:
    """Every logged loss equals the reference's at its step, and the run got to the end."""
    records = read_metrics(workdir)
    for m in records:
        assert m["loss"] == reference[m["step"]], (m["step"], m["loss"], reference[m["step"]])
    assert records[-1]["step"] == TOTAL_STEPS and {m["step"] for m in records} == set(reference)
    return [m["step"] for m in records]


def kill_during_a_checkpoint_write(trainer: Trainer, directory: str, timeout: float = 240) -> str:
    """SIGKILLs `trainer` while Orbax writes a checkpoint: the process is frozen (SIGSTOP) as
    soon as a temporary checkpoint directory appears, and killed if it is still there."""
    trainer.wait_for_step(1)  # past startup, which removes unfinished checkpoints of earlier runs
    deadline = time.time() + timeout
    while time.time() < deadline and trainer.proc.poll() is None:
        if any("tmp" in name for name in os.listdir(directory)):
            trainer.proc.send_signal(signal.SIGSTOP)
            unfinished = [name for name in os.listdir(directory) if "tmp" in name]
            if unfinished:
                trainer.proc.kill()
                trainer.finish()
                return unfinished[0]
            trainer.proc.send_signal(signal.SIGCONT)
        time.sleep(0.0005)
    raise AssertionError(f"no checkpoint write caught in progress:\n{trainer.output()}")


def resumed_step(output: str) -> int:
    resumed = re.search(r"Resuming from .* at step (\d+)", output)
    assert resumed, f"the run did not resume:\n{output}"
    return int(resumed.group(1))


@contextlib.contextmanager
def read_only(directory: str):
    """No new files in `directory`, even for root (chattr +i), else by permissions."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", directory], capture_output=True).returncode:
            pytest.skip("running as root on a filesystem without chattr +i")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", directory], check=True)
    else:
        os.chmod(directory, 0o555)
        try:
            yield
        finally:
            os.chmod(directory, 0o755)


def test_sigterm_and_kill_9_anywhere_resume_exactly(corpus_file, cache_dir, reference, tmp_path):
    """One work directory, five runs: SIGTERM (a preemption notice) after step 3 saves at the
    next step boundary and exits 0; a run with the checkpoint directory read-only stops at
    its first save with one clear error, leaving the checkpoints as they were; the next run
    is killed with -9 at a random step; the next one with -9 while a checkpoint is being
    written; the last runs to the end. Every loss any of them logged equals the
    uninterrupted run's."""
    # JAX agrees on the preemption sync step through the coordination service in a
    # background thread; this test model's steps take about a millisecond, so on a loaded
    # machine the loop can pass the agreed step before the agreement lands. Such a run ends
    # normally with its final checkpoint (nothing lost); retry it in a fresh directory.
    for attempt in range(3):
        workdir = tmp_path / f"run{attempt}"
        args = command_line(corpus_file, cache_dir, str(workdir))
        directory = str(workdir / "checkpoints")
        trainer = Trainer(args)
        trainer.wait_for_step(3)
        sent = time.time()
        trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.finish(timeout=60) == 0, trainer.output()
        seconds = time.time() - sent
        saved = re.search(r"Preemption notice: saving a checkpoint at step (\d+)",
                          trainer.output())
        if saved:
            break
        assert str(TOTAL_STEPS) in os.listdir(directory), trainer.output()
        print(f"\nattempt {attempt}: the sync step passed before it was agreed; ran to the end")
    assert saved and saved.group(1) in os.listdir(directory), trainer.output()
    print(f"\nSIGTERM after step 3: checkpoint at step {saved.group(1)}, exit 0 after "
          f"{seconds:.2f} s")

    before = sorted(os.listdir(directory))
    with read_only(directory):
        trainer = Trainer(args)
        assert trainer.finish(timeout=120) == 1, trainer.output()
    errors = [line for line in trainer.lines if line.startswith("error: ")]
    assert len(errors) == 1 and f"saving a checkpoint in {directory} failed" in errors[0]
    assert sorted(os.listdir(directory)) == before
    print(f"read-only checkpoints: {errors[0].strip()}")

    kill_step = random.Random().randint(int(saved.group(1)) + 1, TOTAL_STEPS - 6)
    trainer = Trainer(args)
    trainer.wait_for_step(kill_step)
    trainer.proc.kill()
    assert trainer.finish() == -signal.SIGKILL
    assert resumed_step(trainer.output()) == int(saved.group(1))
    print(f"kill -9 after step {kill_step}: left {sorted(os.listdir(directory))}")

    trainer = Trainer(args)
    unfinished = kill_during_a_checkpoint_write(trainer, directory)
    print(f"kill -9 while writing {unfinished}: left {sorted(os.listdir(directory))}")

    output = run_to_end(args)
    assert resumed_step(output) < int(unfinished.split(".")[0])  # the half-written one is skipped
    assert not any("tmp" in name for name in os.listdir(directory))  # and removed
    steps = assert_matches_reference(workdir, reference)
    print(f"steps logged by the five runs: {steps}")


def test_losing_a_peer_stops_the_survivor_and_a_restart_resumes(corpus_file, cache_dir,
                                                                  tmp_path):
    """Two processes (jax.distributed on localhost, a 5 s heartbeat timeout): after process 1
    is killed, process 0 exits non-zero within the timeout instead of hanging; restarting
    both resumes from the last checkpoint and re-logs the lost steps with the same losses."""
    args = command_line(corpus_file, cache_dir, str(tmp_path), **{
        "train.total_steps": 12, "long_phase.fraction": 0.0})
    heartbeat = 5

    def start_job() -> list[Trainer]:
        port = distributed.free_port()
        return [Trainer(args + [f"--coordinator_address=localhost:{port}", "--num_processes=2",
                                f"--process_id={i}", f"--heartbeat_timeout_seconds={heartbeat}"])
                for i in range(2)]

    survivor, victim = start_job()
    survivor.wait_for_step(6)
    # Step 4's checkpoint is written in the background; on a loaded machine it may still be
    # uncommitted at step 6. Kill once it is committed, so that the restart has it to resume.
    deadline = time.time() + 120
    while not os.path.isdir(tmp_path / "checkpoints" / "4") and time.time() < deadline:
        time.sleep(0.05)
    victim.proc.kill()
    killed = time.time()
    code = survivor.finish(timeout=heartbeat + 60)
    seconds = time.time() - killed
    assert code != 0 and seconds < heartbeat + 30, (code, seconds, survivor.output())
    print(f"\npeer killed after step 6: survivor exited {code} after {seconds:.1f} s "
          f"(heartbeat timeout {heartbeat} s)")
    lost_steps = {m["step"]: m["loss"] for m in read_metrics(tmp_path)}

    job = start_job()
    for trainer in job:
        assert trainer.finish() == 0, trainer.output()
    start = resumed_step(job[0].output())
    records = read_metrics(tmp_path)
    assert records[-1]["step"] == 12 and start < max(lost_steps)
    for m in records:
        assert m["loss"] == lost_steps.get(m["step"], m["loss"]), m


def test_a_second_run_in_the_workdir_is_refused_and_ctrl_c_saves(corpus_file, cache_dir,
                                                                   reference, tmp_path):
    """While a run trains (held with SIGSTOP after its first step, so that it cannot finish
    first), a second one in the same workdir exits at once with one line naming it (pid,
    host). Ctrl-C then makes the first save at the end of its step and exit 0; the rerun
    resumes, and every loss the two runs logged equals the uninterrupted run's."""
    args = command_line(corpus_file, cache_dir, str(tmp_path))
    first = Trainer(args)
    first.wait_for_step(1)
    first.proc.send_signal(signal.SIGSTOP)
    second = Trainer(args)
    assert second.finish(timeout=120) == 1, second.output()
    errors = [line for line in second.lines if line.startswith("error: ")]
    assert len(errors) == 1 and f"is in use by pid {first.proc.pid} on host" in errors[0], \
        second.output()
    print(f"\nsecond run: {errors[0].strip()}")
    first.proc.send_signal(signal.SIGINT)
    first.proc.send_signal(signal.SIGCONT)
    assert first.finish(timeout=60) == 0, first.output()
    saved = re.search(r"Ctrl-C: saving a checkpoint at step (\d+) and exiting", first.output())
    assert saved and saved.group(1) in os.listdir(tmp_path / "checkpoints"), first.output()
    assert int(saved.group(1)) < TOTAL_STEPS and "Traceback" not in first.output()
    output = run_to_end(args)
    assert resumed_step(output) == int(saved.group(1))
    steps = assert_matches_reference(tmp_path, reference)
    print(f"Ctrl-C: saved step {saved.group(1)}; steps logged by the two runs: {steps}")


def test_a_second_ctrl_c_exits_at_once():
    script = ("import os, signal, time\nfrom bertjax import failures\n"
              "with failures.CtrlC(forward_as_sigterm=False) as ctrl_c:\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.1)\n"
              "    print('requested', ctrl_c.requested, flush=True)\n"
              "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(60)\n")
    start = time.time()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                            timeout=60)
    assert result.returncode == 130 and time.time() - start < 30
    assert "requested True" in result.stdout and "Second Ctrl-C" in result.stderr
