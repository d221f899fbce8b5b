"""ModernBERT in Flax linen, as Hugging Face transformers defines `ModernBertModel` and
`ModernBertForMaskedLM` (arXiv 2412.13663), with the logical axis names of `bertjax.models.bert.model`
on every parameter (so `bertjax.training.sharding`'s rules place it as they place BERT).

Token embeddings then a LayerNorm (no position embeddings); pre-norm layers, the first with
no attention norm; a fused QKV projection; rotary position embeddings (RoPE) with one theta
for the global layers and another for the sliding-window ones; a GeGLU MLP; bias and
norm-bias switches; a final norm; the MLM head (dense, activation, norm) and a decoder tied
to the token embeddings. Parameter paths follow transformers' module names
(`model/layer_3/attn/Wqkv/kernel`), so interop is a rename plus transposes
(`bertjax.families.modernbert_hf`).

Shape legend: B batch, L sequence length, H hidden size, N heads, D head size, F GeGLU size
(each half), V vocab size, P gathered (masked) positions.
"""

from __future__ import annotations

import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, local_attention
from bertjax.models.axes import (
    ACT_EMBED,
    ACT_MLP,
    ACT_QKV,
    BATCH,
    EMBED,
    EMBED_OUT,
    LENGTH,
    MLP,
    NORM,
    QKV,
    VOCAB,
    constrain,
    zeros,
)
from bertjax.models.dropout import Dropout
from bertjax.models.layers.config import ACTIVATIONS, REMAT_POLICIES
from bertjax.models.layers.gather import gather_positions
from bertjax.models.modernbert.config import ModernBertConfig


def _init(
    config: ModernBertConfig, std: float, axes: tuple[str | None, ...]
) -> nn.initializers.Initializer:
    """transformers' init: a normal of stddev `std` truncated at `initializer_cutoff_factor`
    stddevs, with logical axes."""
    cutoff = config.initializer_cutoff_factor
    return nn.with_logical_partitioning(
        nn.initializers.truncated_normal(std, lower=-cutoff, upper=cutoff), axes
    )


def _out_std(config: ModernBertConfig) -> float:
    """The init stddev of the projections back into the residual stream (and the head)."""
    return config.initializer_range / (2.0 * config.num_hidden_layers) ** 0.5


def _dense(
    config: ModernBertConfig,
    features: int,
    axes: tuple[str, str],
    std: float,
    use_bias: bool,
    name: str,
) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=_init(config, std, axes),
        bias_init=zeros(axes[1:]),
        name=name,
    )


def _layer_norm(config: ModernBertConfig, name: str) -> nn.LayerNorm:
    """LayerNorm with statistics in float32; a bias only with `norm_bias`."""
    return nn.LayerNorm(
        epsilon=config.norm_eps,
        use_bias=config.norm_bias,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (NORM,)),
        bias_init=zeros((NORM,)),
        name=name,
    )


class _SplitDense(nn.Module):
    """A Dense H -> `parts` x `features` with its kernel stored `[H, parts, features]` and
    its output `[..., parts, features]`: transformers' fused `[parts * features, H]` weight
    transposed and split, so each part stays whole on a tensor-parallel shard."""

    config: ModernBertConfig
    parts: int
    features: int
    axis: str  # the logical axis of `features`
    use_bias: bool

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array) -> jax.Array:
        cfg = self.config
        kernel = self.param(
            "kernel",
            _init(cfg, cfg.initializer_range, (EMBED, None, self.axis)),
            (x_BxLxH.shape[-1], self.parts, self.features),
            cfg.param_dtype,
        )
        y = jnp.einsum("blh,hkf->blkf", x_BxLxH.astype(cfg.dtype), kernel.astype(cfg.dtype))
        if self.use_bias:
            y += self.param(
                "bias", zeros((None, self.axis)), (self.parts, self.features), cfg.param_dtype
            ).astype(cfg.dtype)
        return y


