"""libtpu's own estimate of a compiled TPU step, and where its time and bytes go.

A deviceless libtpu compile fills `compiled.cost_analysis()` with `optimal_seconds` (its cost
model's time for the step), `flops` and `bytes accessed`, and writes each instruction's
`estimated_cycles` into the optimized HLO. Both count a while loop's body once, whatever its
trip count (BERT-tiny on tpu-v5p-8: 2.10 GFLOP in one micro-batch, 1.07 in two; the loops
over the shards of a windowed einsum likewise, `tools.tpu_hlo`): the step is scaled here by
each instruction's share, its cycles, bytes and matmul FLOPs counted as often as its loops
run. A Pallas kernel's custom call has no `estimated_cycles`, though `optimal_seconds`
charges it (by its declared `CostEstimate`): each kernel is compiled alone for the same chip
(`kernel_seconds`), and the step's other instructions share what is left of the step's time
by their cycles. Estimates of the compiler that will run the job, not measurements.

Beside it, the vector unit's time (`tools.vector_ops`): the step's elementwise operations at
the unit's rate, and the vector-aware bound, each instruction taking at least the longer of
libtpu's time and its vector time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core

from bertjax.tools import hlo_census, tpu_hlo, vector_ops

_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


@dataclasses.dataclass
class Op:
    """One instruction the step runs: its cycles and bytes (operands and outputs), once and
    as often as it runs."""

    name: str
    opcode: str
    op_name: str  # the JAX source op (metadata), "" for the compiler's own
    cycles_once: int
    bytes_once: float
    times: int
    vector_ops_once: float = 0.0  # elementwise operations (`vector_ops`)
    flops_once: float = 0.0  # matmul FLOPs (`tpu_hlo.Flops`)
    kernel_seconds_once: float = 0.0  # a Pallas kernel's libtpu time, compiled alone

    @property
    def kernel_seconds(self) -> float:
        return self.kernel_seconds_once * self.times

    def seconds(self, seconds_per_cycle: float) -> float:
        """libtpu's time for the instruction as often as it runs: its cycles at
        `seconds_per_cycle`, or a Pallas kernel's own time."""
        return self.cycles * seconds_per_cycle + self.kernel_seconds

    @property
    def cycles(self) -> int:
        return self.cycles_once * self.times

    @property
    def bytes(self) -> float:
        return self.bytes_once * self.times

    @property
    def flops(self) -> float:
        return self.flops_once * self.times

    @property
    def vector_ops(self) -> float:
        return self.vector_ops_once * self.times


def operations(
    hlo_text: str,
    loop_trips: int = 1,
    kernels: dict[str, float] | None = None,
    unmatched_kernels: set[str] | None = None,
    kernel_seconds: dict[str, float] | None = None,
) -> list[Op]:
    """Every instruction of the entry computation and of its while loops' bodies, as often
    as it runs (a loop's trip count from `tpu_hlo.trip_count`, or `loop_trips`: the
    micro-batches), with its matmul FLOPs and its elementwise operations (Pallas kernels' from
    `kernels`, `vector_ops.pallas_kernels`;
    those not there are added to `unmatched_kernels`) and their libtpu time from
    `kernel_seconds`. A conditional's branches are left out: in this step it only names the
    cause of a skipped update."""
    computations, entry = hlo_census.parse_module(hlo_text)
    counter = vector_ops.HloVectorOps(computations, kernels or {})
    flops = tpu_hlo.Flops(computations)
    constants = tpu_hlo.integer_constants(hlo_text)
    ops: list[Op] = []

    def walk(computation: str, times: int) -> None:
        instructions = {i.name: i for i in computations[computation]}
        types = {name: i.type_text for name, i in instructions.items()}
        for ins in computations[computation]:
            if ins.opcode == "while":
                trips = tpu_hlo.trip_count(ins, computations, instructions, constants)
                walk(hlo_census.attr(ins.attrs, "body") or "", times * (trips or loop_trips))
            elif ins.opcode not in hlo_census.FREE_OPS or ins.opcode == "call":
                if ins.opcode == "call":
                    walk(hlo_census.attr(ins.attrs, "to_apply") or "", times)
                    continue
                cycles = _CYCLES.search(ins.attrs)
                kernel = vector_ops.hlo_kernel_key(ins)
                ops.append(
                    Op(
                        ins.name,
                        ins.opcode,
                        hlo_census.op_name(ins.attrs),
                        int(cycles.group(1)) if cycles else 0,
                        hlo_census.type_bytes(ins.type_text)
                        + sum(hlo_census.type_bytes(types.get(o, "")) for o in ins.operands),
                        times,
                        counter.instruction(ins, types),
                        flops.instruction(ins, types),
                        (kernel_seconds or {}).get(kernel, 0.0) if kernel else 0.0,
                    )
                )

    walk(entry, 1)
    if unmatched_kernels is not None:
        unmatched_kernels.update(counter.unmatched_kernels)
    return ops


