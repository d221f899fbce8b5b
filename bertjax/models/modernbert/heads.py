"""ModernBERT's fine-tuning models, exactly as transformers defines
`ModernBertForSequenceClassification`, `ModernBertForTokenClassification` and
`ModernBertForQuestionAnswering`: the encoder (`model`), the prediction head (`head`: dense,
activation, norm; loaded from the pretrained MLM head, as transformers does), dropout
(`classifier_dropout`) and a `classifier` Dense. Sequence tasks pool first
(`classifier_pooling`: the [CLS] vector, or the mean over the real tokens). The call
signature is BERT's heads' (`bertjax.models.bert.heads`), so the fine-tuning loop runs either family;
ModernBERT has no segment embeddings and ignores `token_type_ids`."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models.axes import EMBED
from bertjax.models.dropout import Dropout
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.models.modernbert.model import ModernBertModel, ModernBertPredictionHead


def classifier(
    config: ModernBertConfig, num_labels: int, x: jax.Array, deterministic: bool
) -> jax.Array:
    """The head, dropout and `classifier` (transformers' init: a normal of stddev
    hidden_size**-0.5, truncated) on `x [..., H]`: float32 logits `[..., num_labels]`.
    Called inside the fine-tuning model's compact scope."""
    x = ModernBertPredictionHead(config, name="head")(x)
    x = Dropout(config.classifier_dropout)(x, deterministic)
    cutoff, std = config.initializer_cutoff_factor, config.hidden_size**-0.5
    init = nn.initializers.truncated_normal(std, lower=-cutoff, upper=cutoff)
    return nn.Dense(
        num_labels,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=nn.with_logical_partitioning(init, (EMBED, None)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)),
        name="classifier",
    )(x).astype(jnp.float32)


class ModernBertForSequenceClassification(nn.Module):
    """Logits `[B, num_labels]` from the pooled encoder output (`num_labels=1`: regression)."""

    config: ModernBertConfig
    num_labels: int

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> jax.Array:
        del token_type_ids
        cfg = self.config
        x_BxLxH = ModernBertModel(cfg, name="model")(input_ids, attention_mask, deterministic)
        if cfg.classifier_pooling == "cls":
            pooled_BxH = x_BxLxH[:, 0]
        else:  # the mean over the real tokens, in float32
            mask_BxLx1 = attention_mask[..., None].astype(jnp.float32)
            pooled_BxH = jnp.sum(x_BxLxH.astype(jnp.float32) * mask_BxLx1, axis=1) / jnp.sum(
                mask_BxLx1, axis=1
            )
            pooled_BxH = pooled_BxH.astype(x_BxLxH.dtype)
        return classifier(cfg, self.num_labels, pooled_BxH, deterministic)


class ModernBertForTokenClassification(nn.Module):
    """A tag per token: logits `[B, L, num_labels]`."""

    config: ModernBertConfig
    num_labels: int

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> jax.Array:
        del token_type_ids
        return tagged(self.config, self.num_labels, input_ids, attention_mask, deterministic)


class ModernBertForQuestionAnswering(nn.Module):
    """Span prediction: the token classifier with two outputs, returned as
    `(start_logits [B, L], end_logits [B, L])`."""

    config: ModernBertConfig
    num_labels: int = 2

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array]:
        del token_type_ids
        logits_BxLx2 = tagged(
            self.config, self.num_labels, input_ids, attention_mask, deterministic
        )
        return logits_BxLx2[..., 0], logits_BxLx2[..., 1]


def tagged(
    config: ModernBertConfig,
    num_labels: int,
    input_ids: jax.Array,
    attention_mask: jax.Array,
    deterministic: bool,
) -> jax.Array:
    """The encoder (`model`) and `classifier` on every position: logits `[B, L, num_labels]`.
    Called inside the fine-tuning model's compact scope."""
    x_BxLxH = ModernBertModel(config, name="model")(input_ids, attention_mask, deterministic)
    return classifier(config, num_labels, x_BxLxH, deterministic)
