"""The losses every model and task shares: the cross-entropy (`nll`), and the fine-tuning
heads' losses. Each returns `(loss, {"loss_sum", "count"})`: the loss is the mean over weighted
examples (tokens for tagging); weights are 0 for padding rows/tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """`-log_softmax(logits)[label]` as jax.nn.log_softmax computes it (bit for bit), with the
    label's logit picked by a compare against an iota rather than a gather: its gradient is
    elementwise, not a scatter into a zero [..., classes] array."""
    logits = logits.astype(jnp.float32)
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_sum = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    classes = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    label_shifted = jnp.sum(
        jnp.where(classes == labels[..., None].astype(jnp.int32), shifted, 0.0), axis=-1
    )
    return -(label_shifted - log_sum)


def weighted_mean(values: jax.Array, weights: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(sum(w * values) / max(sum(w), 1), {"loss_sum", "count"})`."""
    weights = weights.astype(jnp.float32)
    loss_sum, count = jnp.sum(weights * values), jnp.sum(weights)
    return loss_sum / jnp.maximum(count, 1.0), {"loss_sum": loss_sum, "count": count}


def classification_loss(logits_BxC: jax.Array, labels_B: jax.Array, weights_B: jax.Array):
    """Mean cross-entropy (run_classifier)."""
    return weighted_mean(nll(logits_BxC, labels_B), weights_B)


def regression_loss(predictions_Bx1: jax.Array, targets_B: jax.Array, weights_B: jax.Array):
    """Mean squared error (STS-B)."""
    error = predictions_Bx1[:, 0].astype(jnp.float32) - targets_B.astype(jnp.float32)
    return weighted_mean(error * error, weights_B)


def tagging_loss(logits_BxLxC: jax.Array, labels_BxL: jax.Array, weights_BxL: jax.Array):
    """Mean cross-entropy over the labelled tokens (first sub-token of each word)."""
    return weighted_mean(nll(logits_BxLxC, labels_BxL), weights_BxL)


def span_loss(
    start_logits_BxL: jax.Array,
    end_logits_BxL: jax.Array,
    start_positions_B: jax.Array,
    end_positions_B: jax.Array,
    weights_B: jax.Array,
):
    """run_squad: the mean of the start and end cross-entropies."""
    mean_nll = (
        nll(start_logits_BxL, start_positions_B) + nll(end_logits_BxL, end_positions_B)
    ) / 2.0
    return weighted_mean(mean_nll, weights_B)
