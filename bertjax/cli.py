"""What the `python -m bertjax.*` entry points share around their own work: the config file
and its `--config.a.b=value` overrides checked before absl parses them (a typo or a missing
`.py` is one line with the nearest valid names, not a traceback), absl's own flag errors (an
unknown flag, a value of the wrong type, a required flag missing) as one `error:` line and
exit 2, and the console set up for absl's `--verbosity` (`console.configure_console`)."""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import runpy
import sys
from collections.abc import Callable, Collection, Sequence
from typing import NoReturn

import ml_collections
from absl import app, flags

from bertjax.errors import ConfigError
from bertjax.runtime import console, failures, stopping


def _config_arguments(argv: Sequence[str], flag: str) -> tuple[str | None, list[str]]:
    """`--flag=FILE` (or `--flag FILE`) and the dotted names of its `--flag.NAME=...`."""
    file_arg, overrides = None, []
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg.startswith(f"--{flag}="):
            file_arg = arg.split("=", 1)[1]
        elif arg == f"--{flag}" and i + 1 < len(args):
            file_arg = args[i + 1]
        elif arg.startswith(f"--{flag}."):
            overrides.append(arg[len(flag) + 3 :].split("=", 1)[0])
    return file_arg, overrides


def _missing_file(flag: str, path: str) -> str:
    if os.path.isfile(path + ".py"):
        return f"--{flag}={path}: no such file; did you mean --{flag}={path}.py?"
    folder = os.path.dirname(path) or "."
    near = difflib.get_close_matches(path, glob.glob(os.path.join(folder, "*.py")), n=3)
    hint = (
        "did you mean " + " or ".join(f"--{flag}={n}" for n in near) + "?"
        if near
        else "give the path of a config .py file (e.g. configs/tiny.py) from the repository root"
    )
    return f"--{flag}={path}: no such file; {hint}"


def _unknown_field(flag: str, fields: object, name: str, path: str) -> str | None:
    """The problem with override `name` (dotted) on the nested `fields` (any ConfigDict the
    file builds), or None if it names a field."""
    node, parts = fields, name.split(".")
    for depth, part in enumerate(parts):
        prefix = ".".join(parts[:depth])
        if not isinstance(node, ml_collections.ConfigDict):
            return (
                f"--{flag}.{name}: {prefix} is a value, not a section; set --{flag}.{prefix}=VALUE"
            )
        if part not in node:
            section = f"{prefix}." if prefix else ""
            near = difflib.get_close_matches(part, list(node.keys()), n=3, cutoff=0.7)
            rest = "".join(f".{p}" for p in parts[depth + 1 :])
            fix = (
                "did you mean " + " or ".join(f"--{flag}.{section}{n}{rest}" for n in near) + "?"
                if near
                else "its fields there: " + ", ".join(sorted(node.keys()))
            )
            return f"--{flag}.{name}: {path} has no field {section}{part}; {fix}"
        node = node[part]
    return None


def config_argument_error(argv: Sequence[str], flag: str = "config") -> str | None:  # noqa: PLR0911 (one return per problem, in order)
    """The first problem with `--flag=FILE` and its overrides in `argv`, as one line; None
    when there is none (or no such flag: absl reports a missing required flag itself)."""
    file_arg, overrides = _config_arguments(argv, flag)
    if file_arg is None:
        return None
    path, _, parameter = file_arg.partition(":")
    if not os.path.isfile(path):
        return _missing_file(flag, path)
    if not overrides:
        return None
    try:
        get_config = runpy.run_path(path)["get_config"]
        config = get_config(parameter) if parameter else get_config()
    except Exception:  # noqa: BLE001 (a broken config file: config_flags shows where)
        return None
    for name in overrides:
        problem = _unknown_field(flag, config, name, path)
        if problem and name == "model.family":  # a BERT config (its section has no family)
            from bertjax.models import families  # (JAX: only on this mistake)

            return (
                f"--{flag}.{name}: {path} is a BERT config (no model.family field: "
                "BERT's configs need none); a ModernBERT run starts from a ModernBERT "
                f"config, {families.get('modernbert').configs}"
            )
        if problem:
            return problem
    return None


