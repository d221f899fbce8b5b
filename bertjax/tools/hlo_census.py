"""What a compiled GPU step launches, read from its optimized HLO (`compiled.as_text()`).

Every kernel the step runs (a fusion, a cuBLAS or cuDNN custom call, a copy, an unfused op),
counted as often as it runs (loop bodies times their trip count; of a conditional's branches
the costliest), with its FLOPs (matmuls and fused attention) and the bytes it reads and
writes. The roofline estimate of a kernel is max(FLOPs / peak, bytes / bandwidth); the step's
is their sum: a lower bound that ignores launch gaps and imperfect kernels, not a measurement.
Kernels under a skipped step's name scope (`census`'s `skipped_step_scope`) run only when the
step is skipped, so they stay out of it and are reported apart.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping

SMALL_KERNEL_BYTES = 64 * 1024
# Ops that launch nothing (bookkeeping, or waits of an async op counted at its start).
FREE_OPS = frozenset(
    (
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "after-all",
        "partition-id",
        "replica-id",
        "opt-barrier",
        "add-dependency",
        "copy-done",
        "domain",
        "all-reduce-done",
        "all-gather-done",
        "collective-permute-done",
        "async-done",
        "async-update",
        "send-done",
        "recv-done",
        "while",
        "conditional",
        "call",
    )
)
# Custom-call targets of Pallas kernels on a GPU: the Triton lowering (jaxlib <= 0.10.2 lets
# XLA compile it; later jaxlibs compile it themselves) and Mosaic GPU.
PALLAS_GPU_TARGETS = frozenset(("__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "mosaic_gpu_v2"))
_SHAPE = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")


def _dtype_bytes(dtype: str) -> float:
    if dtype == "pred":
        return 1
    if dtype == "token":
        return 0
    bits = re.search(r"\d+", dtype)
    return int(bits.group()) / 8 if bits else 4


def shapes(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """`(dtype, dims)` of every array in an HLO type (a tuple type gives several)."""
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _SHAPE.findall(type_text)
    ]


def type_bytes(type_text: str) -> float:
    return sum(_dtype_bytes(dtype) * math.prod(dims) for dtype, dims in shapes(type_text))


@dataclasses.dataclass
class Instruction:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str


def _split_instruction(name: str, rest: str) -> Instruction:
    """`TYPE opcode(operands), attrs` -> its parts (the type may be a nested tuple)."""
    depth, end = 0, 0
    if rest.startswith("("):
        for end, char in enumerate(rest):  # noqa: B007 (read after the loop)
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        end += 1
    else:
        end = rest.index(" ")
    type_text, tail = rest[:end], rest[end:].lstrip()
    opcode = tail[: tail.index("(")]
    depth = 0
    for stop, char in enumerate(tail[len(opcode) :], len(opcode)):  # noqa: B007 (read after the loop)
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    operands = re.findall(r"%([\w.\-]+)", tail[len(opcode) : stop])
    return Instruction(name, type_text, opcode, operands, tail[stop + 1 :])


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """`({computation: instructions}, entry name)` of an HLO module's text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not _INSTRUCTION.match(line):
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif current is not None and (match := _INSTRUCTION.match(line)):
            current.append(_split_instruction(match.group(1), match.group(2)))
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


@dataclasses.dataclass
class Census:
    """Kernels of one step and their cost; `add` and `scaled` combine loop bodies."""

    kernels: Counter = dataclasses.field(default_factory=Counter)  # by category
    small_kernels: float = 0
    flops: float = 0
    bytes: float = 0
    matmul_bytes: float = 0
    seconds: float = 0  # roofline estimate
    skipped_step_seconds: float = 0  # what a skipped step adds (its costliest branch)
    # label (`census`'s `describe`) -> [launches, roofline seconds, bytes, FLOPs]
    groups: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def kernel_count(self) -> int:
        return int(sum(self.kernels.values()))

    @property
    def non_matmul_bytes(self) -> float:
        return self.bytes - self.matmul_bytes

    def add(self, other: Census, times: int = 1) -> None:
        for key, count in other.kernels.items():
            self.kernels[key] += count * times
        for field in (
            "small_kernels",
            "flops",
            "bytes",
            "matmul_bytes",
            "seconds",
            "skipped_step_seconds",
        ):
            setattr(self, field, getattr(self, field) + getattr(other, field) * times)
        for label, figures in other.groups.items():
            mine = self.groups.setdefault(label, [0.0] * len(figures))
            for i, value in enumerate(figures):
                mine[i] += value * times

    def as_dict(self) -> dict:
        return {
            "kernels": self.kernel_count,
            "small_kernels": int(self.small_kernels),
            "by_kind": dict(sorted((k, int(v)) for k, v in self.kernels.items())),
            "flops": self.flops,
            "bytes": self.bytes,
            "non_matmul_bytes": self.non_matmul_bytes,
            "roofline_seconds": self.seconds,
            "skipped_step_seconds": self.skipped_step_seconds,
        }


