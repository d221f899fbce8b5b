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
from bertjax.models.bert.model import BertConfig, BertMaskedLMHead, BertModel
from bertjax.models.layers import losses
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


class ToyFamily(bert_family.BertFamily):
    """BERT's adapter with the toy's name, config class and model: no NSP head, no
    transformers form, no probes."""

    name = "toy"
    title = "Toy"
    configs = "tests/toy_family.py"
    config_class = ToyConfig
    records_family = True
    probes = False
    hf = None

    def pretraining_model(self, config: ToyConfig) -> nn.Module:
        return ToyForMaskedLM(config)

    def example_inputs(self, model: nn.Module) -> tuple:
        inputs = super().example_inputs(model)
        extra = (jnp.zeros((1, 2), jnp.int32),) if isinstance(model, ToyForMaskedLM) else ()
        return inputs + extra

    def recorded_fields(self, config: ToyConfig) -> dict[str, Any]:
        return {"family": "toy", **super().recorded_fields(config)}

    def forward(self, model, params, batch, mask, deterministic, rngs) -> tuple[jax.Array, None]:
        return super().forward(model, params, batch, mask, deterministic, rngs), None

    def pretraining_loss(self, outputs, batch, denominators=None, next_sentence_prediction=False):
        """The masked LM's alone (no next-sentence head)."""
        denominators = denominators or self.loss_denominators(batch)
        return losses.masked_lm_only(outputs[0], batch, denominators["mlm_weights"])

    def flops(self, config: ToyConfig, seq_length: int, predictions: int) -> int:
        h = config.hidden_size
        return super().flops(config, seq_length, predictions) - 6 * (h * h + 2 * h)

    def check_pretraining(
        self, config: ToyConfig, objective: str, next_sentence_prediction: bool
    ) -> None:
        super().check_pretraining(config, objective, next_sentence_prediction)
        if next_sentence_prediction:
            raise ConfigError(
                "model.family='toy' has no next-sentence head; set "
                "--config.train.next_sentence_prediction=False"
            )

    def finetune_config(self, values: dict[str, Any], source: Any) -> ToyConfig:
        return ToyConfig(**dataclasses.asdict(super().finetune_config(values, source)))

    def encoder_only(self, params: dict[str, Any]) -> bool:
        return False


FAMILY = ToyFamily()
