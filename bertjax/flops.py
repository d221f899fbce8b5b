"""Model FLOPs of a BERT pretraining step and model FLOPs utilisation (MFU).

Model FLOPs count the useful work of forward + backward (3 x the forward's 2 FLOPs per
multiply-add) at the sequence's full length; rematerialisation and padding are not counted.
"""
from __future__ import annotations

from bertjax.model import BertConfig
from bertjax.modernbert_config import ModernBertConfig

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


def train_flops_per_sequence(config: BertConfig | ModernBertConfig, seq_length: int,
                             predictions: int) -> int:
    """BERT: `6*S*L*(4H^2 + 2HI) + 12*L*H*S^2 + 6*P*(H^2 + HV) + 6*(H^2 + 2H)`.

    S tokens per sequence, L layers, H hidden, I intermediate (FFN), P gathered MLM
    positions, V vocabulary: the encoder's matmuls, attention scores and values, the MLM
    head (transform + tied vocabulary projection) at P positions, and pooler + NSP.
    ModernBERT: `6*S*L*(4H^2 + 3HI) + 12*H*S*sum(keys per query over layers) + 6*P*(H^2 + HV)`:
    the GeGLU's three H x I matmuls, a sliding-window layer's queries seeing at most
    `2 * (local_attention // 2) + 1` keys, no pooler or NSP.
    """
    s, layers, h = seq_length, config.num_hidden_layers, config.hidden_size
    i, v, p = config.intermediate_size, config.vocab_size, predictions
    if isinstance(config, ModernBertConfig):
        window = min(s, 2 * (config.local_attention // 2) + 1)
        keys = sum(s if config.is_global(layer) else window for layer in range(layers))
        return (6 * s * layers * (4 * h * h + 3 * h * i) + 12 * h * s * keys
                + 6 * p * (h * h + h * v))
    return (6 * s * layers * (4 * h * h + 2 * h * i) + 12 * layers * h * s * s
            + 6 * p * (h * h + h * v) + 6 * (h * h + 2 * h))


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
