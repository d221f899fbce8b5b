"""Pretraining losses and metric sums (the original `run_pretraining.py` definitions).

Metrics are returned as sums plus their denominators so that they can be added over
micro-batches, steps and hosts without biasing a mean with padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MLM_WEIGHT_EPSILON = 1e-5  # the original: sum(w * nll) / (sum(w) + 1e-5)
OBJECTIVES = ("mlm", "ltr")
Loss = tuple[jax.Array, dict[str, jax.Array]]  # (loss, its metric sums)


@dataclasses.dataclass(frozen=True)
class PretrainingObjective:
    """What pretraining optimises (`config.train.objective`, `next_sentence_prediction`):
    "mlm", the masked LM (+ NSP unless switched off), or "ltr", a left-to-right LM with causal
    attention and no NSP (the paper's Table 5 ablations)."""

    kind: str = "mlm"
    next_sentence_prediction: bool = True

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"train.objective={self.kind!r}; choose one of {list(OBJECTIVES)}")

    @property
    def causal(self) -> bool:
        return self.kind == "ltr"

    @property
    def uses_nsp(self) -> bool:
        return self.next_sentence_prediction and not self.causal


def next_token_batch(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """A pretraining batch as a left-to-right LM task: the masked tokens are put back (from
    `masked_lm_ids`), and position i predicts token i + 1 for every real token but the first
    (`masked_lm_*` over positions 0..L-2), so the MLM loss and metrics become the LM's."""
    ids_BxL, positions_BxP = batch["input_ids"], batch["masked_lm_positions"]
    rows_Bx1 = jnp.arange(ids_BxL.shape[0])[:, None]
    # Padding slots (weight 0, position 0 = [CLS], never masked) write back the id already there.
    original_BxP = jnp.where(
        batch["masked_lm_weights"] > 0, batch["masked_lm_ids"], ids_BxL[rows_Bx1, positions_BxP]
    )
    ids_BxL = ids_BxL.at[rows_Bx1, positions_BxP].set(original_BxP)
    batch_size, length = ids_BxL.shape
    return dict(
        batch,
        input_ids=ids_BxL,
        masked_lm_positions=jnp.broadcast_to(
            jnp.arange(length - 1, dtype=jnp.int32), (batch_size, length - 1)
        ),
        masked_lm_ids=ids_BxL[:, 1:],
        masked_lm_weights=batch["input_mask"][:, 1:].astype(jnp.float32),
    )


def _nll(logits: jax.Array, labels: jax.Array) -> jax.Array:
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


def nsp_count(batch: dict[str, jax.Array]) -> jax.Array | int:
    """Next-sentence predictions in `batch`: one per row, or per packed instance."""
    if "next_sentence_weights" in batch:
        return jnp.sum(batch["next_sentence_weights"].astype(jnp.float32))
    return batch["next_sentence_labels"].shape[0]


def pretraining_loss(
    mlm_logits_BxPxV: jax.Array,
    nsp_logits_Bx2: jax.Array | None,
    batch: dict[str, jax.Array],
    mlm_weight_total: jax.Array | None = None,
    num_sequences_total: jax.Array | float | None = None,
    next_sentence_prediction: bool = True,
) -> Loss:
    """Returns `(loss, metric_sums)` with loss = MLM + NSP as in the original.

    `mlm_weight_total` and `num_sequences_total` are the denominators of the whole optimizer
    batch; passing them makes the sum of micro-batch losses equal the full-batch loss, so
    gradient accumulation gives exactly the large-batch gradient. They default to this batch.
    Without `next_sentence_prediction` the loss is the MLM's alone and the NSP sums are 0.
    Packed rows have `[B, K, 2]` NSP logits and `next_sentence_weights` (0 for empty slots).
    A model without an NSP head (ModernBERT) passes `nsp_logits_Bx2=None`: as NSP switched off.
    """
    if nsp_logits_Bx2 is None:
        next_sentence_prediction = False
        nsp_logits_Bx2 = jnp.zeros(batch["next_sentence_labels"].shape + (2,), jnp.float32)
    weights_BxP = batch["masked_lm_weights"].astype(jnp.float32)
    mlm_nll_BxP = _nll(mlm_logits_BxPxV, batch["masked_lm_ids"])
    nsp_weight = 1.0 if next_sentence_prediction else 0.0
    nsp_nll_B = nsp_weight * _nll(nsp_logits_Bx2, batch["next_sentence_labels"])
    nsp_weights_B = batch.get("next_sentence_weights", jnp.ones_like(nsp_nll_B))
    if mlm_weight_total is None:
        mlm_weight_total = jnp.sum(weights_BxP)
    if num_sequences_total is None:
        num_sequences_total = nsp_count(batch)
    mlm_loss_sum = jnp.sum(weights_BxP * mlm_nll_BxP)
    nsp_loss_sum = jnp.sum(nsp_weights_B * nsp_nll_B)
    loss = (
        mlm_loss_sum / (mlm_weight_total + MLM_WEIGHT_EPSILON) + nsp_loss_sum / num_sequences_total
    )
    mlm_correct = jnp.argmax(mlm_logits_BxPxV, axis=-1) == batch["masked_lm_ids"]
    nsp_correct = jnp.argmax(nsp_logits_Bx2, axis=-1) == batch["next_sentence_labels"]
    metrics = {
        "mlm_loss_sum": mlm_loss_sum,
        "mlm_correct_sum": jnp.sum(weights_BxP * mlm_correct),
        "mlm_weight_sum": jnp.sum(weights_BxP),
        "nsp_loss_sum": nsp_loss_sum,
        "nsp_correct_sum": nsp_weight * jnp.sum(nsp_weights_B * nsp_correct),
        "nsp_count": jnp.float32(nsp_weight * nsp_count(batch)),
    }
    return loss, metrics


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Turns metric sums (host floats) into means: losses, accuracies and the total loss.

    With next-sentence prediction off (`nsp_count` 0) there are no NSP means at all, rather
    than an accuracy of 0 that reads like a broken head.
    """
    mlm_weight = max(sums["mlm_weight_sum"], 1e-9)
    out = {
        "mlm_loss": sums["mlm_loss_sum"] / mlm_weight,
        "mlm_accuracy": sums["mlm_correct_sum"] / mlm_weight,
    }
    out["loss"] = out["mlm_loss"]
    if sums["nsp_count"] > 0:
        out["nsp_loss"] = sums["nsp_loss_sum"] / sums["nsp_count"]
        out["nsp_accuracy"] = sums["nsp_correct_sum"] / sums["nsp_count"]
        out["loss"] += out["nsp_loss"]
    return out


# ----------------------------------------------------------------------------- fine-tuning
# Each returns `(loss, {"loss_sum", "count"})`: the loss is the mean over weighted examples
# (tokens for tagging); weights are 0 for padding rows/tokens.


def _weighted_mean(values: jax.Array, weights: jax.Array) -> Loss:
    weights = weights.astype(jnp.float32)
    loss_sum, count = jnp.sum(weights * values), jnp.sum(weights)
    return loss_sum / jnp.maximum(count, 1.0), {"loss_sum": loss_sum, "count": count}


def classification_loss(logits_BxC: jax.Array, labels_B: jax.Array, weights_B: jax.Array) -> Loss:
    """Mean cross-entropy (run_classifier)."""
    return _weighted_mean(_nll(logits_BxC, labels_B), weights_B)


def regression_loss(predictions_Bx1: jax.Array, targets_B: jax.Array, weights_B: jax.Array) -> Loss:
    """Mean squared error (STS-B)."""
    error = predictions_Bx1[:, 0].astype(jnp.float32) - targets_B.astype(jnp.float32)
    return _weighted_mean(error * error, weights_B)


def tagging_loss(logits_BxLxC: jax.Array, labels_BxL: jax.Array, weights_BxL: jax.Array) -> Loss:
    """Mean cross-entropy over the labelled tokens (first sub-token of each word)."""
    return _weighted_mean(_nll(logits_BxLxC, labels_BxL), weights_BxL)


def span_loss(
    start_logits_BxL: jax.Array,
    end_logits_BxL: jax.Array,
    start_positions_B: jax.Array,
    end_positions_B: jax.Array,
    weights_B: jax.Array,
) -> Loss:
    """run_squad: the mean of the start and end cross-entropies."""
    nll = (_nll(start_logits_BxL, start_positions_B) + _nll(end_logits_BxL, end_positions_B)) / 2.0
    return _weighted_mean(nll, weights_B)
