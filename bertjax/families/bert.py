"""BERT as a model family (`families.Family`): BertForPreTraining (MLM + NSP heads), the
original's fine-tuning heads, Google TF and Hugging Face forms. Registered as "bert", the
family of every config and record that names none."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from bertjax.data import batch as batch_spec
from bertjax.errors import ConfigError
from bertjax.families import bert_hf, bert_tf
from bertjax.interop.pretrained import PretrainedError
from bertjax.models import families
from bertjax.models.bert import config as bert_config, model as bert_model
from bertjax.models.bert.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertjax.models.bert.model import BertConfig, BertForPreTraining, BertModel
from bertjax.models.layers import losses
from bertjax.runtime import files
from bertjax.training import validate


def next_sentences(batch: Mapping[str, jax.Array]) -> jax.Array | int:
    """Next-sentence predictions in `batch`: one per row, or per packed instance."""
    if "next_sentence_weights" in batch:
        return jnp.sum(batch["next_sentence_weights"].astype(jnp.float32))
    return batch["next_sentence_labels"].shape[0]


class BertFamily(families.Family[BertConfig]):
    """BERT: BertForPreTraining (MLM + NSP), the original's fine-tuning heads, its Google TF
    and Hugging Face forms."""

    name = "bert"
    title = "BERT"
    configs = "configs/tiny.py, configs/base.py or configs/large.py"
    config_class = BertConfig
    encoder_scope = "bert"
    pretraining_rules = tuple(validate.BERT_DROPOUT)
    pretrained_parts = ("bert",)
    records_family = False
    probes = True
    hf = bert_hf.BertHf()
    tf = bert_tf.BertTf()

    def check(self, values: Mapping[str, Any], prefix: str, flag: str) -> None:
        bert_config.check(values, prefix, flag)

    def recorded_fields(self, config: BertConfig) -> dict[str, Any]:
        """Its architecture and storage fields (as before families: no `family`)."""
        fields = bert_model.ARCHITECTURE_FIELDS + bert_model.STORAGE_FIELDS
        return {name: getattr(config, name) for name in fields}

    def architecture(self, config: BertConfig) -> dict[str, Any]:
        return bert_model.architecture(config)

    def pretraining_model(self, config: BertConfig) -> nn.Module:
        return BertForPreTraining(config)

    def encoder(self, config: BertConfig) -> nn.Module:
        return BertModel(config)

    def example_inputs(self, model: nn.Module) -> tuple:
        return bert_model.example_inputs(model)

    def forward(
        self,
        model: nn.Module,
        params: families.Params,
        batch: Mapping[str, jax.Array],
        mask: jax.Array,
        deterministic: bool,
        rngs: dict[str, Any] | None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """`(mlm_logits, nsp_logits)` of BertForPreTraining."""
        packed: dict[str, Any] = {
            name: batch[name] for name in batch_spec.PACKED_INPUTS if name in batch
        }
        outputs = model.apply(
            {"params": params},
            batch["input_ids"],
            batch["segment_ids"],
            mask,
            batch["masked_lm_positions"],
            deterministic=deterministic,
            rngs=rngs,
            **packed,
        )
        return cast(tuple[jax.Array, jax.Array], outputs)

    def pretraining_loss(
        self,
        outputs: tuple[jax.Array, jax.Array | None],
        batch: Mapping[str, jax.Array],
        denominators: Mapping[str, Any] | None = None,
        next_sentence_prediction: bool = True,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """MLM + NSP as in the original; without `next_sentence_prediction` the MLM's alone,
        the NSP sums 0. Packed rows have `[B, K, 2]` NSP logits and `next_sentence_weights`
        (0 for empty slots)."""
        mlm_logits_BxPxV, nsp_logits_Bx2 = outputs
        if nsp_logits_Bx2 is None:
            raise TypeError("BertForPreTraining gives next-sentence logits")
        denominators = denominators or self.loss_denominators(batch)
        mlm_loss, sums = losses.masked_lm(mlm_logits_BxPxV, batch, denominators["mlm_weights"])
        nsp_weight = 1.0 if next_sentence_prediction else 0.0
        nsp_nll_B = nsp_weight * losses.nll(nsp_logits_Bx2, batch["next_sentence_labels"])
        nsp_weights_B = batch.get("next_sentence_weights", jnp.ones_like(nsp_nll_B))
        nsp_loss_sum = jnp.sum(nsp_weights_B * nsp_nll_B)
        nsp_correct = jnp.argmax(nsp_logits_Bx2, axis=-1) == batch["next_sentence_labels"]
        return mlm_loss + nsp_loss_sum / denominators["sequences"], {
            **sums,
            "nsp_loss_sum": nsp_loss_sum,
            "nsp_correct_sum": nsp_weight * jnp.sum(nsp_weights_B * nsp_correct),
            "nsp_count": jnp.float32(nsp_weight * next_sentences(batch)),
        }

    def loss_denominators(self, batch: Mapping[str, jax.Array]) -> dict[str, Any]:
        """Its masked-LM weights and next-sentence predictions."""
        return {**super().loss_denominators(batch), "sequences": next_sentences(batch)}

    def all_layers(
        self,
        encoder: nn.Module,
        params: families.Params,
        input_ids: ArrayLike,
        segment_ids: ArrayLike,
        input_mask: ArrayLike,
    ) -> jax.Array:
        stacked, _ = encoder.apply(
            {"params": params}, input_ids, segment_ids, input_mask, True, all_layers=True
        )
        return cast(jax.Array, stacked)

    def head(
        self, kind: str, config: BertConfig, num_labels: int, options: families.HeadOptions
    ) -> nn.Module:
        if kind == "classification":
            return BertForSequenceClassification(config, num_labels, options.causal_attention)
        if kind == "tagging":
            return BertForTokenClassification(
                config,
                num_labels,
                options.feature_based,
                options.lstm_size,
                options.causal_attention,
            )
        return BertForQuestionAnswering(config)

    def flops(self, config: BertConfig, seq_length: int, predictions: int) -> int:
        """`6*S*L*(4H^2 + 2HI) + 12*L*H*S^2 + 6*P*(H^2 + HV) + 6*(H^2 + 2H)`: the encoder's
        matmuls, attention scores and values, the MLM head (transform + tied vocabulary
        projection) at P positions, and pooler + NSP (`flops.train_flops_per_sequence`)."""
        s, layers, h = seq_length, config.num_hidden_layers, config.hidden_size
        i, v, p = config.intermediate_size, config.vocab_size, predictions
        return (
            6 * s * layers * (4 * h * h + 2 * h * i)
            + 12 * layers * h * s * s
            + 6 * p * (h * h + h * v)
            + 6 * (h * h + 2 * h)
        )

    def check_pretraining(
        self, config: BertConfig, objective: str, next_sentence_prediction: bool
    ) -> None:
        """Pretraining needs two segment types (sentences A and B)."""
        if config.type_vocab_size < 2:
            raise ConfigError(
                f"model.type_vocab_size={config.type_vocab_size} is out of range: "
                "pretraining needs 2 segment types (sentences A and B); set "
                "--config.model.type_vocab_size=2"
            )

    def finetune_config(
        self, values: dict[str, Any], source: families.FinetuneSource
    ) -> BertConfig:
        """The checkpoint's architecture (or `source.model_config`'s bert_config.json), with
        the fine-tuning run's dropout and dtype."""
        if source.model_config:
            with files.open(source.model_config, encoding="utf-8") as f:
                values.update(json.load(f))
        if not values:
            raise PretrainedError(
                "set --config.init_checkpoint (a bertjax run, a Google TF or a "
                "Hugging Face checkpoint) or --config.model_config (a "
                "bert_config.json) to define the model"
            )
        values.update(
            dtype=source.dtype,
            scan_layers=values.get("scan_layers", False),
            hidden_dropout_prob=source.hidden_dropout_prob,
            attention_probs_dropout_prob=source.attention_probs_dropout_prob,
        )
        try:
            return BertConfig.from_dict(values)
        except ValueError as e:  # (its fields name the file's keys)
            where = (
                f"model_config {source.model_config}"
                if source.model_config
                else f"the model of init_checkpoint {source.init_checkpoint}"
            )
            raise PretrainedError(f"{where}: {e}") from e

    def finetune_problem(self, options: object, init_checkpoint: str) -> str | None:
        if getattr(options, "classifier_pooling", None):
            return (
                "classifier_pooling is ModernBERT's; init_checkpoint "
                f"{init_checkpoint} holds a BERT model (it pools with its "
                "pooler): unset --config.classifier_pooling"
            )
        return None

    def encoder_only(self, params: dict[str, Any]) -> bool:
        return "predictions" not in params

    def scanned(self, config: BertConfig) -> bool:
        return config.scan_layers

    def with_scanned(self, config: BertConfig, scanned: bool) -> BertConfig:
        return dataclasses.replace(config, scan_layers=scanned)


FAMILY = families.register(BertFamily())
