"""ModernBERT's sliding-window attention in blocks: O(L x window) memory where no fused kernel
takes a two-sided window (GPU, CPU), instead of the band-masked einsum's L x L scores.

The rows are cut into M blocks of C >= `half_window` queries; block m's keys within the
window lie in key blocks m - 1, m and m + 1, so each query scores W = 3C keys under the
band mask `|query - key| <= half_window`, the rows' key padding or packed instances, and the
einsum reference's additive -10000 (whose masked keys get probability exactly 0 in float32).
Attention dropout drops the same probabilities as the reference: each kept bit is the bit
`dropout.packed_keep_mask` draws for that (row, head, query, key) of the whole `[B, N, L, L]`
mask, from the same key.

Shape legend: B batch, L sequence length, N heads, D head size, M blocks, C queries per
block, W = 3C keys per block, W8 = W / 8 bytes of packed dropout mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bertjax.models import attention
from bertjax.models.dropout import apply_packed_mask, packed_keep_mask


def block_size(half_window: int) -> int:
    """C: the half window rounded up to whole bytes of the packed dropout mask (8 keys)."""
    return -(-half_window // 8) * 8


def runs_blocked(
    impl: str, dtype: str, q_BxLxNxD: jax.Array, mask: attention.Mask, dropout_rate: float
) -> bool:
    """Whether `attention.attend` would run the band-masked einsum for this windowed padding
    or packed mask over at least twice the blocks' scores (L x L >= 2 x M x C x W: the
    blocks compute theirs twice, in the forward and the backward pass): then the blocks run."""
    length = q_BxLxNxD.shape[1]
    if not mask.half_window or mask.ids_BxL.ndim != 2:
        return False
    resolved = attention.resolve_impl(
        impl, dtype, q_BxLxNxD.shape[-1], None, dropout_rate, length, mask.packed
    )
    block = block_size(mask.half_window)
    blocks = -(-length // block)
    return (
        attention.window_impl(resolved, mask.half_window, dropout_rate) == "einsum"
        and 2 * blocks * block * 3 * block <= length * length
    )


def _key_blocks(x_BxLxF: jax.Array, blocks: int, block: int, fill: int) -> jax.Array:
    """`[B, M, W, ...]`: for each block m, rows (m - 1) C to (m + 2) C of `x`, `fill` outside
    it."""
    batch, length = x_BxLxF.shape[:2]
    pad = [(0, 0), (block, (blocks + 1) * block - length)] + [(0, 0)] * (x_BxLxF.ndim - 2)
    padded = jnp.pad(x_BxLxF, pad, constant_values=fill).reshape(
        (batch, blocks + 2, block, *x_BxLxF.shape[2:])
    )
    return jnp.concatenate([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], axis=2)


def _mask_bias(mask: attention.Mask, blocks: int, block: int) -> jax.Array:
    """`[B, 1, M, C, W]` float32: 0 where query m C + c sees key (m - 1) C + w, else -10000
    (outside the band, outside the row, at padding or in another instance)."""
    ids_BxL = mask.ids_BxL
    keys_BxMxW = _key_blocks(ids_BxL, blocks, block, -1)  # -1: outside the row
    if mask.packed:
        length = ids_BxL.shape[1]
        queries_BxMxC = jnp.pad(
            ids_BxL, ((0, 0), (0, blocks * block - length)), constant_values=-1
        ).reshape(-1, blocks, block)
        seen_BxMxCxW = queries_BxMxC[..., None] == keys_BxMxW[:, :, None]
    else:
        seen_BxMxCxW = (keys_BxMxW > 0)[:, :, None]
    offsets_CxW = block + jnp.arange(block)[:, None] - jnp.arange(3 * block)[None]
    band_CxW = jnp.abs(offsets_CxW) <= mask.half_window
    return jnp.where(seen_BxMxCxW & band_CxW, 0.0, attention.ATTENTION_MASK_VALUE)[:, None]


def _keep_bytes(
    key: jax.Array, shape_BxNxMxCxW: tuple[int, ...], length: int, rate: float
) -> jax.Array:
    """uint8 `[B, N, M, C, W8]`: the bytes of `packed_keep_mask(key, [B, N, L, L], rate)` that
    hold these probabilities' bits (any byte where the key is outside the row: its
    probability is 0)."""
    batch, heads, blocks, block, _ = shape_BxNxMxCxW
    row_bytes = -(-length // 8)
    b, n, m, c, w8 = (
        jnp.arange(size, dtype=jnp.uint32).reshape([size if i == axis else 1 for i in range(5)])
        for axis, size in enumerate((batch, heads, blocks, block, 3 * block // 8))
    )
    query = m * block + c
    key_byte = (m - 1) * (block // 8) + w8  # wraps below 0: only outside the row
    byte_index = ((b * heads + n) * length + query) * row_bytes + key_byte
    return packed_keep_mask(key, (batch, heads, length, length), rate, byte_index)


@functools.partial(jax.checkpoint, static_argnums=(4,))
def blocked_attention(
    q_BxLxNxD: jax.Array,
    k_BxLxNxD: jax.Array,
    v_BxLxNxD: jax.Array,
    mask: attention.Mask,
    dropout_rate: float = 0.0,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """`attention.einsum_attention` under `mask_bias(mask)` (a window, padding or packed ids)
    in blocks; attention dropout at `dropout_rate` with the reference's mask for
    `dropout_key`. Real queries get the reference's result; a query that sees no key at all
    (padding far from any real token) averages its block's keys, not the whole row's. Only the
    inputs are saved for the backward pass, which computes the scores again (as a flash
    kernel does): O(L x D) saved per layer, not O(L x W)."""
    batch, length, heads, head_size = q_BxLxNxD.shape
    block = block_size(mask.half_window)
    blocks = -(-length // block)
    q_BxMxCxNxD = jnp.pad(
        q_BxLxNxD, ((0, 0), (0, blocks * block - length), (0, 0), (0, 0))
    ).reshape(batch, blocks, block, heads, head_size)
    k_BxMxWxNxD, v_BxMxWxNxD = (_key_blocks(x, blocks, block, 0) for x in (k_BxLxNxD, v_BxLxNxD))
    scores = jnp.einsum(
        "bmcnd,bmwnd->bnmcw", q_BxMxCxNxD, k_BxMxWxNxD, preferred_element_type=jnp.float32
    )
    scores = scores / jnp.sqrt(jnp.float32(head_size))
    probs_BxNxMxCxW = jax.nn.softmax(scores + _mask_bias(mask, blocks, block), axis=-1)
    if dropout_rate > 0 and dropout_key is not None:
        keep = _keep_bytes(dropout_key, probs_BxNxMxCxW.shape, length, dropout_rate)
        probs_BxNxMxCxW = apply_packed_mask(probs_BxNxMxCxW, keep, dropout_rate)
    out_BxMxCxNxD = jnp.einsum(
        "bnmcw,bmwnd->bmcnd", probs_BxNxMxCxW.astype(v_BxLxNxD.dtype), v_BxMxWxNxD
    )
    return out_BxMxCxNxD.reshape(batch, blocks * block, heads, head_size)[:, :length]
