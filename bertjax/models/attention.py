"""Attention implementations of the BERT layer, and which one runs where.

Shape legend: B batch, L sequence length, N heads, D head size, K instances per packed row.
Inputs are `[B, L, N, D]`; `Mask` says which keys each query sees: the padding mask of
ordinary rows, or the instance ids of packed rows (`data.packing`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from bertjax.models import flash_dropout

# "einsum": explicit softmax(QK^T)V with attention dropout from the JAX RNG (the reference);
# "cudnn": cuDNN's fused flash attention on GPU (padding as key lengths, packed rows as
# segment offsets on Hopper or later; attention dropout by cuDNN's own generator); "xla":
# jax.nn.dot_product_attention's portable path (no attention dropout); "pallas": the Pallas
# TPU flash attention (segment ids; TPU interpret mode elsewhere, for tests), with attention
# dropout bertjax's own kernel (`flash_dropout`, lengths up to PALLAS_DROPOUT_MAX_LENGTH).
# "auto": "cudnn" on a GPU where no attention dropout is applied (16-bit compute, head size
# <= 128), "pallas" on TPU (with dropout: up to that length; by libtpu's estimate of
# BERT-large on v5p-8 it is faster and needs less memory than einsum at 128 and 512 tokens,
# benchmarks/aot/flash_dropout.md), else "einsum". With attention dropout, "cudnn" is
# opt-in: it runs once XLA keeps it out of CUDA graphs (`backend_env`; inside them it aborted
# on an H100 and an H200), it was 3% faster than einsum in the one step measured (H200, 4
# layers, L=128), and its dropout is not replayed on resume (benchmarks/gpu/README.md).
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn", "pallas")
CUDNN_DTYPES = ("bfloat16", "float16")
ATTENTION_MASK_VALUE = -10000.0  # the original additive mask, not -inf
PALLAS_BLOCK = 128  # the TPU kernel's key block: lengths must be a multiple of it
PALLAS_DROPOUT_MAX_LENGTH = flash_dropout.MAX_LENGTH

# The device that traced code will run on (`sharding.activate` sets it from the mesh), so that
# "auto" resolves for the target, not for the host, when compiling for another platform.
_TARGET_DEVICE: contextvars.ContextVar[jax.Device | None] = contextvars.ContextVar(
    "bertjax_target_device", default=None
)


@contextlib.contextmanager
def target_device(device: jax.Device):
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


@flax.struct.dataclass
class Mask:
    """Which keys each query attends to; `ids_BxL` is 0 at padding.

    Ordinary rows (`max_instances` 0) hold 1 at real tokens, a prefix of each row as in every
    BERT input; every query sees every real key (the original). Packed rows hold the number
    (1..K, in row order) of the instance each token belongs to (`max_instances` K): a token
    sees only the tokens of its own instance (block-diagonal attention). A `[B, L, L]` mask
    (causal_mask: train.objective=ltr) gives each query its own keys (einsum only).
    `half_window` > 0 restricts each query further to the keys at most that many rows away
    (ModernBERT's sliding-window attention: `window_impl` says which kernels take it).
    """

    ids_BxL: jax.Array
    max_instances: int = flax.struct.field(pytree_node=False, default=0)
    half_window: int = flax.struct.field(pytree_node=False, default=0)

    @property
    def packed(self) -> bool:
        return self.max_instances > 0


def resolve_impl(
    impl: str,
    dtype: str,
    head_size: int,
    backend: str | None = None,
    dropout_rate: float = 0.0,
    length: int = PALLAS_BLOCK,
    packed: bool = False,
) -> str:
    """The implementation `impl` means on `backend` (default: `target_platform()`) for a
    layer applying attention dropout `dropout_rate` to rows of `length` (`packed` or not)."""
    if impl != "auto":
        return impl
    backend = backend or target_platform()
    cudnn_fits = dtype in CUDNN_DTYPES and head_size <= 128 and head_size % 8 == 0
    if (
        backend in ("gpu", "cuda")
        and cudnn_fits
        and dropout_rate == 0
        and (not packed or _gpu_is_hopper_or_later())
    ):
        return "cudnn"
    if (
        backend == "tpu"
        and length % PALLAS_BLOCK == 0
        and (dropout_rate == 0 or length <= PALLAS_DROPOUT_MAX_LENGTH)
    ):
        return "pallas"
    return "einsum"


def _gpu_is_hopper_or_later() -> bool:
    """cuDNN runs packed rows (segment offsets) from compute capability 9.0 on."""
    try:
        device = _TARGET_DEVICE.get() or jax.devices("gpu")[0]
        return float(device.compute_capability) >= 9.0
    except (RuntimeError, AttributeError, ValueError):
        return False


def attend(
    impl: str,
    dtype: str,
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    mask: Mask,
    dropout: Callable[[jax.Array], jax.Array],
    dropout_rate: float,
    seed: int,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """Attention by `impl` (resolved for this backend, compute `dtype` and mask): the einsum
    reference with `dropout` on its probabilities, or a fused kernel applying `dropout_rate`
    itself (cuDNN: seeded by `seed`). `spec`: the mesh axes of the batch and the heads (the
    Pallas kernel runs per shard)."""
    if impl == "auto" and mask.ids_BxL.ndim == 3:
        impl = "einsum"  # a per-query mask (causal): the reference
    impl = window_impl(
        resolve_impl(
            impl, dtype, q_BxLxNxD.shape[-1], None, dropout_rate, q_BxLxNxD.shape[1], mask.packed
        ),
        mask.half_window,
        dropout_rate,
    )
    if impl == "einsum":
        return einsum_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask_bias(mask), dropout)
    return fused_attention(impl, q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask, dropout_rate, seed, spec)


def window_impl(impl: str, half_window: int, dropout_rate: float = 0.0) -> str:
    """What runs a sliding-window layer whose model asks for `impl` (resolved): the Pallas
    splash kernel for "pallas", JAX's XLA path for "xla", else (and with attention dropout,
    which neither applies) the einsum reference (cuDNN, through JAX, has causal windows only;
    a bidirectional encoder needs both sides)."""
    fused = impl in ("pallas", "xla") and not dropout_rate
    return impl if not half_window or fused else "einsum"


def mask_bias(mask: Mask) -> jax.Array:
    """The original additive mask `(1 - mask) * -10000` broadcast over heads (and over queries,
    `[B, 1, 1, L]`, for a padding mask; a `[B, L, L]` mask such as causal_mask's gives each
    query its keys); for packed rows `[B, 1, L, L]`, -10000 between different instances; with
    a `half_window`, `[B, 1, L, L]`, -10000 also between rows further apart than it."""
    if mask.half_window:
        ids = mask.ids_BxL
        keys_BxQxL = (
            ids[:, :, None] == ids[:, None, :]
            if mask.packed
            else ids > 0
            if ids.ndim == 3
            else (ids > 0)[:, None, :]
        )
        rows_L = jnp.arange(ids.shape[-1])
        band_LxL = jnp.abs(rows_L[:, None] - rows_L[None, :]) <= mask.half_window
        return jnp.where(keys_BxQxL & band_LxL, 0.0, ATTENTION_MASK_VALUE)[:, None].astype(
            jnp.float32
        )
    if mask.packed:
        same_BxLxL = mask.ids_BxL[:, :, None] == mask.ids_BxL[:, None, :]
        return jnp.where(same_BxLxL, 0.0, ATTENTION_MASK_VALUE)[:, None].astype(jnp.float32)
    bias = (1.0 - mask.ids_BxL.astype(jnp.float32)) * ATTENTION_MASK_VALUE
    return bias[:, None, None, :] if bias.ndim == 2 else bias[:, None]


def causal_mask(attention_mask_BxL: jax.Array) -> jax.Array:
    """`[B, L, L]`: query q may attend to key k <= q that is a real token (left-to-right LM)."""
    length = attention_mask_BxL.shape[-1]
    lower_LxL = jnp.tril(jnp.ones((length, length), attention_mask_BxL.dtype))
    return attention_mask_BxL[:, None, :] * lower_LxL[None]


def sequence_lengths(attention_mask_BxL: jax.Array) -> jax.Array:
    """Real tokens per row of a prefix padding mask: the fused kernels' form of the mask."""
    return jnp.sum(attention_mask_BxL.astype(jnp.int32), axis=-1)


