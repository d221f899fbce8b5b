"""Compile the exact train step of every phase for a TPU slice or a GPU, from a CPU host:

    pip install -e '.[aot]'   # libtpu and the CUDA PJRT plugin: the real compilers
    python -m bertjax.tools.aot --config=configs/large.py --target=tpu-v5e-8 [--phases=long]
    python -m bertjax.tools.aot --config=configs/large.py --target=h100 --out=h100.json

Targets: tpu-v4-8, tpu-v5e-8, tpu-v5p-8, tpu-v6e-8, h100, h200, or a TPU topology such as
v5e:4x4 (`bertjax.targets`); without `--target`, `--num_devices` fake CPU devices (sharding
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
import time
from typing import Any, Iterator

import jax
from absl import flags
from ml_collections import config_flags

from bertjax import (cli, families, flops, memory, optim, phase_schedule, sharded_run, sharding,
                     targets)
from bertjax.errors import UserError
from bertjax.tools import fit_verdict, hlo_census, tpu_estimate
from bertjax.settings import PretrainingSettings

NOT_FIT_EXIT = 2  # the exit status when a phase does not fit as configured (errors: 1)
CENSUS_GROUPS = 25  # the costliest instruction groups kept in a TPU phase's record
# Measured step time / roofline estimate of the one version timed on a real H100 (589f15d,
# BERT-large: 116.4 / 75.3 ms at L=128, 175.4 / 105.5 ms at L=512).
H100_CALIBRATION = 1.6


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


def _memory_sizes(compiled: Any) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    return {} if analysis is None else {
        name: int(getattr(analysis, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp", "generated_code")}


def gpu_estimate(hlo_text: str, target: targets.Target, model_flops: float) -> dict[str, Any]:
    """The kernel census of a GPU step, its roofline time and the MFU estimate that follows
    with `H100_CALIBRATION` (an estimate, not a measurement)."""
    result = hlo_census.census(hlo_text, target.peak_tflops, target.hbm_bytes_per_second)
    step = result.seconds * H100_CALIBRATION
    return {**result.as_dict(), "calibration": H100_CALIBRATION,
            "estimated_step_seconds": step,
            "estimated_mfu": model_flops / step / (target.peak_tflops * 1e12)}


def compile_phase(sharded: sharded_run.ShardedRun, phase: phase_schedule.Phase, config: Any,
                  target: targets.Target | None, memory_bytes: float | None = None
                  ) -> dict[str, Any]:
    """Compiles the train step of `phase`; the verdict (against `memory_bytes` per device,
    default the target's), memory per device, FLOPs and the GPU's or TPU's estimate."""
    mesh = sharded.mesh
    per_device = phase.global_batch_size // sharding.data_parallel_size(mesh)
    model_flops = flops.train_flops_per_sequence(
        sharded.model.config, phase.max_seq_length, phase.max_predictions_per_seq
    ) * phase.global_batch_size / mesh.size
    start = time.time()
    record: dict[str, Any] = {"max_seq_length": phase.max_seq_length,
                              "global_batch_size": phase.global_batch_size,
                              "grad_accum_steps": sharded.grad_accum[phase.name],
                              "per_device_batch": per_device, "model_flops_per_device":
                              model_flops}
    compiled, refused, sizes = None, None, None
    with sharding.activate(mesh):
        lowered = sharded.train_step.lower(sharded.abstract_state, memory.abstract_batch(
            phase, phase.global_batch_size, sharding.batch_sharding(mesh)))
        try:
            compiled = lowered.compile()
        except Exception as e:  # the TPU compiler's refusal carries its own numbers
            refused = fit_verdict.parse_refusal(str(e))
            if refused is None:
                raise
            record["compiler_error"] = str(e).splitlines()[0]
    record["compile_seconds"] = time.time() - start
    if compiled is not None:
        sizes = _memory_sizes(compiled)
        record["memory"] = sizes
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        if cost and "flops" in cost:
            record["compiler_flops_per_device"] = float(cost["flops"])
        if target is not None and target.platform == "cuda":
            record["gpu"] = gpu_estimate(compiled.as_text(), target, model_flops)
        elif target is not None and cost and "optimal_seconds" in cost:
            record["tpu"] = tpu_estimate.estimate(
                cost, compiled.as_text(), sharded.grad_accum[phase.name], model_flops,
                target.peak_tflops, top=CENSUS_GROUPS)
    record["verdict"] = fit_verdict.verdict(
        sizes, refused, memory_bytes or (target.hbm_bytes if target else None), config,
        per_device, memory.per_device_bytes(sharded.abstract_state),
        sharded.grad_accum[phase.name])
    return record


def summary_lines(name: str, record: dict[str, Any]) -> list[str]:
    """The console's lines for one phase: the verdict, and a GPU's estimate."""
    lines = [f"Phase {name} (L={record['max_seq_length']}, global batch "
             f"{record['global_batch_size']}, {record['per_device_batch']} per device"
             + (f" in {record['grad_accum_steps']} micro-batches"
                if record["grad_accum_steps"] > 1 else "") + "): "
             f"{record['verdict']['text']} [compiled in {record['compile_seconds']:.0f} s]"]
    gpu = record.get("gpu")
    if gpu:
        lines.append(
            f"  estimate (roofline x {gpu['calibration']} calibration, not measured): "
            f"{gpu['estimated_step_seconds'] * 1e3:.1f} ms per step, MFU "
            f"{gpu['estimated_mfu']:.0%}; roofline {gpu['roofline_seconds'] * 1e3:.1f} ms, "
            f"{gpu['kernels']:,} kernels ({gpu['small_kernels']:,} under 64 KB), "
            f"non-matmul {gpu['non_matmul_bytes'] / 1e9:.0f} GB")
    tpu = record.get("tpu")
    if tpu:
        loop = (f", the loop's body counted {tpu['loop_trips']} times"
                if tpu["loop_trips"] > 1 else "")
        time_text = (f"{tpu['optimal_seconds'] * 1e3:.1f} ms per step, MFU "
                     f"{tpu['estimated_mfu']:.1%}" if tpu["optimal_seconds"] else
                     f"no step time (libtpu's optimal_seconds: "
                     f"{tpu['compiler_optimal_seconds']:.4g})")
        lines.append(
            f"  estimate (libtpu's cost model, not measured{loop}): {time_text}; "
            f"{tpu['bytes_accessed'] / 1e9:.1f} GB accessed; compiler "
            f"{tpu['compiler_flops'] / 1e12:.2f} TFLOP, model {tpu['model_flops'] / 1e12:.2f} "
            f"({tpu['compiler_flops'] / tpu['model_flops']:.1%})")
    return lines


def _build(config: Any, devices: list[jax.Device], phase_names: list[str] | None
           ) -> tuple[sharded_run.ShardedRun, list[phase_schedule.Phase]]:
    """The sharded model, state and train step of `config`'s phases named `phase_names`."""
    mesh = sharded_run.make_mesh(config.mesh.to_dict(), devices)
    settings = PretrainingSettings.of(config)
    phases = phase_schedule.phases(settings.train, settings.data, settings.long_phase)
    sharded_run.check_batches(mesh, phases, config.train.grad_accum_steps,
                              config.model.max_position_embeddings)
    phases = [p for p in phases if not phase_names or p.name in phase_names]
    return sharded_run.build_pretraining(
        families.model_config(config.model.to_dict()),
        optim.optimizer_config(config.optimizer, config.train.total_steps), mesh, phases,
        config.train.grad_accum_steps, report=False), phases


def with_overrides(config: Any, overrides: dict[str, Any]) -> Any:
    """A copy of `config` with `{"section.field": value}` set."""
    trial = config.copy_and_resolve_references()
    for key, value in overrides.items():
        *path, field = key.split(".")
        section = trial
        for name in path:
            section = section[name]
        section[field] = value
    return trial


def advise(config: Any, devices: list[jax.Device], phase_name: str, record: dict[str, Any],
           target: targets.Target | None, budget_seconds: float,
           memory_bytes: float | None = None) -> dict[str, Any]:
    """Compiles the phase with each of the verdict's candidate settings, cheapest first,
    until one fits or `budget_seconds` have passed (a compile under way is finished):
    `{"fits_with": flags | None, "tried": [...], "untried": [...]}`."""
    start, tried = time.time(), []
    pending = list(record["verdict"].get("candidates", []))
    while pending and time.time() - start < budget_seconds:
        candidate = pending.pop(0)
        try:
            trial_config = with_overrides(config, candidate["overrides"])
            sharded, (phase,) = _build(trial_config, devices, [phase_name])
            trial = compile_phase(sharded, phase, trial_config, target, memory_bytes)
        except UserError as e:  # a setting this batch or mesh cannot take
            tried.append({"flags": candidate["flags"], "fits": False, "text": str(e)})
            continue
        verdict = trial["verdict"]
        tried.append({"flags": candidate["flags"], "fits": verdict["fits"],
                      "text": verdict["text"], "compile_seconds": trial["compile_seconds"]})
        if verdict["fits"]:
            return {"fits_with": candidate["flags"], "tried": tried,
                    "untried": [c["flags"] for c in pending]}
    return {"fits_with": None, "tried": tried, "untried": [c["flags"] for c in pending]}


def advice_lines(advice: dict[str, Any], budget_seconds: float) -> list[str]:
    """The console's lines for the advisor's outcome: only a setting the compiler confirmed."""
    lines = [f"  {t['flags']}: {t['text']}" for t in advice["tried"]]
    if advice["fits_with"]:
        lines.append(f"  advice, confirmed by the compiler: {advice['fits_with']}")
    else:
        lines.append(f"  no setting confirmed to fit within {budget_seconds:.0f} s"
                     + (f"; not compiled: {', '.join(advice['untried'])}"
                        if advice["untried"] else "; none of the candidates fits"))
    return lines


def compile_train_step(config: Any, devices: list[jax.Device],
                       phase_names: list[str] | None = None,
                       target: targets.Target | None = None,
                       advise_seconds: float = 0.0, memory_bytes: float | None = None
                       ) -> dict[str, Any]:
    """Lowers and compiles the train step of each phase for `devices` (of `target`); prints
    each phase's summary and returns the mesh, the start-up report and `{phase: record}`.
    A phase that does not fit `memory_bytes` per device (default: the target's) gets the
    first candidate setting that the compiler confirms within `advise_seconds` (`advise`)."""
    sharded, phases = _build(config, devices, phase_names)
    mesh = sharded.mesh
    with sharding.activate(mesh):
        impl = sharded.model.config.resolved_attention_impl()
    result: dict[str, Any] = {
        "target": target.name if target else f"cpu x{len(devices)}",
        "device_kind": devices[0].device_kind, "devices": len(devices),
        "mesh": dict(mesh.shape), "attention_impl": impl,
        "remat_policy": sharded.model.config.remat_policy,
        "startup_report": memory.report(sharded.model, sharded.abstract_state, mesh, phases),
        "phases": {}}
    print(f"{result['target']} ({result['device_kind']}, {len(devices)} devices), mesh "
          + " ".join(f"{k}={v}" for k, v in mesh.shape.items())
          + f", attention {impl}, remat {result['remat_policy']}", flush=True)
    if target is not None and target.platform == "tpu":
        result["matmul_calibration"] = tpu_estimate.matmul_calibration(
            devices[0], target.peak_tflops)
        print(f"libtpu's cost model puts an 8192^3 bfloat16 matmul at "
              f"{result['matmul_calibration']:.0%} of {target.peak_tflops:g} TFLOP/s "
              "(the MFU below is of that peak)", flush=True)
    for phase in phases:
        record = compile_phase(sharded, phase, config, target, memory_bytes)
        result["phases"][phase.name] = record
        for line in summary_lines(phase.name, record):
            print(line, flush=True)
        if record["verdict"]["fits"] is False:
            record["advice"] = advise(config, devices, phase.name, record, target,
                                      advise_seconds, memory_bytes)
            for line in advice_lines(record["advice"], advise_seconds):
                print(line, flush=True)
    return result


FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "Config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_string("target", "", "Compile for: " + ", ".join(targets.TARGETS)
                        + ", or a TPU topology such as v5e:4x4; empty: fake CPU devices.")
    flags.DEFINE_integer("num_devices", 32, "Fake CPU devices to compile for, without "
                         "--target (the mesh must cover them exactly).")
    flags.DEFINE_list("phases", [], "Phases to compile (short, long); default: all.")
    flags.DEFINE_string("out", "", "JSON file of every figure; default: "
                        "$TMPDIR/bertjax_aot/TARGET.json. The compilers' log goes beside it.")
    flags.DEFINE_float("advise_seconds", 1800, "For a phase that does not fit: compile the "
                       "candidate settings, cheapest first, until one fits or this many "
                       "seconds have passed (a compile under way is finished); 0: none.")
    flags.DEFINE_float("memory_gib", 0, "Judge the fit against this many GiB per device "
                       "instead of the target's memory (headroom to keep; fake CPU devices).")
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
            devices = (targets.devices(target) if target
                       else jax.devices()[:FLAGS.num_devices])
            with targets.cudnn_for(target, devices[0]) if target else contextlib.nullcontext():
                result = compile_train_step(FLAGS.config, devices, FLAGS.phases, target,
                                            FLAGS.advise_seconds,
                                            FLAGS.memory_gib * fit_verdict.GIB or None)
    except targets.TargetError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as e:  # sharding and shape errors from JAX/XLA included: one clear line
        first_line = (str(e).splitlines() or [repr(e)])[0]
        print(f"error: compiling the train step for {label}, mesh "
              f"{FLAGS.config.mesh.to_dict()}, failed: {first_line} (compiler log: {log})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"Details: {out}", flush=True)
    if any(r["verdict"]["fits"] is False for r in result["phases"].values()):
        sys.exit(NOT_FIT_EXIT)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
