"""Fault injection on real `python -m bertjax.train` processes: SIGTERM (preemption), kill -9
at a random step and during an async checkpoint write, and the loss of one process of a
two-process job. Every resumed run's per-step losses must equal, bit for bit, those of one
uninterrupted reference run (shared by the tests of this module)."""

import contextlib
import os
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import injected_faults
from test_train import base_config, corpus_file, read_metrics, tiny_config  # noqa: F401 (fixture)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_STEPS = 24
SHORT_STEPS = 18  # then 6 long-phase ones
CHECKPOINT_EVERY = 4  # test_train's tiny config
PREEMPTED = CHECKPOINT_EVERY  # the step that SIGTERM saves at
SEED_VARIABLE = "BERTJAX_TEST_SEED"
# A run that printed nothing for this long is stuck (however loaded the machine: a slow run
# still prints its lines, only later); no fixed time for a whole run, which a busy host exceeds.
SILENCE = 300
# Compiled programs are shared between the runs through JAX's persistent cache.
COMPILE_CACHE = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


def command_line(corpus_file: str, cache_dir: str, workdir: str, **overrides) -> list[str]:
    """`python -m bertjax.train` with test_train's tiny config, as command-line overrides."""
    config = tiny_config(
        corpus_file,
        cache_dir,
        **{"train.total_steps": TOTAL_STEPS, "train.keep_checkpoints": 3, **overrides},
    )
    defaults = base_config()
    flags = [
        f"--config.{section}.{field}={value}"
        for section in config
        for field, value in config[section].items()
        if value != defaults[section][field]
    ]
    return [
        sys.executable,
        "-m",
        "bertjax.train",
        "--config=configs/base.py",
        f"--workdir={workdir}",
        *flags,
    ]


class Trainer:
    """One training subprocess (one CPU device) whose output lines are read by a thread.
    `pause`: where it pauses (tests/injected_faults.py), e.g. `step:N` or `save`. Its waits
    fail when it printed nothing for `silence` seconds (SILENCE), not after a fixed time."""

    def __init__(self, args: list[str], pause: str | None = None, extra_env: dict | None = None):
        env = {
            **{k: v for k, v in os.environ.items() if k != injected_faults.VARIABLE},
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            **COMPILE_CACHE,
            **(extra_env or {}),
            **injected_faults.pausing(pause, REPO_ROOT),
        }
        self.proc = subprocess.Popen(
            args,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.last_line = time.time()  # (when it last printed)
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self.last_line = time.time()
            self._queue.put(line)
        self._queue.put(None)

    def _check_not_stuck(self, silence: float, waiting_for: str) -> None:
        if time.time() - self.last_line > silence:
            raise AssertionError(
                f"nothing printed for {silence} s while waiting for {waiting_for}:\n"
                + self.output()
            )

    def wait_for(self, pattern: str, silence: float = SILENCE) -> re.Match:
        """Blocks until the process prints a line matching `pattern` (re.search); its match."""
        while True:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                self._check_not_stuck(silence, repr(pattern))
                continue
            assert line is not None, (
                f"exited ({self.proc.wait()}) before printing {pattern!r}:\n{self.output()}"
            )
            if match := re.search(pattern, line):
                return match

    def wait_for_pause(self) -> str:
        """Blocks until the process has paused (`pause`); where it has."""
        return self.wait_for(rf"{injected_faults.VARIABLE}: paused at (.*)").group(1)  # (a
        # line of another thread's print may end in it)

    def release(self) -> None:
        """Lets a paused process go on."""
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, silence: float = SILENCE) -> int:
        """The process's exit status once it ended (killed, and the test failed with its
        output, if it printed nothing for `silence` seconds meanwhile)."""
        try:
            while True:
                try:
                    return self.proc.wait(1)
                except subprocess.TimeoutExpired:
                    self._check_not_stuck(silence, "its exit")
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def output(self, last_chars: int | None = 4000) -> str:
        """What the run printed (its end, for assertion messages; None: all of it)."""
        text = "".join(self.lines)
        return text if last_chars is None else text[-last_chars:]