def flag_error_line(error: flags.Error, known: Collection[str]) -> str:
    """absl's flag parsing `error` as one line naming the flag and what to do; `known`: the
    defined flag names (for the nearest to a mistyped one)."""
    if isinstance(error, flags.UnrecognizedFlagError):
        near = difflib.get_close_matches(error.flagname, list(known), n=3, cutoff=0.7)
        fix = (
            "did you mean " + " or ".join(f"--{n}" for n in near) + "?"
            if near
            else "--helpfull lists the flags"
        )
        return f"--{error.flagname}: no such flag; {fix}"
    message = str(error)
    empty = re.fullmatch(r"Missing value for flag --(\S+)", message)
    if empty:
        return f"--{empty[1]} has no value: give --{empty[1]}=VALUE"
    required = re.fullmatch(
        r"flag --(\S+)=None: Flag --\S+ must have a value other than None\.", message
    )
    if required:
        return f"--{required[1]} is required: give --{required[1]}=VALUE"
    value = re.fullmatch(r"flag --([^=\s]+)=(.*?): (.*)", message, re.DOTALL)
    if value and value[1] in known:
        name, kind = value[1], flags.FLAGS[value[1]].flag_type()
        return f"--{name}={value[2]}: {value[3]} (a value of type {kind} is due); set --{name}"
    return message.replace("\n", " ")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for the entry points that do not use absl (`bertjax.convert`): a
    mistake is one `error:` line (an unknown option with the nearest one) and exit 2."""

    def error(self, message: str) -> NoReturn:
        unknown = re.fullmatch(r"unrecognized arguments: (.*)", message)
        if unknown:
            options = [o for action in self._actions for o in action.option_strings]
            first = unknown[1].split()[0]
            near = difflib.get_close_matches(first.split("=")[0], options, n=3, cutoff=0.5)
            fix = "did you mean " + " or ".join(near) + "?" if near else f"{self.prog} --help"
            message = f"{first}: no such option; {fix}"
        console.error(message)
        sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parse of `argv`, with one `error:` line and exit 2 for a mistake in it."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        console.error(flag_error_line(e, list(flags.FLAGS)))
        sys.exit(2)


def run(main: Callable[[list[str]], None], config_flag: str | None = "config") -> None:
    """`app.run(main)`, after checking the config arguments (one `error:` line and exit 1 on
    a problem), with absl's flag errors as one `error:` line and exit 2 (`--only_check_args`
    stops after them: `launch/tpu_vm.sh` checks a job's flags so), and with the console
    configured for `--verbosity` before `main` starts."""
    problem = config_argument_error(sys.argv, config_flag) if config_flag else None
    if problem:
        console.error(problem)
        sys.exit(1)

    def configured_main(argv: list[str]) -> None:
        console.configure_console(flags.FLAGS.verbosity)
        try:
            stopping.watch()
        except ValueError as e:  # (a malformed BERTJAX_STOP_SECONDS)
            leave(str(e))
        main(argv)

    app.run(configured_main, flags_parser=_parse_flags)


def leave_on(error: Exception, workdir: str = "") -> NoReturn:
    """Ends a run (in `workdir`, if it has one) on `error` with one `error:` line and exit 1:
    an OSError as `failures.os_error_line`; a failed checkpoint save or training error
    pointing to the run's log file (where the libraries' tracebacks went); after a failed save
    at once."""
    from bertjax.checkpoints import checkpoint
    from bertjax.training import nonfinite  # (JAX and Orbax: not for bertjax.prepare)

    message = failures.os_error_line(error) if isinstance(error, OSError) else str(error)
    log = console.log_file(workdir) if workdir else ""
    if (
        isinstance(error, (checkpoint.CheckpointWriteError, nonfinite.TrainingError))
        and log
        and os.path.exists(log)
    ):
        message += f" (the full log: {log})"
    leave(message, at_once=isinstance(error, checkpoint.CheckpointWriteError))


def integers(flag: str, value: str) -> list[int]:
    """The comma-separated integers of the command-line flag `--FLAG=value` (spaces and empty
    items ignored); ConfigError naming the flag if one is not an integer."""
    try:
        return [int(item) for item in value.replace(" ", "").split(",") if item]
    except ValueError:
        raise ConfigError(
            f"--{flag}={value!r} is not a comma-separated list of integers "
            f"(e.g. 1,2,3); set --{flag}"
        ) from None


def check_max_seq_length(max_seq_length: int, max_position_embeddings: int) -> None:
    """ConfigError unless `--max_seq_length` fits between [CLS] [SEP] and the model's
    positions (`max_position_embeddings`)."""
    if not 2 <= max_seq_length <= max_position_embeddings:
        raise ConfigError(
            f"--max_seq_length={max_seq_length} is out of range: the model has "
            f"{max_position_embeddings} positions (max_position_embeddings), and [CLS] and "
            f"[SEP] take 2; set --max_seq_length between 2 and {max_position_embeddings}"
        )


def leave(message: str, status: int = 1, at_once: bool = False) -> NoReturn:
    """`failures.leave`, with the `error:` line also at the end of the run's log file, if it
    wrote one."""
    console.note(console.error_line(message))
    failures.leave(message, status, at_once)


# The entry points whose flags are absl's, read through `run`.
ABSL_JOBS = (
    "train",
    "finetune",
    "prepare",
    "probe",
    "extract_features",
    "tools.aot",
    "tools.bench",
    "tools.bench_data",
)


def check_job_flags(job: str, args: Sequence[str]) -> int:
    """Parses the flags of `python -m bertjax.JOB ARGS` as that job does, and stops before
    its work (absl's `--only_check_args`): 0 when they parse; the job's own `error:` line and
    exit status when not; 3, with a note, when they cannot be checked here (a job outside
    ABSL_JOBS, or one whose dependencies this Python lacks). `launch/tpu_vm.sh` runs it
    before touching a slice."""
    if job not in ABSL_JOBS:
        console.say(f"note: bertjax.{job}'s flags are not checked before launch", err=True)
        return 3
    sys.argv = [f"python -m bertjax.{job}", "--only_check_args", *args]
    try:
        runpy.run_module(f"bertjax.{job}", run_name="__main__", alter_sys=True)
    except ImportError as e:
        console.say(f"note: bertjax.{job}'s flags are not checked before launch ({e})", err=True)
        return 3
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    return 0
