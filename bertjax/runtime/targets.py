"""Accelerators to compile for from a CPU host: compile-only devices of a TPU slice or a GPU.

`devices("tpu-v5e-8")` gives the devices of that slice as the real compiler sees them
(`jax.experimental.topologies`), with no accelerator attached: libtpu compiles for TPUs, the
CUDA PJRT plugin for GPUs from the target configs in `tools/gpu_targets/` (needs
`pip install -e '.[aot]'`). A raw TPU topology such as `v5e:4x4` or `v4:2x2x2` works too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.resources
import os
import re
from collections.abc import Iterator

import jax

from bertjax.errors import UserError

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Target:
    """One slice or GPU: how to ask for its devices, and the figures verdicts use."""

    name: str
    platform: str  # "tpu" | "cuda"
    topology: str  # TPU: "v4:2x2x1"; GPU: the target config's name in tools/gpu_targets
    hbm_bytes: int  # what one device's compiler may use (TPU: its own figure; GPU: see below)
    peak_tflops: float  # dense bf16 per chip
    hbm_bytes_per_second: float  # per chip, for the roofline estimate
    device_kind: str  # as `jax.Device.device_kind` says
    chip_config: str = "default"  # TPU: "megacore" for v4 / v5p


# The TPU figures are the compiler's "available HBM" (from its refusal of an oversized
# program, libtpu 0.0.42); GPU: 75% of the device memory, the share JAX's allocator takes
# by default (XLA_PYTHON_CLIENT_MEM_FRACTION).
TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target(
            "tpu-v4-8", "tpu", "v4:2x2x1", int(30.75 * GIB), 275.0, 1.2e12, "TPU v4", "megacore"
        ),
        Target("tpu-v5e-8", "tpu", "v5e:2x4", int(15.75 * GIB), 197.0, 0.819e12, "TPU v5 lite"),
        Target(
            "tpu-v5p-8", "tpu", "v5:2x2x1", int(95.74 * GIB), 459.0, 2.765e12, "TPU v5", "megacore"
        ),
        Target("tpu-v6e-8", "tpu", "v6e:2x4", int(31.25 * GIB), 918.0, 1.64e12, "TPU v6 lite"),
        Target(
            "h100", "cuda", "h100", int(0.75 * 84942979072), 989.0, 3.35e12, "NVIDIA H100 80GB HBM3"
        ),
        Target(
            "h200",
            "cuda",
            "h200",
            int(0.75 * 151397597184),
            989.0,
            4.8e12,
            "NVIDIA H200 141GB HBM3e",
        ),
    )
}


class TargetError(UserError, ValueError):
    """An unknown target, or a compiler for it that is not installed."""


def parse(name: str) -> Target:
    """A target by name (`TARGETS`) or a raw TPU topology `v4|v5|v5e|v6e:AxB[xC]`."""
    if name in TARGETS:
        return TARGETS[name]
    match = re.fullmatch(r"(v4|v5p?|v5e|v6e):(\d+(?:x\d+){1,2})", name)
    if not match:
        raise TargetError(
            f"--target={name!r}: choose one of {sorted(TARGETS)} or a TPU "
            "topology such as v5e:4x4 or v4:2x2x2"
        )
    generation = {"v5p": "v5"}.get(match.group(1), match.group(1))
    base = next(t for t in TARGETS.values() if t.topology.startswith(generation + ":"))
    return dataclasses.replace(base, name=name, topology=f"{generation}:{match.group(2)}")


def for_device_kind(device_kind: str) -> Target | None:
    """The table's target whose chips report `device_kind`, or None."""
    return next((t for t in TARGETS.values() if t.device_kind == device_kind), None)


def _host_bounds(target: Target) -> tuple[int, int, int]:
    """Chips per host: 2x2x1 (v4, v5p) or 2x4x1 (v5e, v6e), within the slice's own shape."""
    dims = [int(d) for d in target.topology.split(":")[1].split("x")] + [1]
    host = (2, 2, 1) if target.chip_config == "megacore" else (2, 4, 1)
    return tuple(min(h, d) for h, d in zip(host, dims))  # type: ignore[return-value]


def gpu_target_config(name: str) -> str:
    """The GpuTargetConfigProto text shipped for `name` (tools/gpu_targets/NAME.txtpb)."""
    return (importlib.resources.files("bertjax.tools") / "gpu_targets" / f"{name}.txtpb").read_text(
        encoding="utf-8"
    )


def devices(target: Target) -> list[jax.Device]:
    """The target's compile-only devices; TargetError naming the extra when the compiler
    plugin is missing."""
    from jax.experimental import topologies

    # Compile-only: no chip to guard, so other compiles (another process) may run meanwhile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        if target.platform == "tpu":
            topology = topologies.get_topology_desc(
                platform="tpu",
                topology_name=target.topology,
                chip_config_name=target.chip_config,
                chips_per_host_bounds=_host_bounds(target),
                num_slices=1,
                wrap=(False,) * 3,
            )
        else:
            topology = topologies.get_topology_desc(
                platform="cuda",
                topology_name=target.topology,
                target_config=gpu_target_config(target.topology),
                topology="1x1x1",
            )
    except (RuntimeError, NotImplementedError, ValueError) as e:
        raise TargetError(
            f"the compiler for {target.name} did not start ({e}); it comes with "
            "pip install -e '.[aot]' and runs with JAX_PLATFORMS=cpu"
        ) from e
    return list(topology.devices)


def _cudnn_version(config_text: str) -> int:
    """cuDNN's version number (9.10.0 -> 91000) from a GpuTargetConfigProto text."""
    info = re.search(r"dnn_version_info\s*\{([^}]*)\}", config_text)
    parts = dict(re.findall(r"(major|minor|patch):\s*(\d+)", info.group(1) if info else ""))
    return (
        int(parts.get("major", 0)) * 10000
        + int(parts.get("minor", 0)) * 100
        + int(parts.get("patch", 0))
    )


@contextlib.contextmanager
def cudnn_for(target: Target, device: jax.Device) -> Iterator[None]:
    """JAX's cuDNN attention asks the local GPU and cuDNN library for their versions when it
    traces; for a compile-only GPU (no GPU, no cuDNN here) it gets the target's instead."""
    if target.platform != "cuda":
        yield
        return
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    own = tuple(float(x) for x in str(device.compute_capability).split("."))

    def capability(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split("."))

    replacements = {
        "check_cudnn_version": lambda: _cudnn_version(gpu_target_config(target.topology)),
        "check_compute_capability": lambda text: own >= capability(text),
        "is_cuda_compute_capability_equal": lambda text: own == capability(text),
    }
    saved = {name: getattr(cudnn_attention, name) for name in replacements}
    for name, function in replacements.items():
        setattr(cudnn_attention, name, function)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(cudnn_attention, name, function)
