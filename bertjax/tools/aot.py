"""Compile the exact train step of every phase for a TPU slice or a GPU, from a CPU host:

    pip install -e '.[aot]'   # libtpu and the CUDA PJRT plugin: the real compilers
    python -m bertjax.tools.aot --config=configs/large.py --target=tpu-v5e-8 [--phases=long]
    python -m bertjax.tools.aot --config=configs/large.py --target=h100 --out=h100.json

Targets: tpu-v4-8, tpu-v5e-8, tpu-v5p-8, tpu-v6e-8, h100, h200, or a TPU topology such as
v5e:4x4 (`bertjax.runtime.targets`); without `--target`, `--num_devices` fake CPU devices (sharding
errors are the same; the memory figures are the CPU compiler's). Nothing is materialised.

Per phase one verdict line: fits, with the headroom, or does not fit, with the compiler's own
numbers (libtpu refuses a program larger than HBM); then the candidate settings are compiled,
cheapest first, within `--advise_seconds`, and only one the compiler confirms is advised
(exit status 2 when a phase does not fit as configured). For a GPU one more line: the
roofline estimate of the step from its kernel census, and the MFU that implies; for a TPU,
libtpu's own estimate (`tools.tpu_estimate`): its step time, the MFU that implies, the bytes
and FLOPs. Every figure (memory per device, FLOPs, the censuses) goes to the JSON file
`--out`, the compilers' own log lines to the `.log` beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import jax
import ml_collections
from absl import flags
from ml_collections import config_flags

from bertjax import cli
from bertjax.runtime import console, targets
from bertjax.tools import advice, fit_verdict, phase_compile, tpu_estimate
from bertjax.training import memory, sharding

NOT_FIT_EXIT = 2  # the exit status when a phase does not fit as configured (errors: 1)


@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """Sends file descriptor 2 (the compilers' C++ log lines, Python's warnings) to `path`."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "a", encoding="utf-8") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def compile_train_step(
    config: ml_collections.ConfigDict,
    devices: list[jax.Device],
    phase_names: list[str] | None = None,
    target: targets.Target | None = None,
    advise_seconds: float = 0.0,
    memory_bytes: float | None = None,
) -> dict[str, Any]:
    """Lowers and compiles the train step of each phase for `devices` (of `target`); prints
    each phase's summary and returns the mesh, the start-up report and `{phase: record}`.
    A phase that does not fit `memory_bytes` per device (default: the target's) gets the
    first candidate setting that the compiler confirms within `advise_seconds` (`tools.advice`)."""
    sharded, phases = phase_compile.build(config, devices, phase_names)
    mesh = sharded.mesh
    with sharding.activate(mesh):
        impl = sharded.model.config.resolved_attention_impl()
    result: dict[str, Any] = {
        "target": target.name if target else f"cpu x{len(devices)}",
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "mesh": dict(mesh.shape),
        "attention_impl": impl,
        "remat_policy": sharded.model.config.remat_policy,
        "startup_report": memory.report(sharded.model, sharded.abstract_state, mesh, phases),
        "phases": {},
    }
    print(
        f"{result['target']} ({result['device_kind']}, {len(devices)} devices), mesh "
        + " ".join(f"{k}={v}" for k, v in mesh.shape.items())
        + f", attention {impl}, remat {result['remat_policy']}",
        flush=True,
    )
    if target is not None and target.platform == "tpu":
        result["matmul_calibration"] = tpu_estimate.matmul_calibration(
            devices[0], target.peak_tflops
        )
        print(
            f"libtpu's cost model puts an 8192^3 bfloat16 matmul at "
            f"{result['matmul_calibration']:.0%} of {target.peak_tflops:g} TFLOP/s "
            "(the MFU below is of that peak)",
            flush=True,
        )
    for phase in phases:
        record = phase_compile.compile_phase(sharded, phase, config, target, memory_bytes)
        result["phases"][phase.name] = record
        for line in phase_compile.summary_lines(phase.name, record):
            print(line, flush=True)
        if record["verdict"]["fits"] is False:
            record["advice"] = advice.advise(
                config, devices, phase.name, record, target, advise_seconds, memory_bytes
            )
            for line in advice.advice_lines(record["advice"], advise_seconds):
                print(line, flush=True)
    return result


FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file(
        "config", None, "Config file with get_config().", lock_config=True
    )
    flags.DEFINE_string(
        "target",
        "",
        "Compile for: "
        + ", ".join(targets.TARGETS)
        + ", or a TPU topology such as v5e:4x4; empty: fake CPU devices.",
    )
    flags.DEFINE_integer(
        "num_devices",
        32,
        "Fake CPU devices to compile for, without --target (the mesh must cover them exactly).",
    )
    flags.DEFINE_list("phases", [], "Phases to compile (short, long); default: all.")
    flags.DEFINE_string(
        "out",
        "",
        "JSON file of every figure; default: "
        "$TMPDIR/bertjax_aot/TARGET.json. The compilers' log goes beside it.",
    )
    flags.DEFINE_float(
        "advise_seconds",
        1800,
        "For a phase that does not fit: compile the "
        "candidate settings, cheapest first, until one fits or this many "
        "seconds have passed (a compile under way is finished); 0: none.",
    )
    flags.DEFINE_float(
        "memory_gib",
        0,
        "Judge the fit against this many GiB per device "
        "instead of the target's memory (headroom to keep; fake CPU devices).",
    )
    flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    del argv
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.num_devices)
    label = FLAGS.target or f"cpu{FLAGS.num_devices}"
    out = FLAGS.out or os.path.join(tempfile.gettempdir(), "bertjax_aot", f"{label}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    log = os.path.splitext(out)[0] + ".log"
    open(log, "w").close()
    try:
        target = targets.parse(FLAGS.target) if FLAGS.target else None
        with stderr_to(log):
            devices = targets.devices(target) if target else jax.devices()[: FLAGS.num_devices]
            with targets.cudnn_for(target, devices[0]) if target else contextlib.nullcontext():
                result = compile_train_step(
                    FLAGS.config,
                    devices,
                    FLAGS.phases,
                    target,
                    FLAGS.advise_seconds,
                    FLAGS.memory_gib * fit_verdict.GIB or None,
                )
    except targets.TargetError as e:
        console.error(str(e))
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 (JAX/XLA's sharding and shape errors too: one line)
        first_line = (str(e).splitlines() or [repr(e)])[0]
        console.error(
            f"compiling the train step for {label}, mesh "
            f"{FLAGS.config.mesh.to_dict()}, failed: {first_line} (compiler log: {log})"
        )
        sys.exit(1)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"Details: {out}", flush=True)
    if any(r["verdict"]["fits"] is False for r in result["phases"].values()):
        sys.exit(NOT_FIT_EXIT)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