def _ratio(total: float, once: float) -> float:
    return total / once if once else 1.0


def estimate(
    cost: dict[str, float],
    hlo_text: str,
    loop_trips: int,
    model_flops: float,
    peak_tflops: float,
    top: int = 0,
    kernels: dict[str, float] | None = None,
    unit: vector_ops.VectorUnit | None = None,
    kernel_seconds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The step's estimated time, MFU, bytes and FLOPs from libtpu's `cost` (one device),
    scaled for a loop of `loop_trips` micro-batches; with the vector `unit`, its time for the
    step's elementwise operations (Pallas `kernels`' from `vector_ops.pallas_kernels`) and
    the vector-aware bound (`vector_aware`); Pallas kernels take their time alone from
    `kernel_seconds` (the function's), the other instructions the rest by their cycles;
    `top` > 0 adds the costliest groups of instructions (`census`)."""
    unmatched: set[str] = set()
    ops = operations(hlo_text, loop_trips, kernels, unmatched, kernel_seconds)
    cycles_once = sum(op.cycles_once for op in ops)
    cycles = sum(op.cycles for op in ops)
    time_scale = _ratio(cycles, cycles_once)
    # libtpu 0.0.42 gives a negative figure for v4 and v5e steps (-5.0 s for BERT-tiny):
    # no estimate then.
    compiler_seconds = max(float(cost.get("optimal_seconds", 0.0)), 0.0)
    kernels_seconds = sum(op.kernel_seconds for op in ops)
    # The instructions with cycles share the step's time once its kernels' is taken out.
    rest_once = max(compiler_seconds - sum(op.kernel_seconds_once for op in ops), 0.0)
    seconds = (rest_once * time_scale + kernels_seconds) if compiler_seconds else None
    # Scaled by each instruction's matmul FLOPs as often as it runs (the micro-batch loop's
    # and the windowed einsums' bodies, `tpu_hlo`); without matmuls, by the micro-batches.
    flops_once = sum(op.flops_once for op in ops)
    flops = float(cost.get("flops", 0.0)) * (
        sum(op.flops for op in ops) / flops_once if flops_once else loop_trips
    )
    result: dict[str, Any] = {
        "optimal_seconds": seconds,
        "compiler_optimal_seconds": cost.get("optimal_seconds"),
        "loop_trips": loop_trips,
        "time_scale": time_scale,
        "bytes_accessed": float(cost.get("bytes accessed", 0.0))
        * _ratio(sum(op.bytes for op in ops), sum(op.bytes_once for op in ops)),
        "compiler_flops": flops,
        "model_flops": model_flops,
        "estimated_mfu": model_flops / seconds / (peak_tflops * 1e12) if seconds else None,
        "cycles": cycles,
        "instructions": len(ops),
        "kernel_seconds": kernels_seconds,
    }
    seconds_per_cycle = rest_once / cycles_once if compiler_seconds and cycles_once else 0.0
    rate = unit.ops_per_second if unit else 0.0
    if unit:
        result.update(vector_aware(ops, seconds_per_cycle, rate, model_flops, peak_tflops))
        # Pallas kernels whose jaxpr was not found: their vector work is missing.
        result["vector_unmatched_kernels"] = sorted(unmatched)
    if top:
        result["census"] = census(ops, seconds_per_cycle, top, rate, peak_tflops)
    return result


def vector_aware(
    ops: list[Op], seconds_per_cycle: float, rate: float, model_flops: float, peak_tflops: float
) -> dict[str, Any]:
    """The vector unit's time for the step's elementwise operations at `rate` per second, and
    the vector-aware bound: each instruction takes at least the longer of libtpu's time
    (`Op.seconds`; `seconds_per_cycle` 0: no step time) and its vector time, the MXU, the
    vector unit and the memory working in parallel (a bound on the step's time from below,
    so the MFU it implies is one from above)."""
    vector = sum(op.vector_ops for op in ops)
    bound = (
        sum(max(op.seconds(seconds_per_cycle), op.vector_ops / rate) for op in ops)
        if seconds_per_cycle
        else None
    )
    return {
        "vector_ops": vector,
        "vector_kernel_ops": sum(op.vector_ops for op in ops if op.opcode == "custom-call"),
        "vector_ops_per_second": rate,
        "vector_seconds": vector / rate,
        "vector_aware_seconds": bound,
        "vector_aware_mfu": model_flops / bound / (peak_tflops * 1e12) if bound else None,
    }


def _group(op: Op) -> str:
    """The instruction's source op with layer numbers folded: `layer_N/...`."""
    name = re.sub(r"layer_\d+", "layer_N", op.op_name).replace("jit(train_step)/", "")
    if not name:
        name = "(compiler) " + re.sub(r"[.\d]+$", "", op.name)
    return f"{op.opcode}: {name}"


def census(
    ops: list[Op],
    seconds_per_cycle: float,
    top: int,
    vector_rate: float = 0.0,
    peak_tflops: float = 0.0,
) -> list[dict[str, Any]]:
    """The `top` costliest groups of instructions (same opcode and source op, every layer
    together), by estimated time, then cycles: cycles, seconds (`Op.seconds`; without an
    estimate of the step, a Pallas kernel's only), bytes, how many run per step, their
    matmul FLOPs and, with the chip's `peak_tflops`, the share of the peak those FLOPs get
    in that time (how well libtpu runs the group's matmuls); with the vector unit's
    `vector_rate`, its seconds."""
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * 6)
    for op in ops:
        group = groups[_group(op)]
        group[0] += op.seconds(seconds_per_cycle)
        group[1] += op.cycles
        group[2] += op.bytes
        group[3] += op.times
        group[4] += op.vector_ops
        group[5] += op.flops
    ranked = sorted(groups.items(), key=lambda item: (-item[1][0], -item[1][1], -item[1][2]))
    return [
        {
            "op": name,
            "cycles": int(c),
            "seconds": s,
            "bytes": b,
            "count": int(n),
            "matmul_flops": f,
        }
        | (
            {"matmul_share_of_peak": f / s / (peak_tflops * 1e12)}
            if f and s and peak_tflops
            else {}
        )
        | ({"vector_seconds": v / vector_rate} if vector_rate else {})
        for name, (s, c, b, n, v, f) in ranked[:top]
    ]


