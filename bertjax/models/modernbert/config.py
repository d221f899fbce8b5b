"""ModernBERT's hyperparameters: the fields of Hugging Face's `ModernBertConfig` that change
what the weights compute (same names and defaults as transformers 5.23), plus bertjax's
compute/parameter dtypes and attention switch."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from bertjax.models import attention
from bertjax.models.layers.config import ACTIVATIONS, DTYPES, REMAT_POLICIES, FieldChecks, FromDict

SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "global_attn_every_n_layers",
    "local_attention",
)
SWITCHES = ("norm_bias", "attention_bias", "mlp_bias", "decoder_bias", "classifier_bias")
RATES = ("attention_dropout", "embedding_dropout", "mlp_dropout", "classifier_dropout")
POOLINGS = ("cls", "mean")  # classifier_pooling: the [CLS] vector, or the mean of the real tokens


@dataclasses.dataclass(frozen=True)
class ModernBertConfig(FromDict):
    """ModernBERT's architecture (defaults: ModernBERT-base) and bertjax's compute switches."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152  # per GeGLU half: Wi projects to 2 x this
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"  # one of layers.config.ACTIVATIONS (the GeGLU's)
    max_position_embeddings: int = 8192  # RoPE: the longest row the model was trained for
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0  # truncation of the normal init, in stddevs
    norm_eps: float = 1e-5
    norm_bias: bool = False  # LayerNorms with a bias (else scale only)
    attention_bias: bool = False  # Wqkv and the attention's Wo with biases
    mlp_bias: bool = False  # the GeGLU's Wi and Wo with biases
    decoder_bias: bool = True  # the MLM decoder's output bias
    classifier_bias: bool = False  # the prediction head's dense with a bias
    classifier_activation: str = "gelu"  # the prediction head's activation
    global_attn_every_n_layers: int = 3  # layer i attends globally when i % n == 0
    local_attention: int = 128  # sliding window: each query sees keys within +- half of it
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    attention_dropout: float = 0.0  # on the attention probabilities and the attention output
    embedding_dropout: float = 0.0
    mlp_dropout: float = 0.0  # inside the GeGLU, before Wo
    classifier_dropout: float = 0.0  # fine-tuning: on the head's output, before the classifier
    classifier_pooling: str = "cls"  # fine-tuning, sequence tasks: one of POOLINGS
    pad_token_id: int = 50283
    dtype: str = "float32"  # compute dtype; "bfloat16" on TPU/GPU
    param_dtype: str = "float32"
    remat_policy: str = "none"  # one of REMAT_POLICIES
    attention_impl: str = "auto"  # sliding windows run the einsum reference for now

    def __post_init__(self) -> None:
        check(dataclasses.asdict(self))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_probs_dropout_prob(self) -> float:
        """BertConfig's name of `attention_dropout`, read by the shared machinery (autofit's
        choice of attention kernel)."""
        return self.attention_dropout

    def resolved_attention_impl(self, backend: str | None = None) -> str:
        """The implementation training uses on `backend` (default: the target platform): the
        global layers' choice, and the sliding-window layers' (`attention.window_impl`)."""
        impl = attention.resolve_impl(
            self.attention_impl, self.dtype, self.head_size, backend, self.attention_dropout
        )
        window = attention.window_impl(impl, self.local_attention // 2, self.attention_dropout)
        if window == "einsum":  # in blocks where they hold fewer scores (local_attention.py)
            window = "blocked einsum"
        local = any(not self.is_global(i) for i in range(self.num_hidden_layers))
        return (
            f"{impl} (global layers), {window} (sliding windows)"
            if local and window != impl
            else impl
        )

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends over the whole row (else over its sliding window)."""
        return layer % self.global_attn_every_n_layers == 0


# ModernBertConfig fields that change what the weights compute (checkpoint and run must agree).
ARCHITECTURE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModernBertConfig)
    if f.name
    not in (
        "dtype",
        "param_dtype",
        "remat_policy",
        "attention_impl",
        "initializer_range",
        "initializer_cutoff_factor",
        "pad_token_id",
        "classifier_pooling",
    )
    and f.name not in RATES
)


def architecture(config: ModernBertConfig) -> dict[str, Any]:
    """`{field: value}` of the ARCHITECTURE_FIELDS."""
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def check(values: Mapping[str, Any], prefix: str = "", flag: str = "") -> None:
    """Raises ValueError for the first field in `values` (absent ones at their defaults) that
    cannot build a model, in one line naming `{prefix}{field}` and the setting
    `{flag}{prefix}{field}` that fixes it."""
    fields = FieldChecks(ModernBertConfig, values, prefix, flag)
    fields.sizes(SIZE_FIELDS)
    fields.heads_divide_hidden()
    if (fields.value["hidden_size"] // fields.value["num_attention_heads"]) % 2:
        raise ValueError(
            f"the head size {fields.name('hidden_size')} / "
            f"{fields.name('num_attention_heads')} must be even (RoPE rotates "
            f"pairs of units); set {fields.setting('num_attention_heads')}"
        )
    fields.positive(
        (
            "initializer_range",
            "initializer_cutoff_factor",
            "norm_eps",
            "global_rope_theta",
            "local_rope_theta",
        )
    )
    for field in RATES:
        value = fields.value[field]
        if not isinstance(value, numbers.Real) or not 0 <= float(value) < 1:
            raise ValueError(
                f"{fields.name(field)}={value!r} is out of range: it must be in "
                f"[0, 1); set {fields.setting(field)}"
            )
    for field in SWITCHES:
        if not isinstance(fields.value[field], bool):
            raise ValueError(
                f"{fields.name(field)}={fields.value[field]!r} must be True or "
                f"False; set {fields.setting(field)}"
            )
    fields.choices(
        (
            ("hidden_activation", ACTIVATIONS),
            ("classifier_activation", ACTIVATIONS),
            ("classifier_pooling", POOLINGS),
            ("remat_policy", REMAT_POLICIES),
            ("attention_impl", attention.ATTENTION_IMPLS),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
        )
    )