def attr(attrs: str, key: str) -> str | None:
    """The value of `key=` in an HLO instruction's attributes (a computation's name), or None."""
    match = re.search(rf"\b{key}=%?([\w.\-$]+)", attrs)
    return match.group(1) if match else None


def contracting_dims(attrs: str, key: str) -> list[int]:
    """The dimension list an HLO dot names under `key` (`lhs_contracting_dims`, ...)."""
    match = re.search(rf"\b{key}=\{{([\d,]*)\}}", attrs)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def dot_flops(out_type: str, lhs_type: str, contracting: list[int]) -> float:
    """A dot's FLOPs: 2 x its output's elements x the contracted extent of its lhs."""
    out, lhs = shapes(out_type)[0][1], shapes(lhs_type)[0][1]
    return 2.0 * math.prod(out) * math.prod(lhs[d] for d in contracting)


def _attention_flops(target: str, q_type: str, k_type: str) -> float:
    """cuDNN flash attention, BTNH operands: QK^T and PV forward (4 BNLqLkD FLOPs); the
    backward pass recomputes QK^T and forms dQ, dK, dV, dP (10 BNLqLkD)."""
    (b, lq, n, d), lk = shapes(q_type)[0][1], shapes(k_type)[0][1][1]
    return (10.0 if "backward" in target.lower() else 4.0) * b * n * lq * lk * d


def op_name(attrs: str) -> str:
    """The `op_name` of an HLO instruction's metadata (its JAX name stack), or ""."""
    found = re.search(r'op_name="([^"]*)"', attrs)
    return found.group(1) if found else ""


def pallas_name(attrs: str) -> str:
    """The name a Pallas kernel was given (`pallas_call(name=...)`, else its function's), read
    from its custom call's op_name (`.../NAME/pallas_call`)."""
    found = re.search(r'op_name="(?:[^"]*/)?([^"/]+)/pallas_call"', attrs)
    return found.group(1) if found else "?"


# A Pallas kernel's declared cost, by (name, result shapes): (FLOPs, bytes accessed).
PallasCosts = Mapping[tuple[str, tuple[tuple[int, ...], ...]], tuple[float, float]]
# (the kernel's instruction, its kind, the computations of its module) -> a group's label
Describe = Callable[[Instruction, str, dict[str, list[Instruction]]], str]


