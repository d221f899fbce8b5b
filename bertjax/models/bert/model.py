"""BERT in Flax linen: the original architecture, with logical axis names on every parameter
(`blocks`); the embeddings, the pooler and the pretraining heads around the encoder (`encoder`).

Parameter paths follow Google's TF checkpoint names (`bert/embeddings/word_embeddings`,
`bert/encoder/layer_3/attention/self/query/kernel`, `cls/predictions/output_bias`, ...), so
conversion is a rename plus a transpose-free copy.

Shape legend: B batch, L sequence length, H hidden size, V vocab size, P gathered (masked)
positions, K instances per packed row (`data.packing`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention
from bertjax.models.axes import (
    ACT_EMBED,
    BATCH,
    EMBED,
    EMBED_OUT,
    LABELS,
    LENGTH,
    NSP_CLASSES,
    POSITION,
    TOKEN_TYPE,
    VOCAB,
    constrain,
    zeros,
)
from bertjax.models.bert.blocks import activated_dense, dense, layer_norm, truncated_normal
from bertjax.models.bert.config import BertConfig
from bertjax.models.bert.encoder import BertEncoder
from bertjax.models.dropout import Dropout
from bertjax.models.layers.gather import gather_positions


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    config: BertConfig

    def setup(self) -> None:
        cfg = self.config
        for name, axis, rows in (
            ("word_embeddings", VOCAB, cfg.vocab_size),
            ("position_embeddings", POSITION, cfg.max_position_embeddings),
            ("token_type_embeddings", TOKEN_TYPE, cfg.type_vocab_size),
        ):
            setattr(
                self,
                name,
                self.param(
                    name,
                    truncated_normal(cfg, (axis, EMBED)),
                    (rows, cfg.hidden_size),
                    cfg.param_dtype,
                ),
            )
        self.layer_norm = layer_norm(cfg)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        token_type_ids_BxL: jax.Array,
        deterministic: bool,
        position_ids_BxL: jax.Array | None = None,
    ) -> jax.Array:
        length = input_ids_BxL.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        positions = (
            self.position_embeddings[None, :length]
            if position_ids_BxL is None
            else jnp.take(self.position_embeddings, position_ids_BxL, axis=0)
        )
        x_BxLxH = (
            jnp.take(self.word_embeddings, input_ids_BxL, axis=0)
            + positions
            + jnp.take(self.token_type_embeddings, token_type_ids_BxL, axis=0)
        )
        x_BxLxH = self.layer_norm(x_BxLxH)
        x_BxLxH = self.dropout(x_BxLxH, deterministic=deterministic)
        return constrain(x_BxLxH.astype(self.config.dtype), (BATCH, LENGTH, ACT_EMBED))


class BertPooler(nn.Module):
    """`tanh(Dense(h[:, 0]))`: the [CLS] representation (each at `cls_positions_BxK`: packed)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array, cls_positions_BxK: jax.Array | None = None) -> jax.Array:
        cfg = self.config
        first = (
            x_BxLxH[:, 0]
            if cls_positions_BxK is None
            else gather_positions(x_BxLxH, cls_positions_BxK)
        )
        return jnp.tanh(dense(cfg, cfg.hidden_size, (EMBED, EMBED_OUT), "dense")(first))


class BertModel(nn.Module):
    """Embeddings, encoder and pooler. Returns `(sequence_output [B,L,H], pooled [B,H])`; packed
    rows (`data.packing`: instance ids 1..K, 0 = padding) pool each instance's [CLS], `[B,K,H]`."""

    config: BertConfig

    def setup(self) -> None:
        self.embeddings = BertEmbeddings(self.config)
        self.encoder = BertEncoder(self.config)
        self.pooler = BertPooler(self.config)

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        token_type_ids_BxL: jax.Array,
        attention_mask_BxL: jax.Array,
        deterministic: bool = True,
        all_layers: bool = False,
        *,
        position_ids: jax.Array | None = None,
        instance_ids: jax.Array | None = None,
        next_sentence_positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        """With `all_layers`, returns `(layers [num_layers, B, L, H], pooled)` instead."""
        mask = (
            attention.Mask(attention_mask_BxL)
            if instance_ids is None
            else attention.Mask(
                instance_ids,
                next_sentence_positions.shape[1],  # type: ignore[union-attr]
            )
        )
        x_BxLxH = self.embeddings(input_ids_BxL, token_type_ids_BxL, deterministic, position_ids)
        x = self.encoder(x_BxLxH, mask, deterministic, all_layers)
        return x, self.pooler(x[-1] if all_layers else x, next_sentence_positions)


