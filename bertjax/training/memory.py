"""Before compiling: where every parameter lives on the mesh and what a step costs per device.

`check_shardable` refuses a mesh that cannot split the model (an axis size that does not divide
the heads, the FFN, the vocabulary, ...) with a message naming the field to change.
`report` is the start-up table: each parameter's logical axes -> mesh axes and bytes per
device, then bytes per device of parameters, gradients, optimizer state and the activations
kept for the backward pass. Activations are JAX's own account of the residuals autodiff saves
(so remat policies count exactly), before XLA fuses or reorders anything; XLA's figure for the
compiled step (`python -m bertjax.tools.aot`) adds temporaries and may drop fused residuals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import resource
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.ad_checkpoint import print_saved_residuals
from jax.sharding import Mesh

from bertjax.data import batch as batch_spec
from bertjax.errors import UserError
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.training import sharding, steps
from bertjax.training.phase_schedule import Phase
from bertjax.training.state import TrainState


class MeshMismatch(UserError, ValueError):
    """The mesh cannot split the model as the logical-axis rules ask."""


class WontFit(UserError, ValueError):
    """The training state cannot be allocated in this host's memory (CPU devices)."""


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def _mesh_axes_of(spec_entry: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    if spec_entry is None:
        return ()
    return tuple(spec_entry) if isinstance(spec_entry, (tuple, list)) else (spec_entry,)


def per_device_bytes(tree: optax.Params) -> int:
    """Bytes one device holds of a tree of sharded abstract (or real) arrays."""
    return sum(
        int(np.prod(leaf.sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
        for leaf in jax.tree.leaves(tree)
    )


def _proc_kib(path: str, field: str) -> int | None:
    """A `Field:   N kB` line of a /proc file, in KiB (None off Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def allocatable_host_bytes() -> tuple[int, str] | None:
    """What this process can still allocate, and which limit says so: its address-space
    limit (`ulimit -v`) less what it maps now, or the host's available memory and free
    swap, whichever is less; None where neither is known."""
    found = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    mapped = _proc_kib("/proc/self/status", "VmSize")
    if soft != resource.RLIM_INFINITY and mapped is not None:
        found.append((soft - mapped * 1024, "its address-space limit, ulimit -v"))
    available, swap = (_proc_kib("/proc/meminfo", f) for f in ("MemAvailable", "SwapFree"))
    if available is not None:
        found.append(((available + (swap or 0)) * 1024, "the host's available memory"))
    return min(found) if found else None


def check_host_memory(abstract_state: TrainState, mesh: Mesh) -> None:
    """Raises `WontFit` when the state (parameters and optimizer moments) of this process's
    CPU devices, which share the host's memory, cannot be allocated there: XLA's CPU client
    then waits for ever instead of failing."""
    cpus = [
        d
        for d in mesh.devices.flat
        if d.platform == "cpu" and d.process_index == jax.process_index()
    ]
    allocatable = allocatable_host_bytes()
    if not cpus or allocatable is None:
        return
    needed = per_device_bytes(abstract_state) * len(cpus)
    if needed > allocatable[0]:
        raise WontFit(
            f"the training state (parameters and optimizer moments) needs {format_bytes(needed)}"
            f" on this host's {len(cpus)} CPU device{'s' if len(cpus) > 1 else ''}, but this "
            f"process can allocate only {format_bytes(max(0, allocatable[0]))} more "
            f"({allocatable[1]}); use a smaller model (configs/tiny.py), raise the limit, or "
            "run on an accelerator"
        )


def check_shardable(config: ModelConfig, abstract_params: optax.Params, mesh: Mesh) -> None:
    """Raises `MeshMismatch` when a mesh axis does not divide a dimension it shards, or when
    the tensor axis does not divide the attention heads (each device needs whole heads)."""
    tensor = mesh.shape[sharding.TENSOR]
    if config.num_attention_heads % tensor:
        raise MeshMismatch(
            f"mesh.tensor={tensor} does not divide model.num_attention_heads="
            f"{config.num_attention_heads}: each device must hold whole heads; choose a tensor "
            "size that divides the heads (and put the other devices on data or fsdp)"
        )
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        for dim, entry in zip(leaf.shape, leaf.sharding.spec):
            axes = _mesh_axes_of(entry)
            ways = int(np.prod([mesh.shape[a] for a in axes]))
            if dim % ways:
                raise MeshMismatch(
                    f"parameter {_path_name(path)} {tuple(leaf.shape)}: dimension {dim} is split "
                    f"over mesh axes {'x'.join(axes)} ({ways} ways) and is not divisible; change "
                    f"the mesh, or pad the model (e.g. --config.model.vocab_size="
                    f"{-(-dim // ways) * ways} for the vocabulary)"
                )


_DTYPE_BYTES = {
    "bool": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


def abstract_batch(
    phase: Phase, batch_size: int, placement: jax.sharding.Sharding | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of `phase` with `batch_size` rows as abstract arrays (optionally sharded)."""
    return batch_spec.abstract(phase, batch_size, placement)


@functools.lru_cache(maxsize=32)
def saved_residuals(config: ModelConfig, phase: Phase, batch_size: int) -> list[tuple[tuple, int]]:
    """`(shape, bytes)` of every array that autodiff keeps from the forward pass for the
    backward pass of one training loss over `batch_size` sequences (JAX's own account, from
    `jax.ad_checkpoint.print_saved_residuals`; parameters and batch themselves excluded)."""
    model = families.pretraining_model(config)
    params = families.abstract_params(model)

    def loss(params: optax.Params, batch: steps.Batch, rng: jax.Array) -> jax.Array:
        outputs = steps.forward(model, params, batch, False, rng)
        return families.of(model).pretraining_loss(outputs, batch)[0]

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(
            loss, params, abstract_batch(phase, batch_size), jax.ShapeDtypeStruct((2,), jnp.uint32)
        )
    result = []
    for line in text.getvalue().splitlines():
        match = re.match(r"(\w+)\[([\d,]*)\] (.*)", line)
        if match and "from the argument" not in match.group(3):
            shape = tuple(int(d) for d in match.group(2).split(",") if d)
            result.append((shape, int(np.prod(shape)) * _DTYPE_BYTES.get(match.group(1), 4)))
    return result


def _split_over_tensor(shape: tuple, config: ModelConfig, batch: int) -> bool:
    """Whether an activation of this shape is split over the tensor axis: it has the FFN or
    vocabulary dimension, or it is per head ([B, N, ...] or [B, L, N, D])."""
    heads = config.num_attention_heads
    return (
        config.intermediate_size in shape
        or config.vocab_size in shape
        or (len(shape) == 4 and shape[0] == batch and heads in (shape[1], shape[2]))
    )


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
    """Bytes per device of activations kept for the backward pass."""

    saved: int  # all residuals autodiff keeps across the whole model
    recompute: int  # one layer's residuals rematerialised at a time (remat policies only)
    total: int


def activation_estimate(
    config: ModelConfig, phase: Phase, batch: int, tensor: int
) -> ActivationEstimate:
    """Activations per device for `batch` sequences of `phase` under the config's remat policy;
    per-head, FFN and vocabulary tensors are divided by the tensor-parallel size."""

    def per_device(residuals: list[tuple[tuple, int]]) -> int:
        return sum(
            size // tensor if _split_over_tensor(shape, config, batch) else size
            for shape, size in residuals
        )

    saved = per_device(saved_residuals(config, phase, batch))
    recompute = 0
    if config.remat_policy != "none":
        one_layer = dataclasses.replace(config, num_hidden_layers=1)
        no_remat = dataclasses.replace(one_layer, remat_policy="none")
        recompute = max(
            0,
            per_device(saved_residuals(no_remat, phase, batch))
            - per_device(saved_residuals(one_layer, phase, batch)),
        )
    return ActivationEstimate(saved, recompute, saved + recompute)


def _logical_specs(model: nn.Module) -> Any:
    return nn.get_partition_spec(families.abstract_params(model, boxed=True))


def format_bytes(num_bytes: float) -> str:
    """`512 B`, `1.50 KiB`, ... up to GiB."""
    if num_bytes < 1024:
        return f"{num_bytes:.0f} B"
    for unit in ("KiB", "MiB"):
        num_bytes /= 1024
        if num_bytes < 1024:
            return f"{num_bytes:.2f} {unit}"
    return f"{num_bytes / 1024:.2f} GiB"


def _spec_text(spec: jax.sharding.PartitionSpec) -> str:
    return "(" + ", ".join("-" if e is None else "x".join(_mesh_axes_of(e)) for e in spec) + ")"


def parameter_rows(
    model: nn.Module, abstract_params: optax.Params
) -> list[tuple[str, str, str, str, int]]:
    """`(name, shape, logical axes, mesh axes, bytes per device)` per parameter; the layers of
    the unrolled encoder are folded into one `layer_*` row (with the count in the shape)."""
    logical = _logical_specs(model)
    rows: dict[str, list] = {}
    for (path, leaf), spec in zip(
        jax.tree_util.tree_leaves_with_path(abstract_params),
        jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
    ):
        name = re.sub(r"layer_\d+", "layer_*", _path_name(path))
        if name in rows:
            rows[name][-1] += 1
            continue
        rows[name] = [
            name,
            "x".join(map(str, leaf.shape)),
            _spec_text(spec),
            _spec_text(leaf.sharding.spec),
            per_device_bytes(leaf),
            1,
        ]
    return [
        (name, shape + (f" (x{count})" if count > 1 else ""), axes, mesh_axes, size * count)
        for name, shape, axes, mesh_axes, size, count in rows.values()
    ]


def summary(
    model: nn.Module, abstract_state: TrainState, mesh: Mesh, phases: Sequence[Phase]
) -> str:
    """The report's totals in one line: parameters, mesh, and bytes per device per phase."""
    config: ModelConfig = model.config
    params = per_device_bytes(abstract_state.params)
    opt = per_device_bytes(abstract_state.opt_state)
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract_state.params))
    data_parallel, tensor = sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR]
    totals = []
    for phase in phases:
        est = activation_estimate(config, phase, phase.global_batch_size // data_parallel, tensor)
        totals.append(f"{format_bytes(2 * params + opt + est.total)} ({phase.name})")
    axes = " ".join(f"{name}={size}" for name, size in mesh.shape.items())
    return (
        f"Model: {count:,} parameters; mesh {axes} ({mesh.size} device"
        f"{'s' if mesh.size > 1 else ''}); per device before XLA temporaries: " + ", ".join(totals)
    )


def report(
    model: nn.Module, abstract_state: TrainState, mesh: Mesh, phases: Sequence[Phase]
) -> str:
    """The start-up report; each phase's global batch is split over data x fsdp."""
    config: ModelConfig = model.config
    rows = parameter_rows(model, abstract_state.params)
    width = max(len(r[0]) for r in rows)
    lines = [
        f"Mesh {dict(mesh.shape)} ({mesh.size} devices); parameters "
        "(logical axes -> mesh axes, bytes per device):"
    ]
    lines += [
        f"  {name:<{width}}  {shape:<16} {axes:<22} -> {mesh_axes:<16} {format_bytes(size):>11}"
        for name, shape, axes, mesh_axes, size in rows
    ]
    params = per_device_bytes(abstract_state.params)
    opt = per_device_bytes(abstract_state.opt_state)
    count = sum(leaf.size for leaf in jax.tree.leaves(abstract_state.params))
    lines += [
        "Bytes per device:",
        f"  parameters       {format_bytes(params):>11}  ({count:,} x {config.param_dtype})",
        f"  gradients        {format_bytes(params):>11}",
        f"  optimizer state  {format_bytes(opt):>11}",
    ]
    data_parallel, tensor = sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR]
    for phase in phases:
        batch = phase.global_batch_size // data_parallel
        est = activation_estimate(config, phase, batch, tensor)
        lines.append(
            f"  activations      {format_bytes(est.total):>11}  (phase {phase.name}: {batch} of "
            f"{phase.global_batch_size} sequences x {phase.max_seq_length} tokens per device, "
            f"{config.dtype}, remat {config.remat_policy}; saved for backward "
            f"{format_bytes(est.saved)} + recomputed {format_bytes(est.recompute)})"
        )
        lines.append(
            f"  total            {format_bytes(2 * params + opt + est.total):>11}  "
            f"(phase {phase.name}, before XLA temporaries)"
        )
    return "\n".join(lines)
