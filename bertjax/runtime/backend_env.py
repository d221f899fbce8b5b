"""What JAX reads once, when its first backend starts. `bertjax/__init__` sets it at import,
so every entry point, and every process one starts, begins the same way."""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import MutableMapping

# Device files of the accelerators JAX's plugins drive: TPU VMs (v2-v4: /dev/accel*, v5e and
# later: VFIO groups), NVIDIA GPUs (WSL2: /dev/dxg), AMD GPUs.
ACCELERATOR_FILES = (
    "/dev/accel*",
    "/dev/vfio/[0-9]*",
    "/dev/nvidia[0-9]*",
    "/dev/nvidiactl",
    "/dev/dxg",
    "/dev/kfd",
)
NVIDIA_FILES = ("/dev/nvidia[0-9]*", "/dev/dxg")

# XLA records a GPU program into CUDA graphs ("command buffers"). Recording cuDNN's fused
# attention *with dropout* aborts the process (`cuda_dnn.cc:6951 Check failed:
# local_device_ordinal.has_value()` in `CuDnnThunk::Record`; jax 0.11.2 on an H100 and an
# H200, benchmarks/gpu/README.md). Left out of the graphs, it runs; the rest stays in them.
CUDNN_OUTSIDE_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer=-CUDNN"


def present(patterns: tuple[str, ...]) -> bool:
    """Whether any of these device files exists on this host."""
    return any(glob.glob(pattern) for pattern in patterns)


def cpu_unless_accelerated() -> None:
    """Sets JAX's platforms to `cpu` on a host without an accelerator's device file, unless
    JAX_PLATFORMS says otherwise, before any backend starts: installed plugins (libtpu and
    the CUDA plugin of the `aot` extra) would otherwise print tens of lines of start-up
    failures there, tracebacks included, before falling back to the CPU anyway."""
    if "JAX_PLATFORMS" not in os.environ and not present(ACCELERATOR_FILES):
        if "jax" in sys.modules:
            sys.modules["jax"].config.update("jax_platforms", "cpu")
        else:  # read when JAX is imported, if ever (by this process or the ones it starts)
            os.environ["JAX_PLATFORMS"] = "cpu"


def cudnn_outside_command_buffers(
    environ: MutableMapping[str, str] = os.environ, gpu: bool | None = None
) -> None:
    """On an NVIDIA host (`gpu`: detected from its device files), adds
    `CUDNN_OUTSIDE_COMMAND_BUFFERS` to XLA_FLAGS, so that `attention_impl="cudnn"` trains with
    the recipe's attention dropout. An XLA_FLAGS that already sets
    xla_gpu_enable_command_buffer is the user's choice and stays as it is. It takes effect
    only if no JAX backend has started yet in this process (importing bertjax first does)."""
    flags = environ.get("XLA_FLAGS", "")
    if (
        present(NVIDIA_FILES) if gpu is None else gpu
    ) and "xla_gpu_enable_command_buffer" not in flags:
        environ["XLA_FLAGS"] = f"{flags} {CUDNN_OUTSIDE_COMMAND_BUFFERS}".strip()


def prepare() -> None:
    """Both settings above, as `import bertjax` applies them."""
    cpu_unless_accelerated()
    cudnn_outside_command_buffers()