def rope_tables(
    positions_BxL: jax.Array, head_size: int, theta: float
) -> tuple[jax.Array, jax.Array]:
    """RoPE's `(cos, sin)`, float32 `[B, L, D]`: angle `position * theta^(-2i/D)` for the
    i-th of the D/2 frequencies, the D/2 angles repeated for the two halves of a head."""
    inverse_frequencies = 1.0 / theta ** (
        jnp.arange(0, head_size, 2, dtype=jnp.float32) / head_size
    )
    angles_BxLxD2 = positions_BxL.astype(jnp.float32)[..., None] * inverse_frequencies
    angles_BxLxD = jnp.concatenate([angles_BxLxD2, angles_BxLxD2], axis=-1)
    return jnp.cos(angles_BxLxD), jnp.sin(angles_BxLxD)


def apply_rope(x_BxLxNxD: jax.Array, cos_BxLxD: jax.Array, sin_BxLxD: jax.Array) -> jax.Array:
    """Rotates each head's unit pairs (i, i + D/2) by the position's angles, in float32
    (transformers' `rotate_half` layout); returns `x`'s dtype."""
    x = x_BxLxNxD.astype(jnp.float32)
    first, second = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    rotated = x * cos_BxLxD[:, :, None] + rotated * sin_BxLxD[:, :, None]
    return rotated.astype(x_BxLxNxD.dtype)


class ModernBertEmbeddings(nn.Module):
    """Token embeddings, LayerNorm, dropout (no position or token-type embeddings)."""

    config: ModernBertConfig

    def setup(self) -> None:
        cfg = self.config
        self.tok_embeddings = self.param(
            "tok_embeddings",
            _init(cfg, cfg.initializer_range, (VOCAB, EMBED)),
            (cfg.vocab_size, cfg.hidden_size),
            cfg.param_dtype,
        )
        self.norm = _layer_norm(cfg, "norm")
        self.drop = Dropout(cfg.embedding_dropout)

    def __call__(self, input_ids_BxL: jax.Array, deterministic: bool) -> jax.Array:
        x_BxLxH = self.norm(jnp.take(self.tok_embeddings, input_ids_BxL, axis=0))
        x_BxLxH = self.drop(x_BxLxH, deterministic=deterministic)
        return constrain(x_BxLxH.astype(self.config.dtype), (BATCH, LENGTH, ACT_EMBED))


class ModernBertAttention(nn.Module):
    """Fused QKV projection, RoPE on queries and keys, attention over `mask` (a sliding window
    of `local_attention` tokens unless `is_global`), output projection."""

    config: ModernBertConfig
    is_global: bool
    deterministic: bool

    @nn.compact
    def __call__(
        self, x_BxLxH: jax.Array, mask: attention.Mask, positions_BxL: jax.Array
    ) -> jax.Array:
        cfg = self.config
        batch, length, _ = x_BxLxH.shape
        qkv_BxLx3xH = _SplitDense(cfg, 3, cfg.hidden_size, QKV, cfg.attention_bias, name="Wqkv")(
            x_BxLxH
        )
        cos_BxLxD, sin_BxLxD = rope_tables(
            positions_BxL,
            cfg.head_size,
            (cfg.global_rope_theta if self.is_global else cfg.local_rope_theta),
        )
        q_BxLxNxD, k_BxLxNxD, v_BxLxNxD = (
            constrain(qkv_BxLx3xH[:, :, i], (BATCH, LENGTH, ACT_QKV)).reshape(
                batch, length, cfg.num_attention_heads, cfg.head_size
            )
            for i in range(3)
        )
        q_BxLxNxD, k_BxLxNxD = (apply_rope(x, cos_BxLxD, sin_BxLxD) for x in (q_BxLxNxD, k_BxLxNxD))
        rate = 0.0 if self.deterministic else cfg.attention_dropout
        if local_attention.runs_blocked(cfg.attention_impl, cfg.dtype, q_BxLxNxD, mask, rate):
            # The key the reference's dropout module (below, also `Dropout_0`) would draw.
            key = Dropout(rate).make_rng("dropout") if rate else None
            context_BxLxNxD = local_attention.blocked_attention(
                q_BxLxNxD, k_BxLxNxD, v_BxLxNxD, mask, rate, key
            )
        else:
            # (flax types Module.scope Optional; it is bound inside apply)
            seed = zlib.crc32("/".join(self.scope.path).encode()) % 2**31  # type: ignore[union-attr]
            context_BxLxNxD = attention.attend(
                cfg.attention_impl,
                cfg.dtype,
                q_BxLxNxD,
                k_BxLxNxD,
                v_BxLxNxD,
                mask,
                lambda p: Dropout(rate)(p, deterministic=self.deterministic),
                rate,
                seed,
                nn.logical_to_mesh_axes((BATCH, ACT_QKV)),
            )
        context_BxLxH = context_BxLxNxD.reshape(batch, length, cfg.hidden_size)
        out_BxLxH = _dense(
            cfg, cfg.hidden_size, (QKV, EMBED), _out_std(cfg), cfg.attention_bias, "Wo"
        )(context_BxLxH)
        return Dropout(rate)(out_BxLxH, deterministic=self.deterministic)


