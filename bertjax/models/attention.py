"""Attention implementations of the BERT layer, and which one runs where (the Pallas TPU kernels
in `pallas_attention`).

Shape legend: B batch, L sequence length, N heads, D head size, K instances per packed row.
Inputs are `[B, L, N, D]`; `Mask` says which keys each query sees: the padding mask of
ordinary rows, or the instance ids of packed rows (`data.packing`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from bertjax.models import (
    attention_hash,
    compile_target,
    flash_dropout,
    flash_dropout_gpu,
    pallas_attention,
)

# "einsum": explicit softmax(QK^T)V with attention dropout from the JAX RNG (the reference);
# "cudnn": cuDNN's fused flash attention on GPU (padding as key lengths, packed rows as
# segment offsets on Hopper or later; attention dropout by cuDNN's own generator); "xla":
# jax.nn.dot_product_attention's portable path (no attention dropout); "pallas": the Pallas
# kernels of the target platform. On TPU, JAX's flash attention (segment ids), with attention
# dropout bertjax's own kernel (`flash_dropout`, lengths up to flash_dropout.MAX_LENGTH); on a
# GPU, bertjax's Triton kernel (`flash_dropout_gpu`: FlashAttention-2 with the same attention
# dropout, padded and packed rows, lengths a multiple of 128, no sliding windows); elsewhere
# the TPU kernels in interpret mode (tests). Both dropout kernels and the einsum reference
# given `attention_hash.hash_dropout` draw one mask (`attention_hash`), replayed on resume.
# "auto": on a GPU "cudnn" where no attention dropout is applied and "pallas" where it is
# (16-bit compute, head size and length as the Triton kernel takes them); "pallas" on TPU
# (with dropout: up to that length; by libtpu's estimate of BERT-large on v5p-8 it is faster
# and needs less memory than einsum at 128 and 512 tokens, benchmarks/aot/flash_dropout.md);
# else "einsum". With attention dropout, "cudnn" is opt-in: it runs once XLA keeps it out of
# CUDA graphs (`backend_env`; inside them it aborted on an H100 and an H200), and its dropout
# is not replayed on resume (benchmarks/gpu/README.md).
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn", "pallas")
CUDNN_DTYPES = ("bfloat16", "float16")
ATTENTION_MASK_VALUE = -10000.0  # the original additive mask, not -inf


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
    length: int = pallas_attention.BLOCK,
    packed: bool = False,
) -> str:
    """The implementation `impl` means on `backend` (default: the compile target's platform) for a
    layer applying attention dropout `dropout_rate` to rows of `length` (`packed` or not)."""
    if impl != "auto":
        return impl
    backend = backend or compile_target.target_platform()
    cudnn_fits = dtype in CUDNN_DTYPES and head_size <= 128 and head_size % 8 == 0
    if (
        backend in ("gpu", "cuda")
        and cudnn_fits
        and dropout_rate == 0
        and (not packed or compile_target.gpu_is_hopper_or_later())
    ):
        return "cudnn"
    if (
        backend in ("gpu", "cuda")
        and dtype in CUDNN_DTYPES
        and dropout_rate > 0
        and flash_dropout_gpu.fits(length, head_size)
    ):
        return "pallas"
    if (
        backend == "tpu"
        and length % pallas_attention.BLOCK == 0
        and (dropout_rate == 0 or length <= flash_dropout.MAX_LENGTH)
    ):
        return "pallas"
    return "einsum"


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
    impl = _layer_impl(impl, dtype, q_BxLxNxD.shape[-1], q_BxLxNxD.shape[1], mask, dropout_rate)
    if impl == "einsum":
        return einsum_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask_bias(mask), dropout)
    return fused_attention(impl, q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask, dropout_rate, seed, spec)


def _layer_impl(
    impl: str, dtype: str, head_size: int, length: int, mask: Mask, dropout_rate: float
) -> str:
    """What `attend` runs for `impl` on rows of `length` under `mask`."""
    if impl == "auto" and mask.ids_BxL.ndim == 3:
        impl = "einsum"  # a per-query mask (causal): the reference
    return window_impl(
        resolve_impl(impl, dtype, head_size, None, dropout_rate, length, mask.packed),
        mask.half_window,
        dropout_rate,
    )


def runs_triton(
    impl: str, dtype: str, head_size: int, length: int, mask: Mask, dropout_rate: float
) -> bool:
    """Whether `attend` runs bertjax's Triton kernel here (`impl` "pallas", or "auto" resolved
    to it, on a GPU target, padding or packed rows): the layer then projects q, k and v
    stacked as the kernel reads them (`bias_matmul.project_stacked`) for `attend_stacked`."""
    on_gpu = compile_target.target_platform() in ("gpu", "cuda")
    return (
        on_gpu
        and mask.ids_BxL.ndim == 2
        and _layer_impl(impl, dtype, head_size, length, mask, dropout_rate) == "pallas"
    )


def attend_stacked(
    qkv_BxLx3xNxD: jax.Array,
    bias_3xNxD: jax.Array,
    mask: Mask,
    dropout_rate: float,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """`attend` where `runs_triton`, on q, k and v stacked on axis 2 as one GEMM writes them
    without their biases `bias_3xNxD`: bertjax's Triton kernel reads them there, adds the
    biases (and writes their gradients so), seeds drawn as `attend` draws them."""
    batch, _, _, heads, _ = qkv_BxLx3xNxD.shape
    seeds_BxN = _seeds(batch, heads, dropout_rate)
    return pallas_attention.triton_attention(
        qkv_BxLx3xNxD, bias_3xNxD, mask.ids_BxL, seeds_BxN, dropout_rate, spec
    )


def runs_flash_dropout(
    impl: str, dtype: str, head_size: int, length: int, mask: Mask, dropout_rate: float
) -> bool:
    """Whether `attend` runs bertjax's TPU kernel here (`impl` "pallas", or "auto" resolved to
    it, with attention dropout, padding or packed rows, not on a GPU target): the layer then
    hands it its projection's `[3, B, L, H]` as it is (`attend_projected`)."""
    on_gpu = compile_target.target_platform() in ("gpu", "cuda")
    return (
        not on_gpu
        and dropout_rate > 0
        and mask.ids_BxL.ndim == 2
        and _layer_impl(impl, dtype, head_size, length, mask, dropout_rate) == "pallas"
    )


