"""The device that traced code will run on (`sharding.activate` sets it from the mesh), so that
what is chosen while tracing ("auto" attention, Pallas' interpret mode, the layers' per-platform
forms) is chosen for the target, not for the host, when compiling for another platform."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_TARGET_DEVICE: contextvars.ContextVar[jax.Device | None] = contextvars.ContextVar(
    "bertjax_target_device", default=None
)


@contextlib.contextmanager
def target_device(device: jax.Device) -> Iterator[None]:
    """Resolves "auto" (and picks Pallas' interpret mode) for `device` while active."""
    token = _TARGET_DEVICE.set(device)
    try:
        yield
    finally:
        _TARGET_DEVICE.reset(token)


def target_platform() -> str:
    """ "gpu", "tpu" or "cpu": the target device's platform, else JAX's default backend."""
    device = _TARGET_DEVICE.get()
    return device.platform if device is not None else jax.default_backend()


def gpu_is_hopper_or_later() -> bool:
    """Whether the target GPU (else the first GPU) has compute capability 9.0 or later: cuDNN
    runs packed rows (segment offsets) from there on."""
    try:
        device = _TARGET_DEVICE.get() or jax.devices("gpu")[0]
        return float(device.compute_capability) >= 9.0
    except (RuntimeError, AttributeError, ValueError):
        return False
