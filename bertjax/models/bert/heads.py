"""Fine-tuning models: BERT plus run_classifier's, run_squad's and a token tagger's output
layers, with the original checkpoints' parameter names (`output_weights`, `cls/squad/...`)."""

from __future__ import annotations

from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention
from bertjax.models.bert.model import BertConfig, BertModel, output_layer
from bertjax.models.dropout import Dropout


class BertForSequenceClassification(nn.Module):
    """run_classifier's model: dropout on the pooled output, then top-level
    `output_weights [C, H]` and `output_bias [C]`.
    Returns logits `[B, num_labels]` (`num_labels=1` for regression such as STS-B).

    With `causal=True` (a left-to-right model, `train.objective=ltr`: the paper's Table 5 keeps
    the left-only constraint at fine-tuning) the pooler reads the last real token ([SEP]), as
    [CLS] at position 0 then sees only itself.
    """

    config: BertConfig
    num_labels: int
    causal: bool = False

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> jax.Array:
        bert = BertModel(self.config, name="bert")
        if not self.causal:
            _, pooled_BxH = bert(input_ids, token_type_ids, attention_mask, deterministic)
        else:
            last_Bx1 = jnp.sum(attention_mask, axis=-1, keepdims=True).astype(jnp.int32) - 1
            _, pooled_Bx1xH = bert(
                input_ids,
                token_type_ids,
                attention.causal_mask(attention_mask),
                deterministic,
                next_sentence_positions=last_Bx1,
            )
            pooled_BxH = pooled_Bx1xH[:, 0]
        pooled_BxH = Dropout(self.config.hidden_dropout_prob)(pooled_BxH, deterministic)
        return output_layer(self, self.config, self.num_labels, pooled_BxH)


class BertForTokenClassification(nn.Module):
    """A tag per token: dropout, then `output_weights [C, H]` on every position.

    With `feature_based=True` (the paper's feature-based NER, section 5.3) the encoder is
    frozen: the last four layers are concatenated `[B, L, 4H]` and a two-layer BiLSTM of
    `lstm_size` units per direction feeds the output layer. Returns logits `[B, L, C]`.
    `causal=True`: each token attends only to itself and the tokens before it (a left-to-right
    model, `train.objective=ltr`).
    """

    config: BertConfig
    num_labels: int
    feature_based: bool = False
    lstm_size: int = 768
    causal: bool = False

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> jax.Array:
        bert = BertModel(self.config, name="bert")
        encoder_mask = attention.causal_mask(attention_mask) if self.causal else attention_mask
        if not self.feature_based:
            x_BxLxH, _ = bert(input_ids, token_type_ids, encoder_mask, deterministic)
        else:
            # Features of a frozen encoder: no dropout inside it, no gradient into it.
            layers_NxBxLxH, _ = bert(input_ids, token_type_ids, encoder_mask, True, all_layers=True)
            x_BxLxH = jax.lax.stop_gradient(jnp.concatenate(list(layers_NxBxLxH[-4:]), axis=-1))
            lengths_B = jnp.sum(attention_mask, axis=-1).astype(jnp.int32)
            for i in range(2):
                forward, backward = (
                    nn.RNN(
                        nn.OptimizedLSTMCell(
                            self.lstm_size,
                            param_dtype=self.config.param_dtype,
                            name=f"lstm_{i}_{direction}",
                        )
                    )
                    for direction in ("forward", "backward")
                )
                x_BxLxH = cast(  # (flax types the call for `return_carry` too)
                    jax.Array,
                    nn.Bidirectional(forward, backward)(
                        x_BxLxH.astype(jnp.float32), seq_lengths=lengths_B
                    ),
                )
        x_BxLxH = Dropout(self.config.hidden_dropout_prob)(x_BxLxH, deterministic)
        return output_layer(self, self.config, self.num_labels, x_BxLxH)


class SquadOutput(nn.Module):
    """run_squad's `squad/output_weights [2, H]` and `squad/output_bias [2]`."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array) -> jax.Array:
        return output_layer(self, self.config, 2, x_BxLxH)


class ClsScope(nn.Module):
    """The `cls` variable scope of the original heads (here: `cls/squad`)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array) -> jax.Array:
        return SquadOutput(self.config, name="squad")(x_BxLxH)


class BertForQuestionAnswering(nn.Module):
    """run_squad's model: `cls/squad/output_weights [2, H]` on every position, no dropout.
    Returns `(start_logits [B, L], end_logits [B, L])`."""

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        deterministic: bool = True,
    ) -> tuple[jax.Array, jax.Array]:
        x_BxLxH, _ = BertModel(self.config, name="bert")(
            input_ids, token_type_ids, attention_mask, deterministic
        )
        logits_BxLx2 = ClsScope(self.config, name="cls")(x_BxLxH)
        return logits_BxLx2[..., 0], logits_BxLx2[..., 1]