def kernel_seconds(equations: dict[str, jax_core.JaxprEqn], device: jax.Device) -> dict[str, float]:
    """`{kernel_key: libtpu's time}` of each Pallas kernel (`vector_ops.pallas_equations`)
    compiled alone for `device`: what the step's `optimal_seconds` charges for it (by its
    declared `CostEstimate`), which the step's HLO leaves out of its cycles."""
    placed = jax.sharding.SingleDeviceSharding(device)
    found = {}
    for key, eqn in equations.items():
        operands = [
            jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=placed)
            for aval in (typing.cast(jax.core.ShapedArray, v.aval) for v in eqn.invars)
        ]
        kernel = jax.jit(functools.partial(eqn.primitive.bind, **eqn.params))
        found[key] = max(_optimal_seconds(kernel.lower(*operands).compile()), 0.0)
    return found


def _optimal_seconds(compiled: jax.stages.Compiled) -> float:
    """libtpu's `optimal_seconds` for a program compiled alone for one device."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost is not None, "libtpu's compiles have a cost analysis"
    return float(cost["optimal_seconds"])


def matmul_calibration(device: jax.Device, peak_tflops: float, size: int = 8192) -> float:
    """The share of `peak_tflops` at which libtpu's cost model puts one `size`^3 bfloat16
    matmul on `device`: how far its `optimal_seconds` sits from the chip's peak."""
    operand = jax.ShapeDtypeStruct(
        (size, size), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    seconds = _optimal_seconds(jax.jit(jnp.matmul).lower(operand, operand).compile())
    return 2.0 * size**3 / seconds / (peak_tflops * 1e12)
