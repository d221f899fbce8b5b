"""What libtpu's cost analysis of a compiled TPU step counts once, read from its optimized
HLO (`tools.tpu_estimate`): how often each while loop runs, and each instruction's FLOPs.

libtpu counts a while loop's body once. Besides the micro-batch loop, the SPMD partitioner
turns a matmul whose operand is sharded over many devices into a loop over the shards
("windowed einsum": `wide.windowed_dot_general_body_*`, a chunk of the matmul and a
collective permute per trip). Its trip count is in the loop itself: the condition compares
a counter with a constant, and the body adds a constant to it; with XLA's
`known_trip_count` annotation, that.
"""

from __future__ import annotations

import math
import re

from bertjax.tools import hlo_census

_CONSTANT = re.compile(r"%([\w.\-]+) = [su]\d+\[\]\S* constant\((-?\d+)\)")
_INDEX = re.compile(r"\bindex=(\d+)")


def integer_constants(hlo_text: str) -> dict[str, int]:
    """`{name: value}` of every integer scalar constant of an HLO module's text."""
    return {name: int(value) for name, value in _CONSTANT.findall(hlo_text)}


def trip_count(
    loop: hlo_census.Instruction,
    computations: dict[str, list[hlo_census.Instruction]],
    types_of_caller: dict[str, hlo_census.Instruction],
    constants: dict[str, int],
) -> int | None:
    """How often a while loop runs: its `known_trip_count`, or from a counter that starts at a
    constant, is compared `LT` with a constant and grows by a constant each trip (None when
    the loop is not of that form). `types_of_caller`: the instructions of the loop's
    computation, by name."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
    if known:
        return int(known.group(1))
    condition = computations.get(hlo_census.attr(loop.attrs, "condition") or "", [])
    body = computations.get(hlo_census.attr(loop.attrs, "body") or "", [])
    if not condition or not body or "direction=LT" not in condition[-1].attrs:
        return None
    compare, in_condition = condition[-1], {i.name: i for i in condition}
    counter = in_condition.get(compare.operands[0])
    limit = constants.get(compare.operands[1]) if len(compare.operands) > 1 else None
    if counter is None or counter.opcode != "get-tuple-element" or limit is None:
        return None
    index = int(_INDEX.search(counter.attrs).group(1))  # type: ignore[union-attr]
    start = _tuple_element_constant(loop.operands[0], index, types_of_caller, constants)
    in_body = {i.name: i for i in body}
    update = in_body.get(body[-1].operands[index]) if body[-1].opcode == "tuple" else None
    step = (
        constants.get(update.operands[1])
        if update is not None and update.opcode == "add" and len(update.operands) > 1
        else None
    )
    if start is None or not step:
        return None
    return max(math.ceil((limit - start) / step), 0)


def _tuple_element_constant(
    tuple_name: str,
    index: int,
    instructions: dict[str, hlo_census.Instruction],
    constants: dict[str, int],
) -> int | None:
    """The constant a loop's initial tuple holds at `index` (through copies), or None."""
    init = instructions.get(tuple_name)
    if init is None or init.opcode != "tuple" or index >= len(init.operands):
        return None
    name = init.operands[index]
    while name not in constants:
        value = instructions.get(name)
        if value is None or value.opcode not in ("copy", "bitcast", "convert"):
            return None
        name = value.operands[0]
    return constants[name]


def _valid_window_pairs(size: int, window: int, low: int, high: int) -> int:
    """(output, window) position pairs of one spatial dimension that fall on the input (not
    on its padding), at stride 1."""
    outputs = size + low + high - window + 1
    return sum(
        max(0, min(window, size + low - o) - max(0, low - o)) for o in range(max(outputs, 0))
    )


def convolution_flops(ins: hlo_census.Instruction, types: dict[str, str]) -> float:
    """FLOPs of a TPU `convolution` (how XLA's TPU backend writes matmuls: batch dimensions
    may become spatial windows over padding, which do no work): 2 per output element and
    contracted input feature, for each window position on the input."""
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if labels is None:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out = hlo_census.shapes(ins.type_text)[0][1]
    lhs = hlo_census.shapes(types[ins.operands[0]])[0][1]
    rhs = hlo_census.shapes(types[ins.operands[1]])[0][1]
    spatial = sum(c.isdigit() for c in out_labels)
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    text = window.group(1) if window else ""
    size = re.search(r"size=([\dx]+)", text)
    pad = re.search(r"pad=([\d_x\-]+)", text)
    windows = [int(s) for s in size.group(1).split("x")] if size else [1] * spatial
    pads = (
        [tuple(int(v) for v in p.split("_")) for p in pad.group(1).split("x")]
        if pad
        else [(0, 0)] * spatial
    )
    pairs = math.prod(
        _valid_window_pairs(lhs[lhs_labels.index(str(d))], windows[d], *pads[d])
        for d in range(spatial)
    )
    per_position = out[out_labels.index("b")] * out[out_labels.index("f")]
    return 2.0 * per_position * rhs[rhs_labels.index("i")] * pairs


class Flops:
    """Matmul FLOPs per run of each instruction: a fusion's by its body's convolutions and
    dots, a Pallas kernel's as it declares them (its custom call's cost estimate)."""

    def __init__(self, computations: dict[str, list[hlo_census.Instruction]]) -> None:
        self.computations = computations
        self.cache: dict[str, float] = {}

    def computation(self, name: str) -> float:
        if name not in self.cache:
            body = self.computations.get(name, [])
            types = {i.name: i.type_text for i in body}
            self.cache[name] = sum(self.instruction(i, types) for i in body)
        return self.cache[name]

    def instruction(self, ins: hlo_census.Instruction, types: dict[str, str]) -> float:
        if ins.opcode == "fusion":
            return self.computation(hlo_census.attr(ins.attrs, "calls") or "")
        if ins.opcode == "convolution":
            return convolution_flops(ins, types)
        if ins.opcode == "dot":
            return hlo_census.dot_flops(
                ins.type_text,
                types[ins.operands[0]],
                hlo_census.contracting_dims(ins.attrs, "lhs_contracting_dims"),
            )
        declared = re.search(r'"cost_estimate":\{[^}]*"flops":"?(\d+)', ins.attrs)
        return float(declared.group(1)) if ins.opcode == "custom-call" and declared else 0.0