def assert_console_in_log(output: str, log_path) -> None:
    """Every line the console showed (`output`: stdout and stderr) is in the run's log file;
    a log record's without the console's `warning: ` or `error (library): ` (the file's
    `LEVEL FILE:LINE] ` in its place)."""
    log = Path(log_path).read_text(encoding="utf-8")
    for line in output.splitlines():
        text = re.sub(r"^(warning|error)( \([\w.]+\))?: ", "", line)
        assert text in log, f"{line!r} is not in {log_path}:\n{log[-3000:]}"


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


def seeded_rng() -> random.Random:
    """A generator seeded from BERTJAX_TEST_SEED, else at random; the seed is printed (pytest
    shows it with a failure) so that a failing draw can be replayed."""
    seed = int(os.environ.get(SEED_VARIABLE) or random.randrange(2**32))
    print(f"\nseed {seed} (replay with {SEED_VARIABLE}={seed})")
    return random.Random(seed)


def finished(directory) -> list[int]:
    """The steps of the finished checkpoints in `directory`."""
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def unfinished(directory) -> list[str]:
    """Orbax's temporary directories of checkpoints being (or left half) written."""
    return sorted(name for name in os.listdir(directory) if "tmp" in name)


def resumed_step(output: str) -> int:
    resumed = re.search(r"Resuming from .* at step (\d+)", output)
    assert resumed, f"the run did not resume:\n{output}"
    return int(resumed.group(1))


