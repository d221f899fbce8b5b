"""The reference for `python -m bertjax.tools.bench --compare=hf`: Hugging Face `transformers`
`BertForPreTraining` (PyTorch) trained on the same config and batch.

Imported only when the comparison is asked for: torch and transformers are not bertjax
dependencies. The step is the library's standard use: the model's own MLM + NSP loss
(labels -100 outside the masked positions), global-norm clipping and `torch.optim.AdamW`.
On a GPU it is what a user gets in a few lines: SDPA attention, bf16 autocast when the
config computes in bf16, fused AdamW, and optionally `torch.compile` of the model.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import transformers

from bertjax.models.bert.model import BertConfig

# bertjax activation name -> transformers' name for the same function.
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def hf_config(config: BertConfig) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size,
        hidden_act=HF_ACTIVATIONS[config.hidden_act],
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size,
        initializer_range=config.initializer_range,
        layer_norm_eps=config.layer_norm_eps,
        attn_implementation="sdpa",
    )


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
    """One training step of `BertForPreTraining` per `step()` call, on `device` ("cpu" or
    "cuda"); `compile=True` runs the model through `torch.compile`."""

    def __init__(
        self,
        config: BertConfig,
        batch: dict[str, np.ndarray],
        learning_rate: float,
        weight_decay: float,
        eps: float,
        clip_global_norm: float,
        device: str = "cpu",
        compile: bool = False,
    ) -> None:
        torch.manual_seed(0)
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        self.model = transformers.BertForPreTraining(hf_config(config)).to(self.device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=learning_rate,
            weight_decay=weight_decay,
            eps=eps,
            fused=on_gpu,
        )
        self.forward = torch.compile(self.model) if compile else self.model
        self.autocast_dtype = torch.bfloat16 if on_gpu and config.dtype == "bfloat16" else None
        self.compiled = compile
        self.clip = clip_global_norm
        self.inputs = {
            k: v.to(self.device) for k, v in torch_batch(batch, config.vocab_size).items()
        }

    def step(self) -> float:
        """Runs one step to completion; returns its wall-clock seconds."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            loss = self.forward(**self.inputs).loss
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def describe(self) -> dict[str, object]:
        return {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": str(self.device),
            "autocast": str(self.autocast_dtype),
            "torch_compile": self.compiled,
            "attention": "sdpa",
            "fused_adamw": self.device.type == "cuda",
        }
