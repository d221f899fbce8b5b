"""BERT's hyperparameters (Google's `bert_config.json` plus dtypes and layout switches) and
their checks."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from bertjax.models import attention
from bertjax.models.layers.config import (
    ACTIVATIONS,
    DTYPES,
    REMAT_POLICIES,
    FieldChecks,
    FromDict,
)

# "auto": the Triton kernels on a GPU target in 16-bit compute where they fit (the FFN's: no mesh
# axis splitting its width; the dense outputs': in training, with dropout), else XLA's ops;
# "xla": XLA's ops; "triton": the kernels wherever they fit (compiled on a GPU, in Pallas'
# interpret mode elsewhere: tests).
DENSE_IMPLS = ("auto", "xla", "triton")


@dataclasses.dataclass(frozen=True)
class BertConfig(FromDict):
    """Google's `bert_config.json` fields plus compute/parameter dtypes and layout switches."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"  # "gelu" = exact erf (released checkpoints); "gelu_tanh"; "relu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    dtype: str = "float32"  # compute dtype; "bfloat16" on TPU/GPU
    param_dtype: str = "float32"
    scan_layers: bool = False  # nn.scan over layers: faster compiles, stacked [layers, ...] params
    remat_policy: str = "none"  # one of REMAT_POLICIES
    # One of attention.ATTENTION_IMPLS; "auto" picks per backend when the model is traced.
    attention_impl: str = "auto"
    # One of DENSE_IMPLS: the layer's dense blocks on bertjax's Triton kernels (the FFN's GEMMs
    # with the activation in their epilogues, `feed_forward_gpu`; the dense outputs' bias,
    # dropout, residual and LayerNorm in one pass, `add_norm_gpu`) or on XLA's ops.
    dense_impl: str = "auto"
    # The MLM output projection runs on the vocabulary padded to a multiple of this (e.g. 128
    # for aligned GPU/TPU matmuls); parameters and logits keep vocab_size. 1 = no padding.
    vocab_pad_multiple: int = 1

    def __post_init__(self) -> None:
        check(dataclasses.asdict(self))

    @classmethod
    def from_json_file(cls, path: str) -> BertConfig:
        """Reads Google's `bert_config.json`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def resolved_attention_impl(self, backend: str | None = None) -> str:
        """The implementation training uses on `backend` (default: the target platform)."""
        return attention.resolve_impl(
            self.attention_impl,
            self.dtype,
            self.head_size,
            backend,
            self.attention_probs_dropout_prob,
        )


# Sizes a model needs at least 1 of.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "vocab_pad_multiple",
)


def check(values: Mapping[str, Any], prefix: str = "", flag: str = "") -> None:
    """Raises ValueError for the first of BertConfig's fields in `values` (absent ones at
    their defaults) that cannot build a model, in one line naming the field(s) and the fix.
    Names are written `{prefix}{field}` and the fix's setting `{flag}{prefix}{field}` (e.g.
    prefix "model.", flag "--config." for a pretraining config)."""
    fields = FieldChecks(BertConfig, values, prefix, flag)
    fields.sizes(SIZE_FIELDS)
    fields.heads_divide_hidden()
    fields.positive(("initializer_range", "layer_norm_eps"))
    fields.choices(
        (
            ("hidden_act", ACTIVATIONS),
            ("remat_policy", REMAT_POLICIES),
            ("attention_impl", attention.ATTENTION_IMPLS),
            ("dense_impl", DENSE_IMPLS),
            ("dtype", DTYPES),
            ("param_dtype", DTYPES),
        )
    )