@contextlib.contextmanager
def read_only(directory: str):
    """No new files in `directory`, even for root (chattr +i), else by permissions."""
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", directory], capture_output=True, check=False).returncode:
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


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_sigterm_and_kill_9_anywhere_resume_exactly(corpus_file, cache_dir, reference, tmp_path):
    """One work directory, five runs: SIGTERM (a preemption notice) after step 3 saves at step
    4 and exits 143 (128 + SIGTERM: unfinished), its last line saying how to continue; the
    next run is killed with -9 while writing its first checkpoint (step 8),
    the next two after a step drawn at random from the short phase, then from the long one
    (its last step included); the last runs to the end. Each run resumes from exactly the
    newest finished checkpoint, and every loss any of them logged equals the uninterrupted
    run's."""
    rng = seeded_rng()
    kill_steps = [
        rng.randint(PREEMPTED + 1, SHORT_STEPS),  # short phase, then long
        rng.randint(SHORT_STEPS + 1, TOTAL_STEPS),
    ]
    args = command_line(corpus_file, cache_dir, str(tmp_path))
    directory = tmp_path / "checkpoints"

    # JAX agrees on the preemption sync step (the step after the newest one the loop has
    # passed) in a background thread, and logs it (C++ INFO, shown with TF_CPP_MIN_LOG_LEVEL=0).
    # The run waits after step 3 until that has happened, so that the agreed step is 4.
    trainer = Trainer(args, pause=f"step:{PREEMPTED - 1}", extra_env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    trainer.wait_for_pause()
    trainer.proc.send_signal(signal.SIGTERM)
    agreed = trainer.wait_for(r"Preemption sync counter is set: (\d+)")  # jaxlib's log line
    released = time.time()
    trainer.release()
    assert trainer.finish(silence=60) == 143, trainer.output()
    seconds = time.time() - released
    saved = re.search(r"Preemption notice: saving a checkpoint at step (\d+)", trainer.output())
    assert saved and int(saved.group(1)) == int(agreed.group(1)) == PREEMPTED, trainer.output()
    ours = [line for line in trainer.lines if not re.match(r"[IWEF]\d{4} ", line)]  # (C++'s)
    assert ours[-1] == (
        f"Stopped at step {PREEMPTED} of {TOTAL_STEPS} (preemption notice, "
        "SIGTERM): checkpoint saved; rerun the same command to continue\n"
    ), trainer.output()
    assert finished(directory) == [PREEMPTED] and read_metrics(tmp_path)[-1]["step"] == PREEMPTED
    print(
        f"SIGTERM after step {PREEMPTED - 1}: checkpoint at step {PREEMPTED}, exit 143 "
        f"{seconds:.2f} s after going on"
    )

    trainer = Trainer(args, pause="save")  # pauses its first write (step 8) before the rename
    trainer.wait_for_pause()
    left = unfinished(directory)
    trainer.proc.kill()
    assert trainer.finish() == -signal.SIGKILL
    assert resumed_step(trainer.output()) == PREEMPTED and finished(directory) == [PREEMPTED]
    assert (
        len(left) == 1
        and left[0].startswith(f"{2 * CHECKPOINT_EVERY}.")
        and unfinished(directory) == left
    ), left
    print(f"kill -9 while writing {left[0]}: left {sorted(os.listdir(directory))}")

    for step in kill_steps:
        newest = finished(directory)[-1]
        trainer = Trainer(args, pause=f"step:{step}")  # pauses with its saves written
        trainer.wait_for_pause()
        trainer.proc.kill()
        assert trainer.finish() == -signal.SIGKILL
        assert resumed_step(trainer.output()) == newest  # the half-written one skipped
        assert not unfinished(directory)  # and removed
        assert read_metrics(tmp_path)[-1]["step"] == step
        assert finished(directory)[-1] == max(
            s for s in range(0, step + 1, CHECKPOINT_EVERY) if s < TOTAL_STEPS
        )
        print(f"kill -9 after step {step}: left {sorted(os.listdir(directory))}")

    newest = finished(directory)[-1]
    output = run_to_end(args)
    assert resumed_step(output) == newest and not unfinished(directory)
    steps = assert_matches_reference(tmp_path, reference)
    print(f"steps logged by the five runs: {steps}")


def test_a_read_only_checkpoint_directory_stops_the_run_at_its_first_save(
    corpus_file, cache_dir, reference, tmp_path
):
    """With the checkpoint directory read-only, the first save (step 4) fails: the run stops
    at the next save, which meets the background writer's error, with one clear error naming
    step 4's directory, and nothing is left in the directory."""
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    with read_only(str(directory)):
        trainer = Trainer(command_line(corpus_file, cache_dir, str(tmp_path)))
        assert trainer.finish(silence=120) == 1, trainer.output()
    errors = [line for line in trainer.lines if line.startswith("error: ")]
    assert (
        len(errors) == 1
        and f"saving checkpoint step 4 in {directory} failed" in errors[0]
        and f"{directory}/{CHECKPOINT_EVERY}.orbax-checkpoint-tmp" in errors[0]
    ), trainer.output()
    assert os.listdir(directory) == []
    assert read_metrics(tmp_path)[-1]["step"] <= 2 * CHECKPOINT_EVERY
    assert_console_in_log(trainer.output(None), tmp_path / "log.txt")  # the error line too
    print(f"\nread-only checkpoints: {errors[0].strip()}")


def test_a_second_run_in_the_workdir_is_refused_and_ctrl_c_saves(
    corpus_file, cache_dir, reference, tmp_path
):
    """While a run trains (paused after its first step, so that it cannot finish first), a
    second one in the same workdir exits at once with one line naming it (pid, host). Ctrl-C
    then makes the first save at the end of its next step (2) and exit 130 (as a shell
    expects of Ctrl-C), its last line (in log.txt too) saying how to continue; the rerun
    resumes from step 2, and every loss the two runs logged equals the uninterrupted run's."""
    args = command_line(corpus_file, cache_dir, str(tmp_path))
    first = Trainer(args, pause="step:1")
    first.wait_for_pause()
    second = Trainer(args)
    assert second.finish(silence=120) == 1, second.output()
    errors = [line for line in second.lines if line.startswith("error: ")]
    assert len(errors) == 1 and f"is in use by pid {first.proc.pid} on host" in errors[0], (
        second.output()
    )
    print(f"\nsecond run: {errors[0].strip()}")
    first.proc.send_signal(signal.SIGINT)
    first.wait_for("Ctrl-C: saving a checkpoint at the end of this step")  # handled
    first.release()
    assert first.finish(silence=60) == 130, first.output()
    assert "Ctrl-C: saving a checkpoint at step 2 and exiting" in first.output(), first.output()
    stopped = (
        f"Stopped at step 2 of {TOTAL_STEPS} (Ctrl-C): checkpoint saved; rerun the same "
        "command to continue"
    )
    assert first.lines[-1] == stopped + "\n", first.output()
    assert "Done in" not in first.output(None) and "Ran for " in first.output(None)
    assert_console_in_log(first.output(None), tmp_path / "log.txt")
    assert finished(tmp_path / "checkpoints") == [2] and "Traceback" not in first.output()
    output = run_to_end(args)
    assert resumed_step(output) == 2
    steps = assert_matches_reference(tmp_path, reference)
    print(f"Ctrl-C: saved step 2; steps logged by the two runs: {steps}")


def test_ctrl_c_before_the_first_step_is_one_line_and_exit_130(corpus_file, cache_dir, tmp_path):
    """Ctrl-C outside the training steps (here: data prepared, state built, no step run)
    ends the run with status 130 and one line saying nothing was saved: no traceback, no
    checkpoint."""
    trainer = Trainer(
        command_line(corpus_file, cache_dir, str(tmp_path)),
        pause="start",
        extra_env={"BERTJAX_STOP_SECONDS": "30"},
    )  # (once, in CI's whole suite,
    assert trainer.wait_for_pause() == "the start of training"  # it ran past 60 s: where?)
    trainer.proc.send_signal(signal.SIGINT)
    assert trainer.finish(silence=120) == 130, trainer.output()
    errors = [line.strip() for line in trainer.lines if line.startswith("error: ")]
    assert errors == [
        "error: interrupted (Ctrl-C) outside the training steps; nothing to save "
        "(rerun to resume from the last checkpoint)"
    ], trainer.output()
    assert "Traceback" not in trainer.output(None)
    assert finished(tmp_path / "checkpoints") == []


def test_a_run_is_given_up_for_its_silence_not_its_length():
    """Trainer's deadlines: a process that keeps printing (a slow run on a busy host) is
    waited for past its `silence`; one that prints nothing for that long fails the test
    (a hang), and is killed."""
    ticking = "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.5)\n"
    slow = Trainer([sys.executable, "-c", ticking])
    assert slow.wait_for("^5$", silence=2) and slow.finish(silence=2) == 0  # (3 s in all)
    stuck = Trainer(
        [sys.executable, "-c", "print('started', flush=True); import time; time.sleep(60)"]
    )
    stuck.wait_for("started")
    with pytest.raises(AssertionError, match="nothing printed for 2 s while waiting for its exit"):
        stuck.finish(silence=2)
    assert stuck.proc.wait(10) == -signal.SIGKILL


def test_a_second_ctrl_c_exits_at_once():
    """The second SIGINT ends the process (130) at once, not after its 600 s sleep."""
    script = (
        "import os, signal, time\nfrom bertjax.runtime import failures, stopping\n"
        "stopping.watch()\nwith failures.CtrlC(forward_as_sigterm=False) as ctrl_c:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(0.1)\n"
        "    print('requested', ctrl_c.requested, time.time(), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(600)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": REPO_ROOT},
        timeout=300,
        check=False,
    )
    sent = re.search(r"requested True ([\d.]+)", result.stdout)
    seconds = time.time() - float(sent.group(1))  # since the second SIGINT
    assert result.returncode == 130 and seconds < 60, (result.returncode, seconds)
    assert "Second Ctrl-C" in result.stdout


