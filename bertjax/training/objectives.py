"""What pretraining optimises (`train.objective`, `train.next_sentence_prediction`), the
left-to-right objective's batches, and the means of a step's metric sums. The loss itself is
the model family's (`Family.pretraining_loss`): its metrics are sums plus their denominators,
so that they add over micro-batches, steps and hosts without biasing a mean with padding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

OBJECTIVES = ("mlm", "ltr")


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
