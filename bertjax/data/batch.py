"""What a pretraining batch holds, in one place: a phase's shape (`PhaseShape`) and the name,
dtype and shape of every feature of its batches, unpacked or packed (`specs`), with empty
(`zeros`) and abstract (`abstract`) batches.

Unpacked rows hold one instance each: input_ids, input_mask, segment_ids [B, L];
masked_lm_positions, masked_lm_ids, masked_lm_weights [B, P]; next_sentence_labels [B].
Packed rows (`data.packing`) hold up to K instances: PACKED_INPUTS besides, and one next
sentence prediction per instance (next_sentence_positions, _labels, _weights [B, K]).
The shard format (`data.shard_format`) stores them compactly; the loaders give them as here.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class PhaseShape:
    """The batches of one phase: sequences of `max_seq_length` tokens with at most
    `max_predictions_per_seq` masked positions, `global_batch_size` of them per step."""

    name: str
    max_seq_length: int
    max_predictions_per_seq: int
    global_batch_size: int


FEATURES = (
    "input_ids",
    "input_mask",
    "segment_ids",
    "masked_lm_positions",
    "masked_lm_ids",
    "masked_lm_weights",
    "next_sentence_labels",
)
# The extra model inputs of packed rows (passed by name to the model).
PACKED_INPUTS = ("position_ids", "instance_ids", "next_sentence_positions")
DTYPES = {
    **{name: np.dtype(np.int32) for name in FEATURES + PACKED_INPUTS},
    "masked_lm_weights": np.dtype(np.float32),
    "next_sentence_weights": np.dtype(np.float32),
}


def specs(
    rows: int, max_seq_length: int, max_predictions: int, packed_instances: int = 0
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """`name -> (shape, dtype)` of every feature of `rows` rows; `packed_instances` = K > 0:
    packed rows of up to K instances."""
    length, slots = (rows, max_seq_length), (rows, max_predictions)
    names: list[tuple[str, tuple[int, ...]]] = [
        ("input_ids", length),
        ("input_mask", length),
        ("segment_ids", length),
    ]
    if packed_instances:
        names += [("position_ids", length), ("instance_ids", length)]
    names += [
        ("masked_lm_positions", slots),
        ("masked_lm_ids", slots),
        ("masked_lm_weights", slots),
    ]
    if packed_instances:
        names += [
            (name, (rows, packed_instances))
            for name in ("next_sentence_positions", "next_sentence_labels", "next_sentence_weights")
        ]
    else:
        names.append(("next_sentence_labels", (rows,)))
    return {name: (shape, DTYPES[name]) for name, shape in names}


def zeros(
    rows: int, max_seq_length: int, max_predictions: int, packed_instances: int = 0
) -> dict[str, np.ndarray]:
    """A batch of `rows` rows of zeros (`rows=0`: the empty batch)."""
    return {
        name: np.zeros(shape, dtype)
        for name, (shape, dtype) in specs(
            rows, max_seq_length, max_predictions, packed_instances
        ).items()
    }


def abstract(
    phase: PhaseShape, rows: int, placement: jax.sharding.Sharding | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """An unpacked batch of `phase` with `rows` rows as abstract arrays (optionally placed
    with the sharding `placement`)."""
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=placement)
        for name, (shape, dtype) in specs(
            rows, phase.max_seq_length, phase.max_predictions_per_seq
        ).items()
    }