class BertPredictionTransform(nn.Module):
    """Dense H->H, activation, LayerNorm: the MLM head's `transform` block."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxPxH: jax.Array) -> jax.Array:
        cfg = self.config
        return layer_norm(cfg)(activated_dense(cfg, cfg.hidden_size, (EMBED, EMBED_OUT), x_BxPxH))


class BertMaskedLMHead(nn.Module):
    """The transform block, then the tied word embeddings plus an output bias (fp32 logits)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxPxH: jax.Array, word_embeddings_VxH: jax.Array) -> jax.Array:
        cfg = self.config
        h_BxPxH = BertPredictionTransform(cfg, name="transform")(x_BxPxH)
        output_bias_V = self.param(
            "output_bias", zeros((VOCAB,)), (cfg.vocab_size,), cfg.param_dtype
        )
        embeddings_VxH = word_embeddings_VxH.astype(cfg.dtype)
        padding = -cfg.vocab_size % cfg.vocab_pad_multiple
        if padding:  # a matmul whose output rows are aligned; the padding's logits are cut off
            embeddings_VxH = jnp.pad(embeddings_VxH, ((0, padding), (0, 0)))
        logits_BxPxV = jnp.einsum(
            "bph,vh->bpv",
            h_BxPxH.astype(cfg.dtype),
            embeddings_VxH,
            preferred_element_type=jnp.float32,
        )[..., : cfg.vocab_size]
        return logits_BxPxV + output_bias_V.astype(jnp.float32)


def output_layer(
    module: nn.Module,
    config: BertConfig,
    num_labels: int,
    x_BxXxH: jax.Array,
    class_axis: str = LABELS,
) -> jax.Array:
    """Google's output layer (NSP, fine-tuning heads), created in `module`'s scope (call it from
    a compact method): `x @ output_weights.T + output_bias` with weights stored `[num_labels, in]`
    as the original names them; float32 logits."""
    weights_CxH = module.param(
        "output_weights",
        truncated_normal(config, (class_axis, EMBED)),
        (num_labels, x_BxXxH.shape[-1]),
        config.param_dtype,
    )
    bias_C = module.param("output_bias", zeros((class_axis,)), (num_labels,), config.param_dtype)
    logits = jnp.einsum(
        "...h,ch->...c",
        x_BxXxH.astype(config.dtype),
        weights_CxH.astype(config.dtype),
        preferred_element_type=jnp.float32,
    )
    return logits + bias_C.astype(jnp.float32)


class BertNSPHead(nn.Module):
    """Next-sentence logits from the pooled output; weights stored `[2, H]` as the original."""

    config: BertConfig

    @nn.compact
    def __call__(self, pooled_BxH: jax.Array) -> jax.Array:
        return output_layer(self, self.config, 2, pooled_BxH, NSP_CLASSES)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads: `(mlm_logits [B, P, V], nsp_logits [B, 2]`
    (packed rows: `[B, K, 2]`)); the vocabulary projection runs only on the P gathered positions."""

    config: BertConfig

    def setup(self) -> None:
        self.bert = BertModel(self.config)
        self.predictions = BertMaskedLMHead(self.config)
        self.seq_relationship = BertNSPHead(self.config)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        masked_lm_positions: jax.Array,
        deterministic: bool = True,
        *,
        position_ids: jax.Array | None = None,
        instance_ids: jax.Array | None = None,
        next_sentence_positions: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array]:
        sequence_BxLxH, pooled_BxH = self.bert(
            input_ids,
            token_type_ids,
            attention_mask,
            deterministic,
            position_ids=position_ids,
            instance_ids=instance_ids,
            next_sentence_positions=next_sentence_positions,
        )
        masked_BxPxH = gather_positions(sequence_BxLxH, masked_lm_positions)
        mlm_logits = self.predictions(masked_BxPxH, self.bert.embeddings.word_embeddings)
        return mlm_logits, self.seq_relationship(pooled_BxH)


# ----------------------------------------------------------------------------- model-level helpers

# BertConfig fields that change what the weights compute: a checkpoint and a run must agree on
# them (converted checkpoints, init_checkpoint, fine-tuning, resuming).
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
)
# BertConfig fields that change how the weights are stored (dtype, stacked layers), not what
# they compute: a resume must keep them; a conversion or a pretrained load may change them.
STORAGE_FIELDS = ("param_dtype", "scan_layers")


def architecture(config: BertConfig) -> dict[str, Any]:
    """`{field: value}` of the ARCHITECTURE_FIELDS."""
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def example_inputs(model: nn.Module) -> tuple[jax.Array, ...]:
    """Inputs for `model.init`: ids, segments, mask `[1, L]`, plus masked positions [1, 2] for
    BertForPreTraining (the parameters depend on neither batch size nor length). L is 128
    where the model allows it (TPU's Pallas kernel takes multiples of 128 only), else 8."""
    config = getattr(model, "config", None)
    length = 128 if getattr(config, "max_position_embeddings", 0) >= 128 else 8
    ids_1xL = (jnp.zeros((1, length), jnp.int32),) * 3
    return (
        (*ids_1xL, jnp.zeros((1, 2), jnp.int32))
        if isinstance(model, BertForPreTraining)
        else ids_1xL
    )
