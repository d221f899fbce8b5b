"""`train.grad_accum_steps = 0` ("auto"): per phase, the fewest micro-batches whose step fits
the memory of the devices it is compiled for (the real chips, or a `tools.aot` target).

The step's memory is estimated as the train state's bytes (parameters, gradients, optimizer
state) plus the activations of the per-device micro-batch: JAX's count of saved residuals
(`memory.activation_estimate`, for the attention the target runs) times a factor per platform
that the compilers' own figures set (`tools.aot`, benchmarks/aot/): XLA fuses and frees much
of what autodiff saves. `python -m bertjax.tools.aot --target=...` verifies the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh

from bertjax.models import attention, compile_target
from bertjax.models.families import ModelConfig
from bertjax.runtime import targets
from bertjax.training import memory, sharding
from bertjax.training.phase_schedule import Phase
from bertjax.training.state import TrainState

# Compiled activation bytes / JAX's saved residuals (BERT-large, L=512, with a margin). TPU:
# the Pallas attention kernel and the GELU that keeps only its input (models.layers.gelu),
# JAX counts 0.66 GiB per sequence (21.1 GiB for 32); beside the state the compiler needed
# 14.5 GiB on a v5e for 32 sequences per chip in one micro-batch (0.45 each; 15.2 of 15.75
# GiB, which the factor 0.5 of jax.nn.gelu's residuals let through) and 23.8 GiB on a v4
# for 64 (0.37 each): 0.69 at most (benchmarks/aot/large_tpu-*_at_4e78998). GPU: cuDNN
# attention, JAX counts 0.93 GiB per sequence, the H100 compiler 24.2 GiB for 32 sequences
# (0.60 each): 0.65.
ACTIVATION_FACTOR = {"tpu": 0.7, "gpu": 0.75}
MEMORY_MARGIN = 0.9  # of the usable memory, for what the estimate misses


def device_memory(device: jax.Device) -> int | None:
    """Bytes the step may use on `device`: the runtime's limit on a real accelerator, the
    target table's for a compile-only one; None on a CPU (no accumulation needed)."""
    if device.platform == "cpu":
        return None
    try:
        return int(device.memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001 (compile-only devices have no memory statistics)
        target = targets.for_device_kind(device.device_kind)
        return target.hbm_bytes if target else None


def _micro_batch_fits(
    config: ModelConfig,
    phase: Phase,
    micro: int,
    tensor: int,
    state_bytes: int,
    budget: float,
    platform: str,
) -> bool:
    impl = attention.resolve_impl(
        config.attention_impl,
        config.dtype,
        config.head_size,
        platform,
        config.attention_probs_dropout_prob,
        phase.max_seq_length,
    )
    resolved = dataclasses.replace(config, attention_impl=impl)
    per_device = memory.activation_estimate(resolved, phase, micro, tensor).total
    return state_bytes + ACTIVATION_FACTOR.get(platform, 1.0) * per_device <= budget


def accumulation(
    setting: int,
    config: ModelConfig,
    abstract_state: TrainState,
    mesh: Mesh,
    phases: Sequence[Phase],
) -> dict[str, int]:
    """Micro-batches per phase: `setting` for every phase, or when it is 0 the smallest power
    of two dividing the per-device batch whose estimate fits the mesh's devices."""
    if setting:
        return {p.name: setting for p in phases}
    device = mesh.devices.flat[0]
    usable = device_memory(device)
    state_bytes = memory.per_device_bytes(abstract_state) + memory.per_device_bytes(
        abstract_state.params
    )  # and the gradients
    dp, tensor = sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR]
    chosen = {}
    # (traced for the device: a TPU's Pallas kernel as the TPU's, not in interpret mode,
    # whose host callbacks remat refuses)
    with compile_target.target_device(device):
        for phase in phases:
            per_device = phase.global_batch_size // dp
            options = [
                k for k in (2**i for i in range(per_device.bit_length())) if per_device % k == 0
            ] or [1]
            chosen[phase.name] = options[-1] if usable else 1
            budget = MEMORY_MARGIN * usable if usable else 0.0
            for k in options if usable else []:
                if _micro_batch_fits(
                    config, phase, per_device // k, tensor, state_bytes, budget, device.platform
                ):
                    chosen[phase.name] = k
                    break
    return chosen
