"""What every benchmark record holds besides its numbers: the machine, the library versions,
and the JSON file it is written to (`tools.bench`, `tools.bench_data`)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from typing import Any

import jax

from bertjax.runtime import console


def machine() -> dict[str, Any]:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "platform": jax.default_backend(),
        "hostname": platform.node(),
    }


def versions() -> dict[str, str]:
    packages = ("jax", "jaxlib", "flax", "optax", "numpy")
    return {
        "python": platform.python_version(),
        **{name: importlib.metadata.version(name) for name in packages},
    }


def write_record(result: dict[str, Any], path: str) -> None:
    """Writes a benchmark record as JSON (creating its folder)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    console.say(f"wrote {path}")
