"""A third model family, defined here in tests/ only: "toy", BERT without its next-sentence
head under another name. It plugs into bertjax through `families.Family` alone (the test
registers it), to show that shared code needs no edit for a new family."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.errors import ConfigError
from bertjax.families import bert as bert_family
from bertjax.models.bert import model as bert_model
from bertjax.models.bert.model import BertConfig, BertMaskedLMHead, BertModel
from bertjax.models.layers.gather import gather_positions


@dataclasses.dataclass(frozen=True)
class ToyConfig(BertConfig):
    """BERT's fields; its own class, so that `families.of` tells it apart."""


class ToyForMaskedLM(nn.Module):
    """BERT's encoder and masked-LM head, no pooler output used, no NSP head."""

    config: ToyConfig

    def setup(self):
        self.bert = BertModel(self.config)
        self.predictions = BertMaskedLMHead(self.config)

    def __call__(
        self,
        input_ids,
        token_type_ids,
        attention_mask,
        masked_lm_positions,
        deterministic: bool = True,
        **packed,
    ):
        sequence_BxLxH, _ = self.bert(
            input_ids, token_type_ids, attention_mask, deterministic, **packed
        )
        return self.predictions(
            gather_positions(sequence_BxLxH, masked_lm_positions),
            self.bert.embeddings.word_embeddings,
        )


def forward(model, params, batch, mask, deterministic, rngs) -> tuple[jax.Array, None]:
    return bert_family.forward(model, params, batch, mask, deterministic, rngs), None


def example_inputs(model: nn.Module) -> tuple:
    inputs = bert_model.example_inputs(model)
    return inputs + (jnp.zeros((1, 2), jnp.int32),) if isinstance(model, ToyForMaskedLM) else inputs


def flops(model_config: ToyConfig, seq_length: int, predictions: int) -> int:
    h = model_config.hidden_size
    return bert_family.flops(model_config, seq_length, predictions) - 6 * (h * h + 2 * h)


def check_pretraining(model: Any, train: Any) -> None:
    bert_family.check_pretraining(model, train)
    if train.next_sentence_prediction:
        raise ConfigError(
            "model.family='toy' has no next-sentence head; set "
            "--config.train.next_sentence_prediction=False"
        )


def finetune_config(values: dict[str, Any], source: Any) -> ToyConfig:
    bert = bert_family.finetune_config(values, source)
    return ToyConfig(**dataclasses.asdict(bert))


FAMILY = dataclasses.replace(
    bert_family.FAMILY,
    name="toy",
    title="Toy",
    configs="tests/toy_family.py",
    config_class=ToyConfig,
    pretraining_model=ToyForMaskedLM,
    example_inputs=example_inputs,
    recorded_fields=lambda model: {"family": "toy", **bert_family.recorded_fields(model)},
    forward=forward,
    flops=flops,
    check_pretraining=check_pretraining,
    finetune_config=finetune_config,
    records_family=True,
    probes=False,
    encoder_only=lambda params: False,
    hf=None,
)
