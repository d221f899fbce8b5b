"""The fit verdict of a compiled (or refused) train step: does it fit the device's memory,
with how much headroom, and if not, what to change (the TPU compiler's refusal parsed)."""
from __future__ import annotations

import math
import re
from typing import Any

GIB = 1024 ** 3


def parse_refusal(message: str) -> tuple[float, float] | None:
    """`(required, available)` bytes from the TPU compiler's out-of-memory error, or None."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
    number = r"([\d.]+)([KMGT])i?B?"
    match = (re.search(rf"required for [^(]*\({number}\) exceeds available HBM \({number}\)",
                       message)
             or re.search(rf"Used {number} of {number} hbm", message))
    if not match:
        return None
    required, unit, available, unit2 = match.groups()
    return float(required) * units[unit], float(available) * units[unit2]


def advice(required: float, available: float, arguments: float, config: Any,
           per_device_batch: int, steps: int = 1) -> str:
    """What to change so that `required` bytes fit in `available`: shard the state when it
    takes half the memory, else split the batch (accumulation) or recompute (remat)."""
    if arguments > available / 2 and config.mesh.fsdp == 1:
        return "shard parameters and optimizer state: --config.mesh.fsdp=-1 --config.mesh.data=1"
    activations = max(required - arguments, 1.0)
    factor = 2 ** math.ceil(math.log2(max(activations / max(available - arguments, 1.0), 1.0)))
    hints = []
    if per_device_batch % (steps * factor) == 0 and per_device_batch // (steps * factor):
        hints.append(f"--config.train.grad_accum_steps={steps * factor}")
    remat = {"none": "dots", "dots_no_batch": "dots", "dots": "full"}.get(
        config.model.remat_policy)
    if remat:
        hints.append(f"--config.model.remat_policy={remat}")
    if config.mesh.fsdp == 1:
        hints.append("--config.mesh.fsdp=-1 --config.mesh.data=1")
    return "try " + " or ".join(hints) if hints else "use more devices"


def verdict(sizes: dict[str, int] | None, refused: tuple[float, float] | None,
            available: float | None, config: Any, per_device_batch: int,
            state_bytes: int, steps: int = 1) -> dict[str, Any]:
    """`{"fits": bool | None, "text": ...}` from the compiled step's memory or the refusal;
    `state_bytes`: the train state's bytes per device (the step's arguments, bar the batch);
    `steps`: the phase's micro-batches."""
    if refused:
        required, available = refused
        arguments = state_bytes
        return {"fits": False, "required_bytes": required, "available_bytes": available,
                "text": f"does NOT fit: the compiler needs {required / GIB:.1f} GiB of "
                        f"{available / GIB:.2f} GiB per device; " + advice(
                            required, available, arguments, config, per_device_batch, steps)}
    if not sizes or available is None:
        return {"fits": None,
                "text": "no memory verdict on fake CPU devices (compile for a --target)"}
    peak = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
    if peak > available:
        return {"fits": False, "required_bytes": peak, "available_bytes": available,
                "text": f"does NOT fit: peak {peak / GIB:.1f} GiB of {available / GIB:.2f} GiB "
                        "per device; " + advice(peak, available, sizes["argument"], config,
                                                per_device_batch, steps)}
    return {"fits": True, "required_bytes": peak, "available_bytes": available,
            "text": f"fits: peak {peak / GIB:.1f} GiB of {available / GIB:.2f} GiB per device, "
                    f"{(available - peak) / GIB:.1f} GiB headroom"}