def on_a_small_filesystem(args: list[str], directory, kib: int, then: str = "") -> list[str]:
    """`args` run with a `kib` KiB tmpfs mounted on `directory` (a private mount namespace:
    it is gone when they exit, so `then`, a shell command, runs in it afterwards), as root or
    through an unprivileged user namespace; skips where neither can mount."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1) to mount a small file system")
    namespace = ["unshare", "--mount"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    probe = subprocess.run(
        [*namespace, "sh", "-c", f"mount -t tmpfs tmpfs {directory}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {probe.stderr.strip()}")
    return [
        *namespace,
        "sh",
        "-c",
        f"mount -t tmpfs -o size={kib}k tmpfs {directory} && "
        f'"$@"; code=$?; {then or ":"}; exit $code',
        "sh",
        *args,
    ]


def assert_one_full_disk_line(trainer: Trainer, directory, failed: int, kept: int, workdir) -> str:
    """The one `error:` line of a run whose save of step `failed` in `directory` met a full
    disk: the file, the cause, checkpoint `kept` kept, `workdir`'s log file (which holds
    Orbax's tracebacks; none on the console), and no announcement of step `failed`."""
    output = trainer.output(None)
    errors = [line for line in trainer.lines if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in output, output
    assert re.match(
        rf"error: saving checkpoint step {failed} in {directory} failed: No space "
        rf"left on device: {directory}/{failed}.orbax-checkpoint-tmp/\S+ \(free some "
        r"space, then rerun the same command to resume\); kept: the finished "
        rf"checkpoint\(s\) {kept}, a rerun resumes from step {kept} \(the full log: "
        rf"{workdir}/log.txt\)$",
        errors[0],
    ), errors[0]
    assert f"checkpoint step {failed} ->" not in output
    log = (workdir / "log.txt").read_text()
    assert "No space left on device" in log and "Traceback" in log
    return errors[0]


@pytest.mark.slow  # (two runs: about 40 s)
def test_a_full_disk_is_one_line_and_the_rerun_resumes_exactly(
    corpus_file, cache_dir, reference, tmp_path
):
    """Checkpoints on a file system with room for one (a 1000 KiB tmpfs; one takes about
    720 KiB): the save at step 8 fails. The run says so in one line (the file, "No space left
    on device", the checkpoint kept), with Orbax's errors and tracebacks in WORKDIR/log.txt
    only, and never announces step 8. With space again (the kept files copied to a normal
    directory), the rerun resumes from step 4 with the uninterrupted run's losses."""
    directory, kept = tmp_path / "checkpoints", tmp_path / "kept"
    directory.mkdir()
    args = command_line(corpus_file, cache_dir, str(tmp_path), **{"train.stop_after_steps": 12})
    trainer = Trainer(on_a_small_filesystem(args, directory, 1000, f"cp -a {directory} {kept}"))
    assert trainer.finish() == 1, trainer.output()
    error = assert_one_full_disk_line(trainer, directory, 8, 4, tmp_path)
    assert "checkpoint step 4 ->" in trainer.output(None)
    print(
        f"\n{error.strip()}\n({len(trainer.lines)} lines printed, "
        f"{len((tmp_path / 'log.txt').read_text().splitlines())} in the log)"
    )

    shutil.rmtree(directory)
    shutil.copytree(kept, directory)
    assert finished(directory) == [4]
    output = run_to_end(args)
    assert resumed_step(output) == 4 and "checkpoint step 16 ->" in output
    rows = read_metrics(tmp_path)
    for row in rows:
        assert row["loss"] == reference[row["step"]], row
    assert rows[-1]["step"] == 16  # (12 more steps from 4)


FULL_CACHE = {  # the cache's size in KiB, and what no longer fits there
    "shard": (
        600,
        r"{cache}/short_64_\w+\.tmp\d+/train/shard_00000/\w+\.npy .*; preparing the "
        r"data of phase short stopped and its unfinished files were removed; kept: the "
        r"tokenizer and the data prepared before \(in {cache}\)$",
    ),
    "tokenizer": (
        100,
        r"{cache}/sentencepiece_\w+\.tmp\d+\.model .*; the unfinished "
        r"SentencePiece model was removed; kept: the data prepared before "
        r"\(in {cache}\)$",
    ),
}


@pytest.mark.parametrize("what", list(FULL_CACHE))
def test_a_full_disk_while_preparing_data_is_one_line(what, corpus_file, tmp_path):
    """The data cache on a small tmpfs: 600 KiB hold the tokenizer but not the first shard,
    100 KiB not even the tokenizer. One line names the file and the cause and says what was
    kept; nothing unfinished is left, and the new workdir is removed again."""
    cache, workdir = tmp_path / "cache", tmp_path / "workdir"
    cache.mkdir()
    kib, message = FULL_CACHE[what]
    args = command_line(corpus_file, str(cache), str(workdir))
    trainer = Trainer(on_a_small_filesystem(args, cache, kib, f"ls -a {cache}"))
    assert trainer.finish() == 1, trainer.output()
    errors = [line for line in trainer.lines if line.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in trainer.output(None), trainer.output()
    assert re.match(r"error: No space left on device: " + message.format(cache=cache), errors[0]), (
        errors[0]
    )
    listing = [name.strip() for name in trainer.lines[trainer.lines.index(errors[0]) + 1 :]]
    assert not any(".tmp" in name for name in listing), listing
    assert any(name.endswith(".model") for name in listing) == (what == "shard"), listing
    assert not workdir.exists()
    print(f"\n{errors[0].strip()}")
