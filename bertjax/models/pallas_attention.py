"""The Pallas attention kernels as bertjax runs them, per shard under a mesh. On TPU: JAX's
flash attention with segment ids for padding and packed rows, the splash kernel for sliding
windows, bertjax's own kernel (`flash_dropout`) with attention dropout; in TPU interpret mode
off TPU (for tests). On a GPU: bertjax's Triton kernel (`flash_dropout_gpu`), with or without
attention dropout, in Pallas' interpret mode where the program is lowered for another platform
(tests on the CPU).

Shape legend: B batch, L sequence length, N heads, D head size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from bertjax.models import compile_target, flash_dropout, flash_dropout_gpu, gpu_kernels

BLOCK = 128  # the TPU kernel's key block: lengths must be a multiple of it


def pallas_attention(
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    ids_BxL: jax.Array,
    spec: PartitionSpec | None = None,
    half_window: int = 0,
    dropout_rate: float = 0.0,
    seeds_BxN: jax.Array | None = None,
) -> jax.Array:
    """JAX's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.flash_attention`)
    with `ids_BxL` as segment ids: a query sees the keys of its own id (at padding: padding);
    with a `half_window`, the splash kernel (`splash_attention`) with a local mask, keys at
    most that many rows away; with a `dropout_rate`, bertjax's kernel (`flash_dropout`) with
    its mask drawn from `seeds_BxN`. On a GPU (the compile target's platform): bertjax's
    Triton kernel (`flash_dropout_gpu`), with that mask if `dropout_rate`, no windows. Under
    a mesh it runs per shard (`jax.shard_map`; XLA cannot partition a Pallas kernel), batch
    and heads split over the mesh axes `spec` = (batch axes, head axes). Elsewhere it runs
    in TPU interpret mode, forward and backward (slow: for tests)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    length, head_size = q_BxLxNxD.shape[1], q_BxLxNxD.shape[-1]
    _check_shape(length, head_size, half_window, dropout_rate)
    block = dict.fromkeys(
        (
            "block_q",
            "block_k_major",
            "block_k",
            "block_q_major_dkv",
            "block_k_major_dkv",
            "block_k_dkv",
            "block_q_dkv",
            "block_k_major_dq",
            "block_k_dq",
            "block_q_dq",
        ),
        BLOCK,
    )
    interpret = compile_target.target_platform() != "tpu"

    def whole_rows(
        q_BxNxLxD: jax.Array, k_BxNxLxD: jax.Array, v_BxNxLxD: jax.Array, ids_BxL: jax.Array
    ) -> jax.Array:
        return tpu_flash.flash_attention(
            q_BxNxLxD,
            k_BxNxLxD,
            v_BxNxLxD,
            segment_ids=tpu_flash.SegmentIds(ids_BxL, ids_BxL),
            sm_scale=1.0 / math.sqrt(head_size),
            block_sizes=tpu_flash.BlockSizes(block_b=1, **block),
        )

    shape = q_BxLxNxD.shape
    if compile_target.target_platform() in ("gpu", "cuda"):  # the GPU kernel's stacking
        qkv_BxLx3xNxD = jnp.stack([q_BxLxNxD, k_BxLxNxD, v_BxLxNxD], axis=2)
        return triton_attention(qkv_BxLx3xNxD, None, ids_BxL, seeds_BxN, dropout_rate, spec)

    if dropout_rate:  # bertjax's kernel takes q, k, v stacked first, `[3, B, L, N * D]`
        qkv_3xBxLxH = jnp.stack(
            [x.reshape((*shape[:2], -1)) for x in (q_BxLxNxD, k_BxLxNxD, v_BxLxNxD)]
        )
        assert seeds_BxN is not None, "attention dropout draws the kernel's seeds"
        return tpu_flash_dropout(qkv_3xBxLxH, ids_BxL, seeds_BxN, dropout_rate, spec).reshape(shape)
    # JAX's kernels take q, k, v heads first, [B, N, L, D].
    flash = _heads_first(
        functools.partial(_splash_window, half_window=half_window)
        if half_window
        else _in_tpu_interpret_mode(whole_rows)
        if interpret
        else whole_rows
    )
    in_spec = PartitionSpec(spec[0], None, spec[1], None) if spec else None
    return _per_shard(flash, spec, (in_spec,) * 3, in_spec, 1)(
        q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, ids_BxL.astype(jnp.int32)
    ).reshape(shape)


def tpu_flash_dropout(
    qkv_3xBxLxH: jax.Array,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array,
    dropout_rate: float,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """bertjax's TPU kernel (`flash_dropout`) on q, k and v stacked first, as one projection
    writes them (`bias_matmul.project`): `[B, L, N * D]`, N the seeds' heads. Off TPU in
    interpret mode; per shard under a mesh as `pallas_attention`."""
    _, _, length, width = qkv_3xBxLxH.shape
    _check_shape(length, width // seeds_BxN.shape[1], 0, dropout_rate)
    interpret = compile_target.target_platform() != "tpu"
    in_spec, out_spec = (
        (PartitionSpec(None, spec[0], None, spec[1]), PartitionSpec(spec[0], None, spec[1]))
        if spec
        else (None, None)
    )
    return _per_shard(
        lambda *args: flash_dropout.flash_dropout(*args, dropout_rate, interpret),
        spec,
        (in_spec,),
        out_spec,
        2,
    )(qkv_3xBxLxH, ids_BxL.astype(jnp.int32), seeds_BxN)


def _check_shape(length: int, head_size: int, half_window: int, dropout_rate: float) -> None:
    """A clear error where the platform's Pallas kernel cannot take these rows."""
    if compile_target.target_platform() in ("gpu", "cuda"):
        if half_window or not flash_dropout_gpu.fits(length, head_size):
            raise ValueError(
                "attention_impl='pallas' on a GPU needs a sequence length that is a multiple of "
                f"{flash_dropout_gpu.BLOCK_MAJOR}, a head size in {flash_dropout_gpu.HEAD_SIZES} "
                f"and no sliding window, got length {length}, head size {head_size}; use "
                "attention_impl='einsum'"
            )
    elif length % BLOCK or (dropout_rate and length > flash_dropout.MAX_LENGTH):
        raise ValueError(
            f"attention_impl='pallas' needs a sequence length that is a multiple "
            f"of {BLOCK}"
            + (
                f", at most {flash_dropout.MAX_LENGTH} with attention dropout"
                if dropout_rate
                else ""
            )
            + f", got {length}; use attention_impl='einsum'"
        )


def triton_attention(
    qkv_BxLx3xNxD: jax.Array,
    bias_3xNxD: jax.Array | None,
    ids_BxL: jax.Array,
    seeds_BxN: jax.Array | None,
    dropout_rate: float,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """bertjax's Triton kernel (`flash_dropout_gpu`) on q, k, v stacked on axis 2 (one GEMM's
    output: `bias_matmul.project_stacked`) plus their biases (None: none), `[B, L, N, D]`:
    compiled where the program is lowered for CUDA, else interpreted; per shard under a mesh
    as `pallas_attention`."""
    batch, length, _, heads, head_size = qkv_BxLx3xNxD.shape
    if seeds_BxN is None:  # no dropout: the kernel reads no seed
        seeds_BxN = jnp.zeros((batch, heads), jnp.int32)
    if bias_3xNxD is None:
        bias_3xNxD = jnp.zeros((3, heads, head_size), jnp.float32)

    def flash(
        qkv_BxLx3xH: jax.Array, bias_3xH: jax.Array, ids_BxL: jax.Array, seeds_BxN: jax.Array
    ) -> jax.Array:
        def kernel(interpret: bool) -> Callable:
            return lambda *args: flash_dropout_gpu.flash_dropout_biased(
                *args, dropout_rate, interpret
            )

        return gpu_kernels.compiled_or_interpreted(
            kernel, qkv_BxLx3xH, bias_3xH, ids_BxL, seeds_BxN
        )

    in_specs, out_spec = (
        (
            (PartitionSpec(spec[0], None, None, spec[1]), PartitionSpec(None, spec[1])),
            PartitionSpec(spec[0], None, spec[1]),
        )
        if spec
        else ((None, None), None)
    )
    qkv_BxLx3xH = qkv_BxLx3xNxD.reshape(batch, length, 3, heads * head_size)
    return _per_shard(flash, spec, in_specs, out_spec, 2)(
        qkv_BxLx3xH,
        bias_3xNxD.reshape(3, heads * head_size),
        ids_BxL.astype(jnp.int32),
        seeds_BxN,
    ).reshape(batch, length, heads, head_size)


def _per_shard(
    flash: Callable,
    spec: PartitionSpec | None,
    in_specs: tuple[PartitionSpec | None, ...],
    out_spec: PartitionSpec | None,
    args: int,
) -> Callable:
    """`flash` per shard (`jax.shard_map`: XLA cannot partition a Pallas kernel) where a mesh
    is active and `spec` names its axes; its inputs `in_specs`, then `args` of the ids and
    seeds."""
    mesh = jax.sharding.get_abstract_mesh()
    if spec is None or mesh.empty or not any(spec):
        return flash
    return jax.shard_map(
        flash,
        mesh=mesh,
        in_specs=in_specs + (PartitionSpec(spec[0], None), PartitionSpec(spec[0], spec[1]))[:args],
        out_specs=out_spec,
        check_vma=False,
    )


def _heads_first(flash: Callable) -> Callable:
    """`flash` (JAX's kernels: `[B, N, L, D]`) on `[B, L, N, D]` arrays."""
    swap = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
    return lambda q, k, v, *args: swap(flash(swap(q), swap(k), swap(v), *args))


def _splash_window(
    q_BxNxLxD: jax.Array,
    k_BxNxLxD: jax.Array,
    v_BxNxLxD: jax.Array,
    ids_BxL: jax.Array,
    half_window: int,
) -> jax.Array:
    """The splash kernel with a two-sided local mask of `half_window` rows and `ids_BxL` as
    segment ids, one row of the batch at a time (the kernel takes `[N, L, D]`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    heads, length, head_size = q_BxNxLxD.shape[1:]
    local = masks.LocalMask((length, length), (half_window, half_window), offset=0)
    sizes = dict.fromkeys(
        (
            "block_q",
            "block_kv",
            "block_kv_compute",
            "block_q_dkv",
            "block_kv_dkv",
            "block_kv_dkv_compute",
            "block_q_dq",
            "block_kv_dq",
        ),
        BLOCK,
    )
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([local] * heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=splash.BlockSizes(**sizes),  # type: ignore[arg-type]
        interpret=compile_target.target_platform() != "tpu",
    )
    scaled_BxNxLxD = q_BxNxLxD * jnp.asarray(1.0 / math.sqrt(head_size), q_BxNxLxD.dtype)
    return jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=splash.SegmentIds(ids, ids)))(
        scaled_BxNxLxD, k_BxNxLxD, v_BxNxLxD, ids_BxL
    )


def _in_tpu_interpret_mode(fn: Callable) -> Callable:
    """`fn` with the Pallas TPU kernels of its forward and its backward pass traced in TPU
    interpret mode (which runs them on the CPU); a custom VJP, so that the backward kernels,
    traced when the gradient is taken, are interpreted too."""
    from jax.experimental.pallas import tpu as pltpu

    @jax.custom_vjp
    def interpreted(*args: jax.Array) -> jax.Array:
        with pltpu.force_tpu_interpret_mode():
            return fn(*args)

    def forward(*args: jax.Array) -> tuple[jax.Array, Callable]:
        with pltpu.force_tpu_interpret_mode():
            return jax.vjp(fn, *args)

    def backward(vjp_fn: Callable, cotangent: jax.Array) -> tuple[jax.Array, ...]:
        with pltpu.force_tpu_interpret_mode():
            return vjp_fn(cotangent)

    interpreted.defvjp(forward, backward)
    return interpreted