def einsum_attention(
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    mask_bias_Bx1xQxL: jax.Array,
    dropout: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """The reference: float32 scores and softmax, the original additive mask, `dropout` on the
    probabilities, then the weighted sum in the compute dtype."""
    scores_BxNxLxL = jnp.einsum(
        "bqnd,bknd->bnqk", q_BxLxNxD, k_BxLxNxD, preferred_element_type=jnp.float32
    )
    scores_BxNxLxL = scores_BxNxLxL / jnp.sqrt(jnp.float32(q_BxLxNxD.shape[-1]))
    probs_BxNxLxL = dropout(jax.nn.softmax(scores_BxNxLxL + mask_bias_Bx1xQxL, axis=-1))
    return jnp.einsum("bnqk,bknd->bqnd", probs_BxNxLxL.astype(v_BxLxNxD.dtype), v_BxLxNxD)


def fused_attention(
    impl: str,
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    mask: Mask,
    dropout_rate: float,
    seed: int,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """`impl` "cudnn", "xla" or "pallas". Every query of a real token gets the einsum path's
    result; queries at padding are computed too but may differ (nothing reads them)."""
    if mask.ids_BxL.ndim != 2:
        raise ValueError(
            f"attention_impl={impl!r} takes padding or packed masks only; a causal "
            "(train.objective=ltr) model needs model.attention_impl='einsum'"
        )
    if window_impl(impl, mask.half_window) != impl:
        raise ValueError(
            f"attention_impl={impl!r} has no two-sided sliding window; a "
            "ModernBERT model's windows need 'pallas', 'xla' or 'einsum'"
        )
    if impl == "cudnn":
        return cudnn_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask, dropout_rate, seed)
    if dropout_rate > 0 and impl == "xla":
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout; train with "
            "attention_probs_dropout_prob=0 or attention_impl='einsum', 'pallas' or 'cudnn'"
        )
    if impl == "pallas":
        seeds_BxN = (
            flash_dropout.AttentionSeeds()(q_BxLxNxD.shape[0], q_BxLxNxD.shape[2])
            if dropout_rate > 0
            else None
        )
        return pallas_attention(
            q_BxLxNxD,
            k_BxLxNxD,
            v_BxLxNxD,
            mask.ids_BxL,
            spec,
            mask.half_window,
            dropout_rate,
            seeds_BxN,
        )
    window = (mask.half_window,) * 2 if mask.half_window else None
    if mask.packed:
        same_Bx1xLxL = (mask.ids_BxL[:, :, None] == mask.ids_BxL[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q_BxLxNxD,
            k_BxLxNxD,
            v_BxLxNxD,
            mask=same_Bx1xLxL,
            local_window_size=window,
            implementation="xla",
        )
    return jax.nn.dot_product_attention(
        q_BxLxNxD,
        k_BxLxNxD,
        v_BxLxNxD,
        key_value_seq_lengths=sequence_lengths(mask.ids_BxL),
        local_window_size=window,
        implementation="xla",
    )


def packed_segments(ids_BxL: jax.Array, max_instances: int) -> tuple[jax.Array, jax.Array]:
    """cuDNN's form of packed rows: each instance's length `[B, K]` and start `[B, K+1]`, -1
    where a row holds fewer instances (instances are numbered 1..K in row order)."""
    numbers_K = jnp.arange(1, max_instances + 1, dtype=ids_BxL.dtype)
    lengths_BxK = jnp.sum(ids_BxL[:, None, :] == numbers_K[None, :, None], axis=-1, dtype=jnp.int32)
    starts_BxK = jnp.cumsum(lengths_BxK, axis=-1) - lengths_BxK
    present_BxK = lengths_BxK > 0
    starts_BxK1 = jnp.pad(
        jnp.where(present_BxK, starts_BxK, -1), ((0, 0), (0, 1)), constant_values=-1
    )
    return jnp.where(present_BxK, lengths_BxK, -1), starts_BxK1


def cudnn_attention(
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    mask: Mask,
    dropout_rate: float,
    seed: int,
) -> jax.Array:
    """cuDNN flash attention; `dropout_rate` drops attention probabilities with cuDNN's Philox
    generator, seeded by the static `seed` and advanced by XLA at every execution (so it is
    not replayed from the checkpointed JAX RNG on resume). Packed rows run as cuDNN segments
    (Hopper or later, as JAX's own packed-layout test); cuDNN leaves the padding outside the
    segments unwritten, so it is set to 0 there, in the outputs and in the gradients."""
    # The public jax.nn.dot_product_attention has no dropout argument; this is its cuDNN kernel.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    batch, length = q_BxLxNxD.shape[:2]
    attend = functools.partial(
        dot_product_attention,
        scale=1.0 / math.sqrt(q_BxLxNxD.shape[-1]),
        dropout_rate=dropout_rate,
        seed=seed,
        qkv_layout="BTNH",
    )
    if not mask.packed:
        return attend(
            q_BxLxNxD,
            k_BxLxNxD,
            v_BxLxNxD,
            mask_type=MaskType.PADDING,
            q_seqlen=jnp.full((batch,), length, jnp.int32),
            kv_seqlen=sequence_lengths(mask.ids_BxL),
        )
    real_BxLx1x1 = (mask.ids_BxL > 0)[:, :, None, None]
    q_BxLxNxD, k_BxLxNxD, v_BxLxNxD = (
        jnp.where(real_BxLx1x1, x, 0) for x in (q_BxLxNxD, k_BxLxNxD, v_BxLxNxD)
    )
    lengths_BxK, starts_BxK1 = packed_segments(mask.ids_BxL, mask.max_instances)
    out_BxLxNxD = attend(
        q_BxLxNxD,
        k_BxLxNxD,
        v_BxLxNxD,
        q_seqlen=lengths_BxK,
        kv_seqlen=lengths_BxK,
        q_offsets=starts_BxK1,
        kv_offsets=starts_BxK1,
        mask_type=MaskType.NO_MASK,
    )
    return jnp.where(real_BxLx1x1, out_BxLxNxD, 0)


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
    its mask drawn from `seeds_BxN`. Under a mesh it runs per shard (`jax.shard_map`; XLA
    cannot partition a Pallas kernel), batch and heads split over the mesh axes `spec` =
    (batch axes, head axes). Off TPU it runs in TPU interpret mode, forward and backward
    (slow: for tests)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash

    length, head_size = q_BxLxNxD.shape[1], q_BxLxNxD.shape[-1]
    if length % PALLAS_BLOCK or (dropout_rate and length > PALLAS_DROPOUT_MAX_LENGTH):
        raise ValueError(
            f"attention_impl='pallas' needs a sequence length that is a multiple "
            f"of {PALLAS_BLOCK}"
            + (
                f", at most {PALLAS_DROPOUT_MAX_LENGTH} with attention dropout"
                if dropout_rate
                else ""
            )
            + f", got {length}; use attention_impl='einsum'"
        )
    block = {
        name: PALLAS_BLOCK
        for name in (
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
        )
    }
    interpret = target_platform() != "tpu"

    def whole_rows(q_BxNxLxD, k_BxNxLxD, v_BxNxLxD, ids_BxL):
        return tpu_flash.flash_attention(
            q_BxNxLxD,
            k_BxNxLxD,
            v_BxNxLxD,
            segment_ids=tpu_flash.SegmentIds(ids_BxL, ids_BxL),
            sm_scale=1.0 / math.sqrt(head_size),
            block_sizes=tpu_flash.BlockSizes(block_b=1, **block),
        )

    def with_dropout(qkv_3xBxLxH, ids_BxL, seeds_BxN):
        return flash_dropout.flash_dropout(qkv_3xBxLxH, ids_BxL, seeds_BxN, dropout_rate, interpret)

    # JAX's kernels take q, k, v heads first, [B, N, L, D]; bertjax's the projections' output
    # as it is, [3, B, L, N * D] (XLA folds the stack of its slices back into it).
    shape = q_BxLxNxD.shape
    qkv: tuple[jax.Array, ...]
    if dropout_rate:
        flash, qkv = (
            with_dropout,
            (jnp.stack([x.reshape(shape[:2] + (-1,)) for x in (q_BxLxNxD, k_BxLxNxD, v_BxLxNxD)]),),
        )
        in_spec, out_spec = (
            (PartitionSpec(None, spec[0], None, spec[1]), PartitionSpec(spec[0], None, spec[1]))
            if spec
            else (None, None)
        )
    else:
        flash = _heads_first(
            functools.partial(_splash_window, half_window=half_window)
            if half_window
            else _in_tpu_interpret_mode(whole_rows)
            if interpret
            else whole_rows
        )
        qkv = (q_BxLxNxD, k_BxLxNxD, v_BxLxNxD)
        in_spec = out_spec = PartitionSpec(spec[0], None, spec[1], None) if spec else None
    args = (ids_BxL.astype(jnp.int32),) + ((seeds_BxN,) if dropout_rate else ())
    mesh = jax.sharding.get_abstract_mesh()
    if spec is not None and not mesh.empty and any(spec):
        flash = jax.shard_map(
            flash,
            mesh=mesh,
            in_specs=(in_spec,) * len(qkv)
            + (PartitionSpec(spec[0], None), PartitionSpec(spec[0], spec[1]))[: len(args)],
            out_specs=out_spec,
            check_vma=False,
        )
    return flash(*qkv, *args).reshape(shape)


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
    sizes = {
        name: PALLAS_BLOCK
        for name in (
            "block_q",
            "block_kv",
            "block_kv_compute",
            "block_q_dkv",
            "block_kv_dkv",
            "block_kv_dkv_compute",
            "block_q_dq",
            "block_kv_dq",
        )
    }
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([local] * heads),
        head_shards=1,
        q_seq_shards=1,
        block_sizes=splash.BlockSizes(**sizes),  # type: ignore[arg-type]
        interpret=target_platform() != "tpu",
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
    def interpreted(*args):
        with pltpu.force_tpu_interpret_mode():
            return fn(*args)

    def forward(*args):
        with pltpu.force_tpu_interpret_mode():
            return jax.vjp(fn, *args)

    def backward(vjp_fn, cotangent):
        with pltpu.force_tpu_interpret_mode():
            return vjp_fn(cotangent)

    interpreted.defvjp(forward, backward)
    return interpreted
