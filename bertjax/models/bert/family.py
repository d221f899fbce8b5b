"""BERT as a model family (`families.Family`): BertForPreTraining (MLM + NSP heads), the
original's fine-tuning heads, Google TF and Hugging Face forms. Registered as "bert", the
family of every config and record that names none."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import flax.linen as nn
import jax

from bertjax.errors import ConfigError
from bertjax.interop import hf
from bertjax.interop.finetuned import HFHead
from bertjax.interop.pretrained import PretrainedError, Source
from bertjax.models import families
from bertjax.models.bert import config as bert_config, model as bert_model
from bertjax.models.bert.heads import (
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bertjax.models.bert.model import BertConfig, BertForPreTraining, BertModel
from bertjax.runtime import files
from bertjax.training import validate

if TYPE_CHECKING:  # (annotations only: these modules import the families)
    from bertjax.tasks.features import TaskOptions
    from bertjax.training.settings import TrainSettings


def forward(
    model: nn.Module,
    params: dict[str, Any],
    batch: Mapping[str, jax.Array],
    mask: jax.Array,
    deterministic: bool,
    rngs: dict[str, jax.Array] | None,
) -> tuple[jax.Array, jax.Array | None]:
    """`(mlm_logits, nsp_logits)` of BertForPreTraining (packed rows: with their
    positions, instance ids and [CLS] positions)."""
    logits = model.apply(
        {"params": params},
        batch["input_ids"],
        batch["segment_ids"],
        mask,
        batch["masked_lm_positions"],
        deterministic=deterministic,
        rngs=rngs,
        position_ids=batch.get("position_ids"),
        instance_ids=batch.get("instance_ids"),
        next_sentence_positions=batch.get("next_sentence_positions"),
    )
    return cast(tuple[jax.Array, jax.Array], logits)  # (flax types `apply` for `mutable` too)


def all_layers(
    model: nn.Module,
    params: dict[str, Any],
    input_ids: jax.Array,
    segment_ids: jax.Array,
    input_mask: jax.Array,
) -> jax.Array:
    stacked, _ = model.apply(
        {"params": params}, input_ids, segment_ids, input_mask, True, all_layers=True
    )
    return stacked


def flops(config: BertConfig, seq_length: int, predictions: int) -> int:
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


def check_pretraining(model: Mapping[str, Any], train: TrainSettings) -> None:
    """Pretraining needs two segment types (sentences A and B)."""
    if model["type_vocab_size"] < 2:
        raise ConfigError(
            f"model.type_vocab_size={model['type_vocab_size']} is out of range: "
            "pretraining needs 2 segment types (sentences A and B); set "
            "--config.model.type_vocab_size=2"
        )


def finetune_config(values: dict[str, Any], source: Source) -> BertConfig:
    """The checkpoint's architecture (or `source.model_config`'s bert_config.json), with the
    fine-tuning run's dropout and dtype."""
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


def finetune_problem(options: object, init_checkpoint: str) -> str | None:
    if getattr(options, "classifier_pooling", None):
        return (
            "classifier_pooling is ModernBERT's; init_checkpoint "
            f"{init_checkpoint} holds a BERT model (it pools with its "
            "pooler): unset --config.classifier_pooling"
        )
    return None


def sequence_head(model_config: BertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return BertForSequenceClassification(model_config, labels, options.causal_attention)


def tagging_head(model_config: BertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return BertForTokenClassification(
        model_config, labels, options.feature_based, options.lstm_size, options.causal_attention
    )


def span_head(model_config: BertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return BertForQuestionAnswering(model_config)


def recorded_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """Its architecture and storage fields (as before families: no `family`)."""
    return {
        name: model[name] for name in bert_model.ARCHITECTURE_FIELDS + bert_model.STORAGE_FIELDS
    }


def write_hf(
    config: BertConfig,
    params: dict[str, Any],
    path: str,
    head: HFHead | None = None,
    pad_token_id: int = 0,
) -> int:
    return hf.save_hf(config, params, path, head, pad_token_id=pad_token_id)


def describe(model_config: BertConfig) -> str:
    return hf.TO_HF_ACTIVATION[model_config.hidden_act]


FAMILY = families.register(
    families.Family(
        name="bert",
        title="BERT",
        configs="configs/tiny.py, configs/base.py or configs/large.py",
        config_class=BertConfig,
        check=bert_config.check,
        recorded_fields=recorded_fields,
        architecture=bert_model.architecture,
        pretraining_model=BertForPreTraining,
        encoder=BertModel,
        encoder_scope="bert",
        example_inputs=bert_model.example_inputs,
        forward=forward,
        all_layers=all_layers,
        heads={"classification": sequence_head, "tagging": tagging_head, "span": span_head},
        flops=flops,
        check_pretraining=check_pretraining,
        finetune_config=finetune_config,
        finetune_problem=finetune_problem,
        pretraining_rules=tuple(validate.BERT_DROPOUT),
        pretrained_parts=("bert",),
        records_family=False,
        probes=True,
        encoder_only=lambda params: "predictions" not in params,
        hf=families.HfForm(
            model_type="bert",
            read=hf.load_hf,
            config=hf.hf_config,
            write=write_hf,
            class_prefix="Bert",
            pretraining_class="BertForPreTraining",
            pretraining_heads="masked-LM and next-sentence heads",
            describe=describe,
        ),
    )
)
