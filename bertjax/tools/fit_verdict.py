"""The fit verdict of a compiled (or refused) train step: does it fit the device's memory,
with how much headroom (the TPU compiler's refusal parsed), and if not, the settings to try,
cheapest first (`tools.advice` compiles them and advises only one the compiler confirms)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the verdict is pure Python: nothing imported at run time)
    import ml_collections

GIB = 1024**3


def parse_refusal(message: str) -> tuple[float, float] | None:
    """`(required, available)` bytes from the TPU compiler's out-of-memory error, or None."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number = r"([\d.]+)([KMGT])i?B?"
    match = re.search(
        rf"required for [^(]*\({number}\) exceeds available HBM \({number}\)", message
    ) or re.search(rf"Used {number} of {number} hbm", message)
    if not match:
        return None
    required, unit, available, unit2 = match.groups()
    return float(required) * units[unit], float(available) * units[unit2]


def candidates(
    required: float,
    available: float,
    arguments: float,
    config: ml_collections.ConfigDict,
    per_device_batch: int,
    steps: int = 1,
) -> list[dict[str, Any]]:
    """Settings that may make `required` bytes fit in `available`, cheapest in step time
    first, each `{"flags": ..., "overrides": {dotted config key: value}}`, for the compiler
    to confirm: sharding the state (first when it takes half the memory: nothing else
    shrinks it), more micro-batches (no extra FLOPs; the two smallest divisors of the
    per-device batch near the activations' excess), recomputation (`dots`, then `full`: one
    more forward pass), sharding the state."""
    shard: dict[str, int | str] | None = (
        {"mesh.fsdp": -1, "mesh.data": 1} if config.mesh.fsdp == 1 else None
    )
    state_first = shard is not None and arguments > available / 2
    found: list[dict[str, int | str]] = [shard] if shard is not None and state_first else []
    excess = max(required - arguments, 1.0) / max(available - arguments, 1.0)
    divisors = [
        d
        for d in range(steps + 1, per_device_batch + 1)
        if per_device_batch % d == 0 and d >= min(steps * excess, per_device_batch)
    ]
    found += [{"train.grad_accum_steps": d} for d in divisors[:2]]
    policies = {"none": ["dots", "full"], "dots_no_batch": ["dots", "full"], "dots": ["full"]}
    found += [{"model.remat_policy": p} for p in policies.get(config.model.remat_policy, [])]
    found += [shard] if shard and not state_first else []
    return [
        {"flags": " ".join(f"--config.{k}={v}" for k, v in o.items()), "overrides": o}
        for o in found
    ]


def verdict(
    sizes: dict[str, int] | None,
    refused: tuple[float, float] | None,
    available: float | None,
    config: ml_collections.ConfigDict,
    per_device_batch: int,
    state_bytes: int,
    steps: int = 1,
) -> dict[str, Any]:
    """`{"fits": bool | None, "text": ...}` from the compiled step's memory or the refusal;
    `state_bytes`: the train state's bytes per device (the step's arguments, bar the batch);
    `steps`: the phase's micro-batches."""
    if refused:
        required, available = refused
        arguments = state_bytes
        return {
            "fits": False,
            "required_bytes": required,
            "available_bytes": available,
            "candidates": candidates(
                required, available, arguments, config, per_device_batch, steps
            ),
            "text": f"does NOT fit: the compiler needs {required / GIB:.1f} GiB of "
            f"{available / GIB:.2f} GiB per device",
        }
    if not sizes or available is None:
        return {
            "fits": None,
            "text": "no memory verdict on fake CPU devices (compile for a --target)",
        }
    peak = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    if peak > available:
        return {
            "fits": False,
            "required_bytes": peak,
            "available_bytes": available,
            "candidates": candidates(
                peak, available, sizes["argument"], config, per_device_batch, steps
            ),
            "text": f"does NOT fit: peak {peak / GIB:.1f} GiB of {available / GIB:.2f} GiB "
            "per device",
        }
    return {
        "fits": True,
        "required_bytes": peak,
        "available_bytes": available,
        "text": f"fits: peak {peak / GIB:.1f} GiB of {available / GIB:.2f} GiB per device, "
        f"{(available - peak) / GIB:.1f} GiB headroom",
    }
