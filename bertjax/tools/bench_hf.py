"""The reference for `python -m bertjax.tools.bench --compare=hf`: Hugging Face `transformers`
`BertForPreTraining` (PyTorch, CPU) trained on the same config and batch.

Imported only when the comparison is asked for: torch and transformers are not bertjax
dependencies. The step is the library's standard use: the model's own MLM + NSP loss
(labels -100 outside the masked positions), global-norm clipping and `torch.optim.AdamW`.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import transformers

from bertjax.model import BertConfig

# bertjax activation name -> transformers' name for the same function.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def hf_config(config: BertConfig) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=HF_ACTIVATIONS[config.hidden_act],
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size, initializer_range=config.initializer_range,
        layer_norm_eps=config.layer_norm_eps)


def torch_batch(batch: dict[str, np.ndarray], vocab_size: int) -> dict[str, torch.Tensor]:
    """bertjax's batch features as `BertForPreTraining` keyword arguments."""
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    rows, slots = np.nonzero(batch["masked_lm_weights"] > 0)
    labels[rows, batch["masked_lm_positions"][rows, slots]] = batch["masked_lm_ids"][rows, slots]
    return {
        "input_ids": torch.from_numpy(batch["input_ids"].astype(np.int64)),
        "token_type_ids": torch.from_numpy(batch["segment_ids"].astype(np.int64)),
        "attention_mask": torch.from_numpy(batch["input_mask"].astype(np.int64)),
        "labels": torch.from_numpy(labels),
        "next_sentence_label": torch.from_numpy(batch["next_sentence_labels"].astype(np.int64)),
    }


class HFTrainer:
    """One fp32 training step of `BertForPreTraining` per `step()` call."""

    def __init__(self, config: BertConfig, batch: dict[str, np.ndarray], learning_rate: float,
                 weight_decay: float, eps: float, clip_global_norm: float):
        torch.manual_seed(0)
        self.model = transformers.BertForPreTraining(hf_config(config)).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=learning_rate,
                                           weight_decay=weight_decay, eps=eps)
        self.clip = clip_global_norm
        self.inputs = torch_batch(batch, config.vocab_size)

    def step(self) -> float:
        """Runs one step; returns its wall-clock seconds."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(**self.inputs).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        return time.perf_counter() - start

    @staticmethod
    def describe() -> dict[str, object]:
        return {"torch": torch.__version__, "transformers": transformers.__version__,
                "torch_threads": torch.get_num_threads()}
