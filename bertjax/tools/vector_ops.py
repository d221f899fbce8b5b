"""The TPU vector unit's work in a compiled step, which libtpu's cost model does not charge.

libtpu's estimate (`tools.tpu_estimate`) takes a Pallas kernel's declared `CostEstimate` on
trust (MXU FLOPs, transcendentals, bytes) and charges nothing for integer vector work (a
chain of 500 integer multiply / xor-shift operations over an array costs exactly its bytes).
Here every elementwise operation (integer and float arithmetic, bitwise ops, shifts,
compares, selects, conversions, transcendentals) counts once per element it runs on, and a
reduction once per input element:
- in a Pallas kernel, from its jaxpr, times its grid (`kernel_ops`, found in the step's
  jaxpr by `pallas_equations`, matched to the compiled custom call by shape and declared cost);
- in XLA's fusions and unfused ops, from the optimized HLO (`HloVectorOps`).
Matmuls (MXU), transposes (XLU), copies, broadcasts and scalar ops are not counted. The
count is of the program as written; Mosaic and XLA may emit more (a division is one
operation here, several on the chip) or fewer.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend import core as jax_core

from bertjax.tools import hlo_census

# jaxpr primitives that run once per output element on the vector unit.
ELEMENTWISE_PRIMITIVES = frozenset(
    (
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "max",
        "min",
        "neg",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "cbrt",
        "pow",
        "integer_pow",
        "square",
        "sin",
        "cos",
        "erf",
        "erf_inv",
        "and",
        "or",
        "xor",
        "not",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "population_count",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "select_n",
        "clamp",
        "is_finite",
        "nextafter",
        "convert_element_type",
    )
)
# jaxpr reductions: once per input element.
REDUCTION_PRIMITIVES = frozenset(
    (
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
        "argmax",
        "argmin",
        "cumsum",
        "cummax",
        "cummin",
        "cumprod",
    )
)
# HLO opcodes that run once per output element on the vector unit.
ELEMENTWISE_OPCODES = frozenset(
    (
        "add",
        "subtract",
        "multiply",
        "divide",
        "remainder",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "sign",
        "floor",
        "ceil",
        "round-nearest-afz",
        "round-nearest-even",
        "exponential",
        "exponential-minus-one",
        "log",
        "log-plus-one",
        "tanh",
        "logistic",
        "sqrt",
        "rsqrt",
        "cbrt",
        "power",
        "sine",
        "cosine",
        "tan",
        "atan2",
        "erf",
        "and",
        "or",
        "xor",
        "not",
        "shift-left",
        "shift-right-logical",
        "shift-right-arithmetic",
        "popcnt",
        "count-leading-zeros",
        "compare",
        "select",
        "clamp",
        "is-finite",
        "convert",
        "bitcast-convert",
        "stochastic-convert",
    )
)
PALLAS_TARGET = "tpu_custom_call"


@dataclasses.dataclass(frozen=True)
class VectorUnit:
    """One TPU generation's vector unit: 8 sublanes x 128 lanes of `alus` ALUs per
    TensorCore, each one elementwise operation per cycle (one 32-bit value)."""

    alus: int  # per (sublane, lane)
    cores: int  # TensorCores per chip
    clock_hz: float

    @property
    def ops_per_second(self) -> float:
        """Elementwise operations per second per chip."""
        return 8 * 128 * self.alus * self.cores * self.clock_hz


# By the TPU topology's generation (`targets.Target.topology`). Sources and assumptions:
# docs/performance.md ("The vector unit"). The clocks reproduce each chip's bf16 peak from
# its MXUs (4 per core; 128x128, v6e 256x256, 2 FLOPs per cell and cycle).
VECTOR_UNITS = {
    "v4": VectorUnit(alus=2, cores=2, clock_hz=1.05e9),
    "v5e": VectorUnit(alus=4, cores=1, clock_hz=1.5e9),
    "v5": VectorUnit(alus=4, cores=2, clock_hz=1.75e9),
    "v6e": VectorUnit(alus=4, cores=1, clock_hz=1.75e9),
}


def vector_unit(topology: str) -> VectorUnit | None:
    """The vector unit of a TPU topology such as `v5:2x2x1` (None: not a known TPU)."""
    return VECTOR_UNITS.get(topology.split(":", maxsplit=1)[0])


def _size(aval: object) -> int:
    """Elements of an array value; 0 for scalars (the scalar unit's) and non-arrays."""
    shape = getattr(aval, "shape", ())
    return math.prod(shape) if shape else 0


def sub_jaxprs(params: dict[str, Any]) -> Iterator[jax_core.Jaxpr]:
    """The jaxprs among an equation's parameters (a closed jaxpr's inner one)."""
    for value in params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax_core.Jaxpr):
                yield item