class ModernBertMLP(nn.Module):
    """GeGLU: `Wo(dropout(activation(x Wi_input) * x Wi_gate))`, Wi's two parts the input
    and the gate halves of transformers' Wi."""

    config: ModernBertConfig
    deterministic: bool

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array) -> jax.Array:
        cfg = self.config
        y_BxLx2xF = _SplitDense(cfg, 2, cfg.intermediate_size, MLP, cfg.mlp_bias, name="Wi")(
            x_BxLxH
        )
        h_BxLxF = ACTIVATIONS[cfg.hidden_activation](y_BxLx2xF[:, :, 0]) * y_BxLx2xF[:, :, 1]
        h_BxLxF = constrain(h_BxLxF, (BATCH, LENGTH, ACT_MLP))
        h_BxLxF = Dropout(cfg.mlp_dropout)(h_BxLxF, deterministic=self.deterministic)
        return _dense(cfg, cfg.hidden_size, (MLP, EMBED), _out_std(cfg), cfg.mlp_bias, "Wo")(
            h_BxLxF
        )


class ModernBertLayer(nn.Module):
    """One pre-norm layer: `x + attn(attn_norm(x))`, then `x + mlp(mlp_norm(x))`; layer 0 has
    no attention norm (the embeddings' norm precedes it)."""

    config: ModernBertConfig
    layer: int
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        x_BxLxH: jax.Array,
        global_mask: attention.Mask,
        local_mask: attention.Mask,
        positions_BxL: jax.Array,
    ) -> jax.Array:
        cfg = self.config
        is_global = cfg.is_global(self.layer)
        normed_BxLxH = x_BxLxH if self.layer == 0 else _layer_norm(cfg, "attn_norm")(x_BxLxH)
        x_BxLxH = x_BxLxH + ModernBertAttention(cfg, is_global, self.deterministic, name="attn")(
            normed_BxLxH, global_mask if is_global else local_mask, positions_BxL
        )
        mlp = ModernBertMLP(cfg, self.deterministic, name="mlp")
        x_BxLxH = x_BxLxH + mlp(_layer_norm(cfg, "mlp_norm")(x_BxLxH))
        return constrain(x_BxLxH.astype(cfg.dtype), (BATCH, LENGTH, ACT_EMBED))