def attend_projected(
    qkv_3xBxLxH: jax.Array,
    heads: int,
    mask: Mask,
    dropout_rate: float,
    spec: PartitionSpec | None = None,
) -> jax.Array:
    """`attend` where `runs_flash_dropout`, on q, k and v stacked first as one projection
    writes them (`bias_matmul.project`), `heads` of them: `[B, L, H]`. The kernel's gradient
    of that stack is the projection's, with no slices or copies of q, k and v between them
    (BERT-large on tpu-v5p-8: the copy took 1.2 ms at L=128, 4.4 ms at L=512)."""
    seeds_BxN = _seeds(qkv_3xBxLxH.shape[1], heads, dropout_rate)
    assert seeds_BxN is not None, "runs_flash_dropout: attention dropout applies"
    return pallas_attention.tpu_flash_dropout(
        qkv_3xBxLxH, mask.ids_BxL, seeds_BxN, dropout_rate, spec
    )


def _seeds(batch: int, heads: int, dropout_rate: float) -> jax.Array | None:
    """The kernels' dropout seeds `[B, N]` from the layer's dropout stream (None without)."""
    return attention_hash.AttentionSeeds()(batch, heads) if dropout_rate > 0 else None


def window_impl(impl: str, half_window: int, dropout_rate: float = 0.0) -> str:
    """What runs a sliding-window layer whose model asks for `impl` (resolved): the Pallas
    splash kernel for "pallas" on TPU, JAX's XLA path for "xla", else (and with attention
    dropout, which neither applies) the einsum reference (cuDNN, through JAX, has causal
    windows only; a bidirectional encoder needs both sides; the Triton kernel has none)."""
    on_gpu = compile_target.target_platform() in ("gpu", "cuda")
    fused = (impl == "xla" or (impl == "pallas" and not on_gpu)) and not dropout_rate
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
            f"attention_impl={impl!r} has no two-sided sliding window here; a "
            "ModernBERT model's windows need 'pallas' (on TPU), 'xla' or 'einsum'"
        )
    if impl == "cudnn":
        return cudnn_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask, dropout_rate, seed)
    if dropout_rate > 0 and impl == "xla":
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout; train with "
            "attention_probs_dropout_prob=0 or attention_impl='einsum', 'pallas' or 'cudnn'"
        )
    if impl == "pallas":
        seeds_BxN = _seeds(q_BxLxNxD.shape[0], q_BxLxNxD.shape[2], dropout_rate)
        return pallas_attention.pallas_attention(
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