def jaxpr_vector_ops(jaxpr: jax_core.Jaxpr) -> float:
    """Elementwise operations of a jaxpr (counted per element, reductions per input element);
    a scan's body times its length, a conditional's costliest branch, a while loop's body
    once, a Pallas kernel by `kernel_ops`."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ELEMENTWISE_PRIMITIVES:
            total += max((_size(v.aval) for v in eqn.outvars), default=0)
        elif name in REDUCTION_PRIMITIVES:
            total += _size(eqn.invars[0].aval)
        elif name == "pallas_call":
            total += kernel_ops(eqn)
        elif name == "cond":
            total += max((jaxpr_vector_ops(b) for b in sub_jaxprs(eqn.params)), default=0.0)
        else:
            inner = sum(jaxpr_vector_ops(j) for j in sub_jaxprs(eqn.params))
            total += inner * (eqn.params.get("length", 1) if name == "scan" else 1)
    return total


def kernel_ops(eqn: jax_core.JaxprEqn) -> float:
    """A `pallas_call` equation's elementwise operations: its body's, once per grid step."""
    grid = eqn.params["grid_mapping"].grid
    return jaxpr_vector_ops(eqn.params["jaxpr"]) * math.prod(int(g) for g in grid)


def kernel_key(
    dims: Sequence[int], flops: object, transcendentals: object, bytes_accessed: object
) -> str:
    """A Pallas kernel's identity in both the jaxpr and the compiled HLO (which keeps no
    kernel name): its first output's shape and its declared cost."""
    return f"{list(dims)} flops={flops} transcendentals={transcendentals} bytes={bytes_accessed}"


def pallas_equations(jaxpr: jax_core.Jaxpr) -> dict[str, jax_core.JaxprEqn]:
    """`{kernel_key: its pallas_call equation}` of every Pallas kernel in a jaxpr (nested ones
    included; the shapes are a shard's under `shard_map`, as the compiled custom call has
    them)."""
    found: dict[str, jax_core.JaxprEqn] = {}

    def walk(inner: jax_core.Jaxpr) -> None:
        for eqn in inner.eqns:
            if eqn.primitive.name == "pallas_call":
                cost = eqn.params["cost_estimate"]
                key = kernel_key(
                    tuple(eqn.params["out_avals"][0].shape),
                    *(
                        getattr(cost, f, None)
                        for f in ("flops", "transcendentals", "bytes_accessed")
                    ),
                )
                found[key] = eqn
            for sub in sub_jaxprs(eqn.params):
                walk(sub)

    walk(jaxpr)
    return found


def pallas_kernels(equations: dict[str, jax_core.JaxprEqn]) -> dict[str, float]:
    """`{kernel_key: elementwise operations per call}` of the Pallas kernels `equations`
    (`pallas_equations`)."""
    return {key: kernel_ops(eqn) for key, eqn in equations.items()}


def hlo_kernel_key(ins: hlo_census.Instruction) -> str | None:
    """The `kernel_key` of a compiled Pallas kernel's custom call; None for any other
    instruction."""
    if ins.opcode != "custom-call" or PALLAS_TARGET not in ins.attrs:
        return None
    return kernel_key(
        hlo_census.shapes(ins.type_text)[0][1],
        *(_declared(ins.attrs, f) for f in ("flops", "transcendentals", "bytes_accessed")),
    )


def _declared(attrs: str, field: str) -> str:
    """A field of a Pallas custom call's declared cost estimate ("None" when undeclared)."""
    found = re.search(rf'"cost_estimate":\{{[^}}]*"{field}":"?(\d+)', attrs)
    return found.group(1) if found else "None"


class HloVectorOps:
    """Elementwise operations per run of each instruction of an optimized HLO module: a
    fusion's by its body, an unfused elementwise op's or reduction's, a Pallas kernel's by
    `kernels` (`pallas_kernels`; 0 for one not there)."""

    def __init__(
        self, computations: dict[str, list[hlo_census.Instruction]], kernels: dict
    ) -> None:
        self.computations, self.kernels = computations, kernels
        self.cache: dict[str, float] = {}
        self.unmatched_kernels: set[str] = set()

    def computation(self, name: str) -> float:
        if name not in self.cache:
            body = self.computations.get(name, [])
            types = {i.name: i.type_text for i in body}
            self.cache[name] = sum(self.instruction(i, types) for i in body)
        return self.cache[name]

    def instruction(self, ins: hlo_census.Instruction, types: dict[str, str]) -> float:
        """Elementwise operations of one run of `ins` (`types`: its computation's values)."""
        if ins.opcode in ELEMENTWISE_OPCODES:
            return float(_elements(ins.type_text))
        if ins.opcode in ("fusion", "call"):
            return self.computation(
                hlo_census.attr(ins.attrs, "calls") or hlo_census.attr(ins.attrs, "to_apply") or ""
            )
        if ins.opcode in ("reduce", "reduce-window"):
            reducer = hlo_census.attr(ins.attrs, "to_apply") or ""
            per_element = sum(
                i.opcode in ELEMENTWISE_OPCODES for i in self.computations.get(reducer, [])
            )
            inputs = ins.operands[: len(ins.operands) // 2]
            return float(max((_elements(types.get(o, "")) for o in inputs), default=0)) * max(
                per_element, 1
            )
        key = hlo_kernel_key(ins)
        if key is not None:
            if key not in self.kernels:
                self.unmatched_kernels.add(key)
            return self.kernels.get(key, 0.0)
        return 0.0


def _elements(type_text: str) -> int:
    """Elements of an HLO value (the largest array of a tuple; 0 for a scalar)."""
    return max((math.prod(dims) for _, dims in hlo_census.shapes(type_text) if dims), default=0)