class ModernBertModel(nn.Module):
    """Embeddings, the layer stack (`layer_0`, `layer_1`, ...) and the final norm: `[B, L, H]`.

    `attention_mask_BxL` is 1 at real tokens (a prefix of each row or not: any padding is
    masked as a key). `all_layers`: every layer's output `[N, B, L, H]` instead, the last one
    after the final norm (the features of `extract_features`). Packed rows (`data.packing`) give `instance_ids` (1..K, 0 = padding) and
    `position_ids` (each instance's own positions) instead: a token sees its own instance's
    tokens only, the role of transformers' unpadding."""

    config: ModernBertConfig

    @nn.compact
    def __call__(
        self,
        input_ids_BxL: jax.Array,
        attention_mask_BxL: jax.Array,
        deterministic: bool = True,
        *,
        position_ids: jax.Array | None = None,
        instance_ids: jax.Array | None = None,
        all_layers: bool = False,
    ) -> jax.Array:
        cfg = self.config
        batch, length = input_ids_BxL.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(length), (batch, length))
        ids_BxL, instances = (
            (attention_mask_BxL, 0) if instance_ids is None else (instance_ids, length)
        )  # `length`: a bound on the instances per row
        global_mask = attention.Mask(ids_BxL, instances)
        local_mask = attention.Mask(ids_BxL, instances, cfg.local_attention // 2)
        x_BxLxH = ModernBertEmbeddings(cfg, name="embeddings")(input_ids_BxL, deterministic)
        layer_cls = ModernBertLayer
        if cfg.remat_policy != "none":
            layer_cls = nn.remat(layer_cls, policy=REMAT_POLICIES[cfg.remat_policy])
        outputs = []
        for i in range(cfg.num_hidden_layers):
            x_BxLxH = layer_cls(cfg, i, deterministic, name=f"layer_{i}")(
                x_BxLxH, global_mask, local_mask, position_ids
            )
            outputs.append(x_BxLxH)
        outputs[-1] = _layer_norm(cfg, "final_norm")(x_BxLxH).astype(cfg.dtype)
        return jnp.stack(outputs) if all_layers else outputs[-1]


class ModernBertPredictionHead(nn.Module):
    """`norm(activation(dense(x)))`: the MLM head's (and the classifiers') transform."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, x_BxPxH: jax.Array) -> jax.Array:
        cfg = self.config
        y_BxPxH = _dense(
            cfg, cfg.hidden_size, (EMBED, EMBED_OUT), _out_std(cfg), cfg.classifier_bias, "dense"
        )(x_BxPxH)
        return _layer_norm(cfg, "norm")(ACTIVATIONS[cfg.classifier_activation](y_BxPxH))


class ModernBertForMaskedLM(nn.Module):
    """The encoder, the prediction head and the decoder tied to the token embeddings (plus an
    output bias with `decoder_bias`): float32 logits `[B, P, V]` at `masked_lm_positions`, or
    `[B, L, V]` at every position without them (transformers' output)."""

    config: ModernBertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array,
        masked_lm_positions: jax.Array | None = None,
        deterministic: bool = True,
        *,
        position_ids: jax.Array | None = None,
        instance_ids: jax.Array | None = None,
    ) -> jax.Array:
        cfg = self.config
        encoder = ModernBertModel(cfg, name="model")
        sequence_BxLxH = encoder(
            input_ids,
            attention_mask,
            deterministic,
            position_ids=position_ids,
            instance_ids=instance_ids,
        )
        if masked_lm_positions is not None:
            sequence_BxLxH = gather_positions(sequence_BxLxH, masked_lm_positions)
        h_BxPxH = ModernBertPredictionHead(cfg, name="head")(sequence_BxLxH)
        embeddings_VxH = encoder.variables["params"]["embeddings"]["tok_embeddings"]
        return ModernBertDecoder(cfg, name="decoder")(h_BxPxH, nn.meta.unbox(embeddings_VxH))


class ModernBertDecoder(nn.Module):
    """The vocabulary projection by the tied token embeddings, plus a bias with
    `decoder_bias` (transformers' `decoder`): float32 logits."""

    config: ModernBertConfig

    @nn.compact
    def __call__(self, h_BxPxH: jax.Array, embeddings_VxH: jax.Array) -> jax.Array:
        cfg = self.config
        logits_BxPxV = jnp.einsum(
            "bph,vh->bpv",
            h_BxPxH.astype(cfg.dtype),
            embeddings_VxH.astype(cfg.dtype),
            preferred_element_type=jnp.float32,
        )
        if cfg.decoder_bias:
            logits_BxPxV += self.param(
                "bias", zeros((VOCAB,)), (cfg.vocab_size,), cfg.param_dtype
            ).astype(jnp.float32)
        return logits_BxPxV


def example_inputs(length: int = 8) -> tuple[jax.Array, ...]:
    """Inputs for `ModernBertForMaskedLM.init`: ids and mask `[1, length]` (the parameters
    depend on neither batch size nor length)."""
    return (jnp.zeros((1, length), jnp.int32), jnp.ones((1, length), jnp.int32))
