"""What bertjax's Pallas GPU (Triton) kernels share: the FLOPs their XLA call carries for the
census, and running one compiled where the program is lowered for CUDA (interpreted elsewhere:
tests), per shard of the batch under a mesh."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from bertjax.models.axes import BATCH, mesh_axes


def pallas_call(
    body: Callable,
    *,
    name: str,
    grid: tuple[int, ...],
    in_specs: Sequence[pl.BlockSpec],
    out_specs: Sequence[pl.BlockSpec],
    out_shape: Sequence[jax.ShapeDtypeStruct],
    estimate: pl.CostEstimate,
    params: dict[str, int],
    interpret: bool,
) -> Callable:
    """`pl.pallas_call` of the Triton kernel `body` named `name` on `grid`, with Triton's
    `params` (warps, stages), and `estimate` as its cost and its HLO `serialized_metadata`
    (XLA counts no FLOPs in a Triton call: `tools.gpu_census` reads them there)."""
    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=list(in_specs),
        out_specs=list(out_specs),
        out_shape=list(out_shape),
        compiler_params=plgpu.CompilerParams(**params),
        interpret=interpret,
        name=name,
        cost_estimate=estimate,
        metadata={"flops": str(estimate.flops), "transcendentals": str(estimate.transcendentals)},
    )


def compiled_or_interpreted(kernel: Callable[[bool], Callable], *args: jax.Array) -> jax.Array:
    """`kernel(interpret)(*args)`: compiled where the program is lowered for CUDA, else in
    Pallas' interpret mode."""
    return lax.platform_dependent(*args, cuda=kernel(False), default=kernel(True))


def per_batch_shard(
    run: Callable[..., jax.Array], rows: tuple[jax.Array, ...], whole: tuple[jax.Array, ...]
) -> jax.Array:
    """`run(*rows, *whole)` per shard of the batch (`rows`' leading axis, and the result's)
    where a mesh is active (`jax.shard_map`: XLA cannot partition a Pallas kernel); `whole`
    replicated, their gradients summed over the shards."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = mesh_axes(BATCH)
    if mesh.empty or batch is None:
        return run(*rows, *whole)
    split = PartitionSpec(batch)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(split,) * len(rows) + (PartitionSpec(),) * len(whole),
        out_specs=split,
        check_vma=False,
    )(*rows, *whole)
