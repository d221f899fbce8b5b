"""What the `python -m bertjax.*` entry points share around their own work: the config file
and its `--config.a.b=value` overrides checked before absl parses them (a typo or a missing
`.py` is one line with the nearest valid names, not a traceback), and the console set up for
absl's `--verbosity` (`console.configure_console`)."""

from __future__ import annotations

import difflib
import glob
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

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


def _unknown_field(flag: str, fields: Any, name: str, path: str) -> str | None:
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


def config_argument_error(argv: Sequence[str], flag: str = "config") -> str | None:
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


def run(main: Callable[[list[str]], None], config_flag: str | None = "config") -> None:
    """`app.run(main)`, after checking the config arguments (one `error:` line and exit 1 on
    a problem) and with the console configured for `--verbosity` before `main` starts."""
    problem = config_argument_error(sys.argv, config_flag) if config_flag else None
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        sys.exit(1)

    def configured_main(argv: list[str]) -> None:
        console.configure_console(flags.FLAGS.verbosity)
        try:
            stopping.watch()
        except ValueError as e:  # (a malformed BERTJAX_STOP_SECONDS)
            leave(str(e))
        main(argv)

    app.run(configured_main)


def leave_on(error: Exception, workdir: str = "") -> NoReturn:
    """Ends a run (in `workdir`, if it has one) on `error` with one `error:` line and exit 1:
    an OSError as `failures.os_error_line`; a failed checkpoint save or training error
    pointing to the run's log file (where the libraries' tracebacks went); after a failed save
    at once."""
    from bertjax.training import checkpoint, nonfinite  # (JAX and Orbax: not for bertjax.prepare)

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


def leave(message: str, status: int = 1, at_once: bool = False) -> NoReturn:
    """`failures.leave`, with the `error:` line also at the end of the run's log file, if it
    wrote one."""
    console.note(f"error: {message}")
    failures.leave(message, status, at_once)
