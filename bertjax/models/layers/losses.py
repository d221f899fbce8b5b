"""The losses every model and task shares: the cross-entropy (`nll`), the masked LM's term of
a pretraining loss (each family's `pretraining_loss` builds on it), and the fine-tuning heads'
losses. A fine-tuning loss returns `(loss, {"loss_sum", "count"})`: the mean over weighted
examples (tokens for tagging); weights are 0 for padding rows/tokens."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

MLM_WEIGHT_EPSILON = 1e-5  # the original: sum(w * nll) / (sum(w) + 1e-5)
Loss = tuple[jax.Array, dict[str, jax.Array]]  # (loss, its metric sums)


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


def mlm_weight_total(batch: Mapping[str, jax.Array]) -> jax.Array:
    """The masked-LM weights of a (whole optimizer) batch: the masked LM's denominator."""
    return jnp.sum(batch["masked_lm_weights"].astype(jnp.float32))


def masked_lm(
    logits_BxPxV: jax.Array, batch: Mapping[str, jax.Array], weight_total: jax.Array
) -> Loss:
    """The masked LM's term of a pretraining loss, `sum(w * nll) / (weight_total + 1e-5)` as
    in the original `run_pretraining.py` (`weight_total`: the whole optimizer batch's, so
    micro-batches add up to it), and its metric sums (loss, correct, weight)."""
    weights_BxP = batch["masked_lm_weights"].astype(jnp.float32)
    loss_sum = jnp.sum(weights_BxP * nll(logits_BxPxV, batch["masked_lm_ids"]))
    correct_BxP = jnp.argmax(logits_BxPxV, axis=-1) == batch["masked_lm_ids"]
    return loss_sum / (weight_total + MLM_WEIGHT_EPSILON), {
        "mlm_loss_sum": loss_sum,
        "mlm_correct_sum": jnp.sum(weights_BxP * correct_BxP),
        "mlm_weight_sum": jnp.sum(weights_BxP),
    }


def masked_lm_only(
    logits_BxPxV: jax.Array, batch: Mapping[str, jax.Array], weight_total: jax.Array
) -> Loss:
    """The pretraining loss of a model without a next-sentence head: the masked LM's alone,
    with the next-sentence sums every pretraining step reports at 0."""
    loss, sums = masked_lm(logits_BxPxV, batch, weight_total)
    zero = jnp.zeros((), jnp.float32)
    return loss, {**sums, "nsp_loss_sum": zero, "nsp_correct_sum": zero, "nsp_count": zero}


def weighted_mean(values: jax.Array, weights: jax.Array) -> Loss:
    """`(sum(w * values) / max(sum(w), 1), {"loss_sum", "count"})`."""
    weights = weights.astype(jnp.float32)
    loss_sum, count = jnp.sum(weights * values), jnp.sum(weights)
    return loss_sum / jnp.maximum(count, 1.0), {"loss_sum": loss_sum, "count": count}


def classification_loss(logits_BxC: jax.Array, labels_B: jax.Array, weights_B: jax.Array) -> Loss:
    """Mean cross-entropy (run_classifier)."""
    return weighted_mean(nll(logits_BxC, labels_B), weights_B)


def regression_loss(predictions_Bx1: jax.Array, targets_B: jax.Array, weights_B: jax.Array) -> Loss:
    """Mean squared error (STS-B)."""
    error = predictions_Bx1[:, 0].astype(jnp.float32) - targets_B.astype(jnp.float32)
    return weighted_mean(error * error, weights_B)


def tagging_loss(logits_BxLxC: jax.Array, labels_BxL: jax.Array, weights_BxL: jax.Array) -> Loss:
    """Mean cross-entropy over the labelled tokens (first sub-token of each word)."""
    return weighted_mean(nll(logits_BxLxC, labels_BxL), weights_BxL)


def span_loss(
    start_logits_BxL: jax.Array,
    end_logits_BxL: jax.Array,
    start_positions_B: jax.Array,
    end_positions_B: jax.Array,
    weights_B: jax.Array,
) -> Loss:
    """run_squad: the mean of the start and end cross-entropies."""
    mean_nll = (
        nll(start_logits_BxL, start_positions_B) + nll(end_logits_BxL, end_positions_B)
    ) / 2.0
    return weighted_mean(mean_nll, weights_B)
