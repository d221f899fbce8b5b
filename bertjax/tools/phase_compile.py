"""One phase's train step compiled for a target (`tools.aot`): the sharded model and step of
a config's phases, the fit verdict (`tools.fit_verdict`), memory per device, FLOPs, a GPU's
roofline estimate or libtpu's own with the vector unit's time beside it (`tools.tpu_estimate`),
and the console's lines for it."""

from __future__ import annotations

import time
from typing import Any

import jax
import ml_collections

from bertjax.models import flops
from bertjax.runtime import targets
from bertjax.tools import fit_verdict, gpu_census, hlo_census, tpu_estimate, vector_ops
from bertjax.training import memory, optim, phase_schedule, sharded_run, sharding, steps
from bertjax.training.settings import PretrainingSettings

CENSUS_GROUPS = 25  # the costliest instruction groups kept in a TPU phase's record
GPU_CENSUS_GROUPS = 40  # the costliest kernel groups kept in a GPU phase's record
# Measured step time / roofline estimate of the one version timed on a real H100 (589f15d,
# BERT-large: 116.4 / 75.3 ms at L=128, 175.4 / 105.5 ms at L=512).
H100_CALIBRATION = 1.6


def _memory_sizes(compiled: jax.stages.Compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    return (
        {}
        if analysis is None
        else {
            name: int(getattr(analysis, f"{name}_size_in_bytes"))
            for name in ("argument", "output", "alias", "temp", "generated_code")
        }
    )


def gpu_estimate(
    hlo_text: str,
    target: targets.Target,
    model_flops: float,
    pallas_costs: hlo_census.PallasCosts | None = None,
) -> dict[str, Any]:
    """The kernel census of a GPU step (`tools.gpu_census`: by family, and its costliest
    groups), its roofline time and the MFU estimate that follows with `H100_CALIBRATION` (an
    estimate, not a measurement). Pallas kernels cost what `pallas_costs` declares."""
    result = hlo_census.census(
        hlo_text,
        target.peak_tflops,
        target.hbm_bytes_per_second,
        pallas_costs,
        gpu_census.describe,
        steps.SKIPPED_STEP_SCOPE,
    )
    step = result.seconds * H100_CALIBRATION
    return {
        **result.as_dict(),
        **gpu_census.summarize(result, GPU_CENSUS_GROUPS),
        "calibration": H100_CALIBRATION,
        "estimated_step_seconds": step,
        "estimated_mfu": model_flops / step / (target.peak_tflops * 1e12),
    }


def compile_phase(
    sharded: sharded_run.ShardedRun,
    phase: phase_schedule.Phase,
    config: ml_collections.ConfigDict,
    target: targets.Target | None,
    memory_bytes: float | None = None,
) -> dict[str, Any]:
    """Compiles the train step of `phase`; the verdict (against `memory_bytes` per device,
    default the target's), memory per device, FLOPs and the GPU's or TPU's estimate."""
    mesh = sharded.mesh
    per_device = phase.global_batch_size // sharding.data_parallel_size(mesh)
    model_flops = (
        flops.train_flops_per_sequence(
            sharded.model.config, phase.max_seq_length, phase.max_predictions_per_seq
        )
        * phase.global_batch_size
        / mesh.size
    )
    start = time.time()
    record: dict[str, Any] = {
        "max_seq_length": phase.max_seq_length,
        "global_batch_size": phase.global_batch_size,
        "grad_accum_steps": sharded.grad_accum[phase.name],
        "per_device_batch": per_device,
        "model_flops_per_device": model_flops,
    }
    compiled, refused, sizes = None, None, None
    with sharding.activate(mesh):
        traced = sharded.train_step.trace(
            sharded.abstract_state,
            memory.abstract_batch(phase, phase.global_batch_size, sharding.batch_sharding(mesh)),
        )
        try:
            compiled = traced.lower().compile()
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
            record["gpu"] = gpu_estimate(
                _hlo_text(compiled),
                target,
                model_flops,
                gpu_census.pallas_costs(traced.jaxpr.jaxpr),
            )
        elif target is not None and cost and "optimal_seconds" in cost:
            equations = vector_ops.pallas_equations(traced.jaxpr.jaxpr)
            record["tpu"] = tpu_estimate.estimate(
                cost,
                _hlo_text(compiled),
                sharded.grad_accum[phase.name],
                model_flops,
                target.peak_tflops,
                top=CENSUS_GROUPS,
                kernels=vector_ops.pallas_kernels(equations),
                unit=vector_ops.vector_unit(target.topology),
                kernel_seconds=tpu_estimate.kernel_seconds(equations, mesh.devices.flat[0]),
            )
    record["verdict"] = fit_verdict.verdict(
        sizes,
        refused,
        memory_bytes or (target.hbm_bytes if target else None),
        config,
        per_device,
        memory.per_device_bytes(sharded.abstract_state),
        sharded.grad_accum[phase.name],
    )
    return record


def _hlo_text(compiled: jax.stages.Compiled) -> str:
    """The compiled step's HLO (jax types it Optional: None only for backends without text)."""
    text = compiled.as_text()
    assert text is not None, "this backend's compiled step has no HLO text"
    return text


def summary_lines(name: str, record: dict[str, Any]) -> list[str]:
    """The console's lines for one phase: the verdict, and a GPU's or a TPU's estimate."""
    lines = [
        f"Phase {name} (L={record['max_seq_length']}, global batch "
        f"{record['global_batch_size']}, {record['per_device_batch']} per device"
        + (
            f" in {record['grad_accum_steps']} micro-batches"
            if record["grad_accum_steps"] > 1
            else ""
        )
        + "): "
        f"{record['verdict']['text']} [compiled in {record['compile_seconds']:.0f} s]"
    ]
    gpu = record.get("gpu")
    if gpu:
        lines.append(
            f"  estimate (roofline x {gpu['calibration']} calibration, not measured): "
            f"{gpu['estimated_step_seconds'] * 1e3:.1f} ms per step, MFU "
            f"{gpu['estimated_mfu']:.0%}; roofline {gpu['roofline_seconds'] * 1e3:.1f} ms, "
            f"{gpu['kernels']:,} kernels ({gpu['small_kernels']:,} under 64 KB), "
            f"non-matmul {gpu['non_matmul_bytes'] / 1e9:.0f} GB; a skipped step "
            f"{gpu.get('skipped_step_seconds', 0.0) * 1e3:.1f} ms more"
        )
    tpu = record.get("tpu")
    if tpu:
        loop = (
            f", the loop's body counted {tpu['loop_trips']} times" if tpu["loop_trips"] > 1 else ""
        )
        kernels = (
            f" (Pallas kernels {tpu['kernel_seconds'] * 1e3:.1f} ms, each compiled alone)"
            if tpu["kernel_seconds"]
            else ""
        )
        time_text = (
            f"{tpu['optimal_seconds'] * 1e3:.1f} ms per step{kernels}, "
            f"MFU {tpu['estimated_mfu']:.1%}"
            if tpu["optimal_seconds"]
            else f"no step time (libtpu's optimal_seconds: {tpu['compiler_optimal_seconds']:.4g})"
        )
        lines.append(
            f"  estimate (libtpu's cost model, not measured{loop}): {time_text}; "
            f"{tpu['bytes_accessed'] / 1e9:.1f} GB accessed; compiler "
            f"{tpu['compiler_flops'] / 1e12:.2f} TFLOP, model {tpu['model_flops'] / 1e12:.2f} "
            f"({tpu['compiler_flops'] / tpu['model_flops']:.1%})"
        )
        if "vector_seconds" in tpu:
            lines.append(_vector_line(tpu))
    return lines


def _vector_line(tpu: dict[str, Any]) -> str:
    """The console's line for the vector unit's time and the vector-aware bound."""
    bound = (
        f"; vector-aware bound {tpu['vector_aware_seconds'] * 1e3:.1f} ms per step, MFU at "
        f"most {tpu['vector_aware_mfu']:.1%}"
        if tpu["vector_aware_seconds"]
        else ""
    )
    missing = (
        f" (NOT counted: the kernels {', '.join(tpu['vector_unmatched_kernels'])})"
        if tpu["vector_unmatched_kernels"]
        else ""
    )
    return (
        f"  vector unit (not in libtpu's figure): {tpu['vector_ops'] / 1e9:,.0f} G elementwise "
        f"ops ({tpu['vector_kernel_ops'] / 1e9:,.0f} G in Pallas kernels{missing}) at "
        f"{tpu['vector_ops_per_second'] / 1e12:.1f} T/s, {tpu['vector_seconds'] * 1e3:.1f} ms"
        + bound
    )


def build(
    config: ml_collections.ConfigDict, devices: list[jax.Device], phase_names: list[str] | None
) -> tuple[sharded_run.ShardedRun, list[phase_schedule.Phase]]:
    """The sharded model, state and train step of `config`'s phases named `phase_names`."""
    settings = PretrainingSettings.of(config)
    mesh = sharded_run.make_mesh(settings.mesh, devices)
    phases = settings.phases
    train, model = settings.train, settings.model_config
    sharded_run.check_batches(mesh, phases, train.grad_accum_steps, model.max_position_embeddings)
    phases = [p for p in phases if not phase_names or p.name in phase_names]
    return sharded_run.build_pretraining(
        model,
        optim.optimizer_config(config.optimizer, train.total_steps),
        mesh,
        phases,
        train.grad_accum_steps,
        report=False,
    ), phases
