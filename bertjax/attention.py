"""Attention implementations of the BERT layer, and which one runs where.

Shape legend: B batch, L sequence length, N heads, D head size. Inputs are `[B, L, N, D]`; the
padding mask `[B, L]` is a prefix of ones per row, as in every BERT input.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

# "einsum": explicit softmax(QK^T)V with attention dropout from the JAX RNG (the reference);
# "cudnn": cuDNN's fused flash attention on GPU (padding as key lengths, attention dropout by
# cuDNN's own generator); "xla": jax.nn.dot_product_attention's portable path (no attention
# dropout); "auto": "cudnn" where it runs (GPU, 16-bit compute, head size <= 128), else "einsum".
ATTENTION_IMPLS = ("auto", "einsum", "xla", "cudnn")
CUDNN_DTYPES = ("bfloat16", "float16")
ATTENTION_MASK_VALUE = -10000.0  # the original additive mask, not -inf


def resolve_impl(impl: str, dtype: str, head_size: int, backend: str | None = None) -> str:
    """The implementation `impl` means on `backend` (default: JAX's default backend)."""
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    cudnn_fits = dtype in CUDNN_DTYPES and head_size <= 128 and head_size % 8 == 0
    return "cudnn" if backend in ("gpu", "cuda") and cudnn_fits else "einsum"


def mask_bias(attention_mask: jax.Array) -> jax.Array:
    """The original additive mask `(1 - mask) * -10000`, broadcastable over heads (and over
    queries for a padding mask `[B, L]`; a `[B, L, L]` mask gives each query its keys)."""
    bias = (1.0 - attention_mask.astype(jnp.float32)) * ATTENTION_MASK_VALUE
    return bias[:, None, None, :] if bias.ndim == 2 else bias[:, None]


def causal_mask(attention_mask_BxL: jax.Array) -> jax.Array:
    """`[B, L, L]`: query q may attend to key k <= q that is a real token (left-to-right LM)."""
    length = attention_mask_BxL.shape[-1]
    lower_LxL = jnp.tril(jnp.ones((length, length), attention_mask_BxL.dtype))
    return attention_mask_BxL[:, None, :] * lower_LxL[None]


def sequence_lengths(attention_mask_BxL: jax.Array) -> jax.Array:
    """Real tokens per row of a prefix padding mask: the fused kernels' form of the mask."""
    if attention_mask_BxL.ndim != 2:
        raise ValueError("attention_impl 'cudnn' and 'xla' take padding masks only; a causal "
                         "(train.objective=ltr) model needs model.attention_impl='einsum'")
    return jnp.sum(attention_mask_BxL.astype(jnp.int32), axis=-1)


def einsum_attention(q_BxLxNxD: jax.Array, k_BxLxNxD: jax.Array, v_BxLxNxD: jax.Array,
                     mask_bias_Bx1x1xL: jax.Array,
                     dropout: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The reference: float32 scores and softmax, the original additive mask, `dropout` on the
    probabilities, then the weighted sum in the compute dtype."""
    scores_BxNxLxL = jnp.einsum("bqnd,bknd->bnqk", q_BxLxNxD, k_BxLxNxD,
                                preferred_element_type=jnp.float32)
    scores_BxNxLxL = scores_BxNxLxL / jnp.sqrt(jnp.float32(q_BxLxNxD.shape[-1]))
    probs_BxNxLxL = dropout(jax.nn.softmax(scores_BxNxLxL + mask_bias_Bx1x1xL, axis=-1))
    return jnp.einsum("bnqk,bknd->bqnd", probs_BxNxLxL.astype(v_BxLxNxD.dtype), v_BxLxNxD)


def fused_attention(impl: str, q_BxLxNxD: jax.Array, k_BxLxNxD: jax.Array,
                    v_BxLxNxD: jax.Array, lengths_B: jax.Array, dropout_rate: float,
                    seed: int) -> jax.Array:
    """`impl` "cudnn" or "xla": keys past each row's length are masked, every query computed
    (as the einsum path does, so padded positions match it too)."""
    if impl == "cudnn":
        return cudnn_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, lengths_B, dropout_rate, seed)
    if dropout_rate > 0:
        raise ValueError(
            f"attention_impl={impl!r} has no attention dropout; train with "
            "attention_probs_dropout_prob=0 or attention_impl='einsum' or 'cudnn'")
    return jax.nn.dot_product_attention(q_BxLxNxD, k_BxLxNxD, v_BxLxNxD,
                                        key_value_seq_lengths=lengths_B, implementation=impl)


def cudnn_attention(q_BxLxNxD: jax.Array, k_BxLxNxD: jax.Array, v_BxLxNxD: jax.Array,
                    lengths_B: jax.Array, dropout_rate: float, seed: int) -> jax.Array:
    """cuDNN flash attention; `dropout_rate` drops attention probabilities with cuDNN's Philox
    generator, seeded by the static `seed` and advanced by XLA at every execution (so it is
    not replayed from the checkpointed JAX RNG on resume)."""
    # The public jax.nn.dot_product_attention has no dropout argument; this is its cuDNN kernel.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    batch, length = q_BxLxNxD.shape[:2]
    return dot_product_attention(
        q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, q_seqlen=jnp.full((batch,), length, jnp.int32),
        kv_seqlen=lengths_B, scale=1.0 / math.sqrt(q_BxLxNxD.shape[-1]),
        mask_type=MaskType.PADDING, dropout_rate=dropout_rate, seed=seed, qkv_layout="BTNH")
