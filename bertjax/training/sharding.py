"""Meshes, the one table of logical-axis rules, and host batches -> global arrays.

The model names axes logically (`bertjax.models.bert.blocks`); `LOGICAL_AXIS_RULES` is the only place
that says which mesh axis each logical axis is split over. Mesh axes:
  data   - pure data parallelism (parameters replicated),
  fsdp   - data parallelism with parameters and optimizer state sharded (ZeRO-3 style),
  tensor - Megatron-style tensor parallelism over heads and the FFN.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bertjax.errors import ConfigError
from bertjax.models import axes, compile_target
from bertjax.runtime.schema import setting

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """`config.mesh`, typed (built once at an entry point): each axis's size, one of them
    -1 for all the devices the others leave."""

    data: int = setting(
        -1, "data-parallel replicas; -1 = all the devices the others leave", "devices"
    )
    fsdp: int = setting(1, "parameter- and optimizer-sharded data parallelism", "devices")
    tensor: int = setting(1, "tensor parallelism over the heads and the FFN", "devices")

    @classmethod
    def of(cls, mesh: Mapping[str, int]) -> MeshSettings:
        """ConfigError naming an axis `mesh` sets that the mesh does not have."""
        unknown = sorted(set(mesh) - set(MESH_AXES))
        if unknown:
            raise ConfigError(
                f"mesh.{unknown[0]} is not an axis of the mesh (its axes: {', '.join(MESH_AXES)})"
            )
        return cls(**{axis: int(size) for axis, size in mesh.items()})


LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    (axes.BATCH, (DATA, FSDP)),
    (axes.VOCAB, TENSOR),
    (axes.EMBED, FSDP),
    (axes.EMBED_OUT, None),
    (axes.QKV, TENSOR),
    (axes.MLP, TENSOR),
    (axes.ACT_QKV, TENSOR),
    (axes.ACT_MLP, TENSOR),
    (axes.ACT_EMBED, None),
    (axes.LENGTH, None),
    (axes.POSITION, None),
    (axes.TOKEN_TYPE, None),
    (axes.NORM, None),
    (axes.NSP_CLASSES, None),
    (axes.LABELS, None),
    (axes.LAYERS, None),
)


def mesh_shape(axis_sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Resolves a `{data, fsdp, tensor}` size dict where one size may be -1 (fill the rest)."""
    sizes = [int(axis_sizes.get(name, 1)) for name in MESH_AXES]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh {dict(axis_sizes)}: at most one axis may be -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(
                f"mesh {dict(axis_sizes)}: {num_devices} devices are not divisible "
                f"by the fixed axes' product {known}"
            )
        sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {math.prod(sizes)} devices "
            f"but {num_devices} are available; set one axis to -1 to fill"
        )
    return tuple(sizes)


def make_mesh(axis_sizes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the (data, fsdp, tensor) mesh with Auto axes (jit + NamedSharding semantics)."""
    devices = list(devices if devices is not None else jax.devices())
    shape = mesh_shape(axis_sizes, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices
    )


def logical_to_sharding(logical_specs: Mapping[str, Any], mesh: Mesh) -> Any:
    """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a batch: leading axis split over the data-parallel axes."""
    return NamedSharding(mesh, PartitionSpec((DATA, FSDP)))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def data_parallel_size(mesh: Mesh) -> int:
    return mesh.shape[DATA] * mesh.shape[FSDP]


def global_batch_from_host(
    host_batch: Mapping[str, np.ndarray], mesh: Mesh
) -> dict[str, jax.Array]:
    """Assembles this process's rows of the global batch into global, sharded jax.Arrays."""
    sharding = batch_sharding(mesh)
    return {
        name: jax.make_array_from_process_local_data(sharding, value)
        for name, value in host_batch.items()
    }


@contextlib.contextmanager
def activate(mesh: Mesh) -> Iterator[None]:
    """Makes `mesh` and the logical rules current, for tracing steps with activation
    constraints; "auto" choices resolve for the mesh's devices (`compile_target.target_device`)."""
    with (
        jax.set_mesh(mesh),
        nn.logical_axis_rules(LOGICAL_AXIS_RULES),
        compile_target.target_device(mesh.devices.flat[0]),
    ):
        yield
