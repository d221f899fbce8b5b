"""What a GPU train step's kernels do, and where its roofline time goes (`tools.aot` for a
GPU target; tables: `benchmarks/aot/gpu_census.py`).

Each kernel of `hlo_census` gets a label: the pass it belongs to (forward, backward, or the
update after the gradients, from its op_name), the model's module it comes from (layers
numbered alike are one), what its fused computation does (`TAGS`: the dropout mask's hash,
LayerNorm, softmax, GELU, ...), and its result's shape. Kernels of one label are one group.
Pallas kernels cost what their `pl.CostEstimate` declares, read from the step's jaxpr
(`pallas_costs`): XLA counts none of a custom call's FLOPs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from jax.extend import core as jax_core

from bertjax.tools import hlo_census, vector_ops

# What a fusion's ops say it computes, checked in this order (the first is its family).
# A tag needs every opcode of its set somewhere in the fusion (nested computations included).
TAGS: tuple[tuple[str, frozenset[str]], ...] = (
    ("dropout mask hash", frozenset({"xor", "shift-right-logical", "shift-left"})),
    ("softmax", frozenset({"exponential", "reduce"})),
    ("layernorm", frozenset({"rsqrt"})),
    ("optimizer", frozenset({"sqrt"})),
    ("dropout apply", frozenset({"shift-right-logical"})),
    ("log", frozenset({"log"})),
    ("reduce", frozenset({"reduce"})),
    ("transpose", frozenset({"transpose"})),
)
_PASSES = (("transpose(jvp(", "bwd"), ("jvp(", "fwd"))
# An elementwise kernel's family by the first of these parts of its module path.
_MODULE_FAMILIES = (
    ("attention/self", "attention internals (einsum: scores, softmax, mask, layout)"),
    ("LayerNorm", "layernorm (+ bias, dropout, residual)"),
    ("Dropout", "dropout"),
    ("intermediate", "bias + gelu"),
    ("dense", "bias, dropout (dense output)"),
    ("embeddings", "embeddings"),
    ("predictions", "MLM head + loss"),
    ("seq_relationship", "NSP head + loss"),
)


def _opcodes(
    computation: str, computations: dict[str, list[hlo_census.Instruction]], seen: set[str]
) -> Iterator[str]:
    """Every opcode of `computation` and of the computations it calls."""
    if computation in seen:
        return
    seen.add(computation)
    for ins in computations.get(computation, []):
        yield ins.opcode
        for key in ("calls", "to_apply"):
            callee = hlo_census.attr(ins.attrs, key)
            if callee:
                yield from _opcodes(callee, computations, seen)


def tags(
    ins: hlo_census.Instruction, computations: dict[str, list[hlo_census.Instruction]]
) -> list[str]:
    """`TAGS` that a fusion's ops match, in `TAGS`'s order, without those whose ops an
    earlier match already used (the hash's shifts are no second "dropout apply")."""
    ops = set(_opcodes(hlo_census.attr(ins.attrs, "calls") or "", computations, set()))
    found: list[str] = []
    used: set[str] = set()
    for tag, needed in TAGS:
        if needed <= ops and not needed <= used:
            found.append(tag)
            used |= needed
    return found


def where(attrs: str) -> tuple[str, str]:
    """(pass, module path) from a kernel's op_name: "fwd" / "bwd" inside the model's
    differentiation, else "update"; the path without the jit and layer numbers."""
    name = hlo_census.op_name(attrs)
    step = "update"
    for marker, label in _PASSES:
        if marker in name:
            step = label
            break
    path = [
        part
        for part in name.split("/")
        if not part.startswith(("jit(", "jvp(", "transpose(")) and part not in ("bert", "encoder")
    ]
    module = "/".join(path[:-1] if len(path) > 1 else path)
    return step, re.sub(r"_\d+\b", "_N", module)


def family(kind: str, fusion_tags: list[str], step: str, module: str) -> str:
    """The census's coarse grouping: matmul, attention, a Pallas kernel, a copy, the update's
    kernels ("optimizer"), else an elementwise kernel by the model part it belongs to (its
    op_name: XLA names a fusion after its root) or, failing that, the first thing it fuses."""
    if kind in ("matmul", "attention", "pallas", "copy"):
        return kind
    if step == "update":
        return "optimizer"
    for part, name in _MODULE_FAMILIES:
        if part in module:
            return name
    if "dropout mask hash" in fusion_tags:
        return "dropout mask"
    return fusion_tags[0] if fusion_tags else "elementwise"


def describe(
    ins: hlo_census.Instruction, kind: str, computations: dict[str, list[hlo_census.Instruction]]
) -> str:
    """A kernel's group label: `family | pass module [tags] result-shape`."""
    fusion_tags = tags(ins, computations) if ins.opcode == "fusion" and kind != "matmul" else []
    step, module = where(ins.attrs)
    result = ",".join(f"{d}[{'x'.join(map(str, s))}]" for d, s in hlo_census.shapes(ins.type_text))
    what = f" [{'+'.join(fusion_tags)}]" if fusion_tags else ""
    if kind == "pallas":
        name = hlo_census.pallas_name(ins.attrs)
        module, what = module.removesuffix(f"/{name}"), f" [{name}]"
    return f"{family(kind, fusion_tags, step, module)} | {step} {module}{what} {result}"


def pallas_costs(jaxpr: jax_core.Jaxpr) -> dict[tuple[str, tuple], tuple[float, float]]:
    """{(name, result shapes): (FLOPs, bytes accessed)} of every Pallas kernel in `jaxpr`
    (nested jaxprs included) that declares a `pl.CostEstimate`."""
    costs: dict[tuple[str, tuple], tuple[float, float]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call" and eqn.params.get("cost_estimate"):
            estimate = eqn.params["cost_estimate"]
            name = str(eqn.params.get("name") or eqn.params["jaxpr"].debug_info.func_name)
            shapes = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
            costs[(name, shapes)] = (float(estimate.flops), float(estimate.bytes_accessed))
        for sub in vector_ops.sub_jaxprs(eqn.params):
            costs.update(pallas_costs(sub))
    return costs


def summarize(census: hlo_census.Census, top: int) -> dict[str, Any]:
    """The record's view of a labelled census: launches, time, bytes and FLOPs by family, and
    the `top` costliest groups."""
    families: dict[str, list[float]] = {}
    for label, figures in census.groups.items():
        totals = families.setdefault(label.split(" | ")[0], [0.0] * len(figures))
        for i, value in enumerate(figures):
            totals[i] += value

    def row(name: str, figures: list[float]) -> dict[str, Any]:
        count, seconds, nbytes, flops = figures
        return {
            "group": name,
            "count": int(count),
            "seconds": seconds,
            "bytes": nbytes,
            "flops": flops,
        }

    by_time = sorted(census.groups.items(), key=lambda item: -item[1][1])
    return {
        "families": [
            row(name, figures)
            for name, figures in sorted(families.items(), key=lambda item: -item[1][1])
        ],
        "groups": [row(name, figures) for name, figures in by_time[:top]],
    }
