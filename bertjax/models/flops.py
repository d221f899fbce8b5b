"""Model FLOPs of a pretraining step and model FLOPs utilisation (MFU).

Model FLOPs count the useful work of forward + backward (3 x the forward's 2 FLOPs per
multiply-add) at the sequence's full length; rematerialisation and padding are not counted.
"""

from __future__ import annotations

from bertjax.models import families

# Dense bf16 peak TFLOP/s per chip, matched against `jax.Device.device_kind` (lower-cased) in
# order: the first entry whose every word occurs in the kind wins.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("tpu", "v4"), 275.0),
    (("tpu", "v5", "lite"), 197.0),  # v5e
    (("tpu", "v5e"), 197.0),
    (("tpu", "v5p"), 459.0),
    (("tpu", "v5"), 459.0),  # v5p reports itself as "TPU v5"
    (("tpu", "v6", "lite"), 918.0),  # v6e (Trillium)
    (("tpu", "v6e"), 918.0),
    (("a100",), 312.0),
    (("h100",), 989.0),
    (("h200",), 989.0),
)


def train_flops_per_sequence(
    config: families.ModelConfig, seq_length: int, predictions: int
) -> int:
    """Model FLOPs of one sequence of `seq_length` tokens with `predictions` gathered MLM
    positions, as the model's family counts them (`families.Family.flops`; BERT:
    `families.bert.flops`, ModernBERT: `families.modernbert.flops`)."""
    return families.of(config).flops(config, seq_length, predictions)


def peak_tflops(device_kind: str) -> float | None:
    """The table's bf16 peak TFLOP/s for a device kind, or None (e.g. CPUs)."""
    kind = device_kind.lower()
    for words, tflops in PEAK_BF16_TFLOPS:
        if all(word in kind for word in words):
            return tflops
    return None


def mfu(flops_per_second: float, chips: int, peak_tflops_per_chip: float | None) -> float | None:
    """Achieved model FLOP/s over the chips' peak, or None without a peak."""
    if not peak_tflops_per_chip:
        return None
    return flops_per_second / (chips * peak_tflops_per_chip * 1e12)