class _Analyzer:
    def __init__(
        self,
        text: str,
        peak_flops: float,
        bandwidth: float,
        pallas_costs: PallasCosts | None = None,
        describe: Describe | None = None,
        skipped_step_scope: str = "",
    ) -> None:
        self.computations, self.entry = parse_module(text)
        self.peak_flops, self.bandwidth = peak_flops, bandwidth
        self.pallas_costs = pallas_costs or {}
        self.describe = describe
        self.skipped_step_marker = f"/{skipped_step_scope}/" if skipped_step_scope else None
        self.cache: dict[str, Census] = {}

    def types(self, computation: str) -> dict[str, str]:
        return {i.name: i.type_text for i in self.computations[computation]}

    def census(self, computation: str) -> Census:
        if computation in self.cache:
            return self.cache[computation]
        result, types = Census(), self.types(computation)
        for ins in self.computations[computation]:
            if ins.opcode == "while":
                trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
                times = int(trips.group(1)) if trips else 1
                result.add(self.census(attr(ins.attrs, "body") or ""), times)
                result.add(self.census(attr(ins.attrs, "condition") or ""), times)
            elif ins.opcode == "conditional":
                branches = re.search(r"branch_computations=\{([^}]*)\}", ins.attrs) or re.search(
                    r"(true_computation=\S+ false_computation=\S+)", ins.attrs
                )
                assert branches is not None, f"a conditional without branches: {ins.attrs}"
                branch_censuses = [self.census(n) for n in re.findall(r"%([\w.\-]+)", branches[1])]
                chosen = max(branch_censuses, key=lambda c: c.seconds)
                result.add(chosen)
                result.skipped_step_seconds += (
                    max(c.skipped_step_seconds for c in branch_censuses)
                    - chosen.skipped_step_seconds
                )
            elif ins.opcode == "call":
                result.add(self.census(attr(ins.attrs, "to_apply") or ""))
            elif ins.opcode not in FREE_OPS:
                kernel = self.kernel(ins, types)
                if self.skipped_step_marker and self.skipped_step_marker in op_name(ins.attrs):
                    result.skipped_step_seconds += kernel.seconds
                else:
                    result.add(kernel)
        self.cache[computation] = result
        return result

    def kernel(self, ins: Instruction, types: dict[str, str]) -> Census:
        nbytes = type_bytes(ins.type_text) + sum(type_bytes(types.get(o, "")) for o in ins.operands)
        kind, flops = ins.opcode, 0.0
        if ins.opcode == "fusion":
            body = self.computations.get(attr(ins.attrs, "calls") or "", [])
            body_types = {i.name: i.type_text for i in body}
            flops = sum(
                dot_flops(
                    i.type_text,
                    body_types[i.operands[0]],
                    contracting_dims(i.attrs, "lhs_contracting_dims"),
                )
                for i in body
                if i.opcode == "dot"
            )
            root = body[-1].opcode if body else ""
            kind = (
                "matmul"
                if flops
                else ("copy" if root == "copy" else f"fusion:{attr(ins.attrs, 'kind') or '?'}")
            )
        elif ins.opcode == "dot":
            flops = dot_flops(
                ins.type_text,
                types[ins.operands[0]],
                contracting_dims(ins.attrs, "lhs_contracting_dims"),
            )
            kind = "matmul"
        elif ins.opcode == "custom-call":
            found = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
            target = found[1] if found else "?"
            if "gemm" in target or "matmul" in target:
                contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
                dims = (
                    [int(d) for d in re.findall(r"\d+", contracting.group(1))]
                    if contracting
                    else []
                )
                flops = dot_flops(ins.type_text, types[ins.operands[0]], dims)
                kind = "matmul"
            elif "fmha" in target:
                flops = _attention_flops(target, types[ins.operands[0]], types[ins.operands[1]])
                kind = "attention"
            elif target in PALLAS_GPU_TARGETS:
                kind = "pallas"
                key = (pallas_name(ins.attrs), tuple(dims for _, dims in shapes(ins.type_text)))
                flops, nbytes = self.pallas_costs.get(key, (0.0, nbytes))
            else:
                kind = f"custom-call:{target}"
        elif ins.opcode in ("copy", "copy-start"):
            kind = "copy"
        seconds = max(flops / self.peak_flops, nbytes / self.bandwidth)
        label = self.describe(ins, kind, self.computations) if self.describe else kind
        return Census(
            kernels=Counter({kind: 1}),
            small_kernels=float(nbytes < SMALL_KERNEL_BYTES),
            flops=flops,
            bytes=nbytes,
            matmul_bytes=nbytes if kind in ("matmul", "attention") or flops else 0.0,
            seconds=seconds,
            groups={label: [1.0, seconds, nbytes, flops]},
        )


def census(
    hlo_text: str,
    peak_tflops: float,
    bandwidth_bytes_per_second: float,
    pallas_costs: PallasCosts | None = None,
    describe: Describe | None = None,
    skipped_step_scope: str = "",
) -> Census:
    """The kernel census and roofline estimate of an optimized HLO module's text. A Pallas
    kernel costs what `pallas_costs` declares for it (else its operands' and results' bytes,
    no FLOPs); `describe` labels each kernel for `Census.groups` (default: its kind). Kernels
    whose op_name has the `skipped_step_scope` (a `jax.named_scope`) count only in
    `skipped_step_seconds`: a finite step never runs them."""
    analyzer = _Analyzer(
        hlo_text,
        peak_tflops * 1e12,
        bandwidth_bytes_per_second,
        pallas_costs,
        describe,
        skipped_step_scope,
    )
    return analyzer.census(analyzer.entry)
