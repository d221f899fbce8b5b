"""ModernBERT as a model family (`families.Family`): ModernBertForMaskedLM (MLM only, no
segments), transformers' ModernBertFor... heads and its Hugging Face form. Registered as
"modernbert"; its records name the family."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, cast

import flax.linen as nn
import jax
from jax.typing import ArrayLike

from bertjax.data import batch as batch_spec
from bertjax.errors import ConfigError
from bertjax.families import modernbert_hf
from bertjax.interop import hf, tree
from bertjax.interop.pretrained import PretrainedError
from bertjax.models import families
from bertjax.models.bert import model as bert_model
from bertjax.models.layers import losses
from bertjax.models.modernbert import config as modernbert_config, model as modernbert
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.models.modernbert.heads import (
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertForTokenClassification,
)


class ModernBertFamily(families.Family[ModernBertConfig]):
    """ModernBERT: ModernBertForMaskedLM (MLM only, no segments), transformers'
    ModernBertFor... heads and its Hugging Face form."""

    name = "modernbert"
    title = "ModernBERT"
    configs = (
        "configs/modernbert_tiny.py, configs/modernbert_base.py or configs/modernbert_large.py"
    )
    config_class = ModernBertConfig
    encoder_scope = "model"
    pretrained_parts = ("model", "head")
    optional_parts = ("head",)
    token_type_ids = False
    tokenizer_pad = True
    hf = modernbert_hf.ModernBertHf()

    def check(self, values: Mapping[str, Any], prefix: str, flag: str) -> None:
        modernbert_config.check(values, prefix, flag)

    def recorded_fields(self, config: ModernBertConfig) -> dict[str, Any]:
        """The family, its architecture and the padding id (what an export's embeddings
        name)."""
        return {
            "family": "modernbert",
            **modernbert_config.architecture(config),
            "pad_token_id": config.pad_token_id,
            "param_dtype": config.param_dtype,
        }

    def architecture(self, config: ModernBertConfig) -> dict[str, Any]:
        return modernbert_config.architecture(config)

    def pretraining_model(self, config: ModernBertConfig) -> nn.Module:
        return modernbert.ModernBertForMaskedLM(config)

    def encoder(self, config: ModernBertConfig) -> nn.Module:
        return modernbert.ModernBertModel(config)

    def example_inputs(self, model: nn.Module) -> tuple:
        """The pretraining model's and the encoder's; the heads take BERT's (their call
        signature is BERT's heads')."""
        if not isinstance(model, (modernbert.ModernBertForMaskedLM, modernbert.ModernBertModel)):
            return bert_model.example_inputs(model)
        # (128 tokens where the model allows them: TPU's Pallas kernel, which "auto" picks for
        # this family's dropout-free attention, takes multiples of 128 only)
        return modernbert.example_inputs(min(128, model.config.max_position_embeddings))

    def forward(
        self,
        model: nn.Module,
        params: families.Params,
        batch: Mapping[str, jax.Array],
        mask: jax.Array,
        deterministic: bool,
        rngs: dict[str, Any] | None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """`(mlm_logits, None)` of ModernBertForMaskedLM (no segments, no NSP head)."""
        packed: dict[str, Any] = {
            name: batch[name] for name in batch_spec.PACKED_INPUTS[:2] if name in batch
        }
        mlm_logits = model.apply(
            {"params": params},
            batch["input_ids"],
            mask,
            batch["masked_lm_positions"],
            deterministic=deterministic,
            rngs=rngs,
            **packed,
        )
        return cast(jax.Array, mlm_logits), None

    def pretraining_loss(
        self,
        outputs: tuple[jax.Array, jax.Array | None],
        batch: Mapping[str, jax.Array],
        denominators: Mapping[str, Any] | None = None,
        next_sentence_prediction: bool = False,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The masked LM's alone (no next-sentence head)."""
        denominators = denominators or self.loss_denominators(batch)
        return losses.masked_lm_only(outputs[0], batch, denominators["mlm_weights"])

    def all_layers(
        self,
        encoder: nn.Module,
        params: families.Params,
        input_ids: ArrayLike,
        segment_ids: ArrayLike,
        input_mask: ArrayLike,
    ) -> jax.Array:
        del segment_ids  # (no segment embeddings)
        stacked = encoder.apply({"params": params}, input_ids, input_mask, True, all_layers=True)
        return cast(jax.Array, stacked)

    def head(
        self, kind: str, config: ModernBertConfig, num_labels: int, options: families.HeadOptions
    ) -> nn.Module:
        if kind == "classification":
            return ModernBertForSequenceClassification(config, num_labels)
        if kind == "tagging":
            return ModernBertForTokenClassification(config, num_labels)
        return ModernBertForQuestionAnswering(config)

    def flops(self, config: ModernBertConfig, seq_length: int, predictions: int) -> int:
        """`6*S*L*(4H^2 + 3HI) + 12*H*S*sum(keys per query over layers) + 6*P*(H^2 + HV)`:
        the GeGLU's three H x I matmuls, a sliding-window layer's queries seeing at most
        `2 * (local_attention // 2) + 1` keys, no pooler or NSP."""
        s, layers, h = seq_length, config.num_hidden_layers, config.hidden_size
        i, v, p = config.intermediate_size, config.vocab_size, predictions
        window = min(s, 2 * (config.local_attention // 2) + 1)
        keys = sum(s if config.is_global(layer) else window for layer in range(layers))
        return (
            6 * s * layers * (4 * h * h + 3 * h * i) + 12 * h * s * keys + 6 * p * (h * h + h * v)
        )

    def check_pretraining(
        self, config: ModernBertConfig, objective: str, next_sentence_prediction: bool
    ) -> None:
        """What a ModernBERT pretraining run cannot have: an NSP head, a left-to-right
        objective."""
        if next_sentence_prediction:
            raise ConfigError(
                "model.family='modernbert' has no next-sentence head; set "
                "--config.train.next_sentence_prediction=False"
            )
        if objective != "mlm":
            raise ConfigError(
                f"model.family='modernbert' trains objective 'mlm' only, not "
                f"{objective!r}; set --config.train.objective=mlm"
            )

    def finetune_config(
        self, values: dict[str, Any], source: families.FinetuneSource
    ) -> ModernBertConfig:
        """The checkpoint's config with the run's dtype; it keeps its own dropout rates (as
        transformers fine-tunes it), and pools as `source.classifier_pooling` says, if set."""
        values.update(dtype=source.dtype, remat_policy="none")
        if source.classifier_pooling:
            if source.classifier_pooling not in modernbert_config.POOLINGS:
                flag = source.vocab_flag.replace("vocab_file", "classifier_pooling")
                raise PretrainedError(
                    f"classifier_pooling={source.classifier_pooling!r} is not "
                    f"one of {', '.join(map(repr, modernbert_config.POOLINGS))}"
                    f"; set {flag}"
                )
            values["classifier_pooling"] = source.classifier_pooling
        try:
            return ModernBertConfig.from_dict(values)
        except ValueError as e:
            raise PretrainedError(
                f"the model of init_checkpoint {source.init_checkpoint}: {e}"
            ) from e

    def finetune_problem(self, options: object, init_checkpoint: str) -> str | None:
        """The BERT-only fine-tuning options, refused."""
        for field in ("causal_attention", "feature_based"):
            if getattr(options, field, False):
                return (
                    f"{field}=True is for BERT models; init_checkpoint "
                    f"{init_checkpoint} holds a ModernBERT model: set "
                    f"--config.{field}=False"
                )
        return None

    def check_export(
        self,
        config: ModernBertConfig,
        params: dict[str, Any],
        src: str,
        source_format: str,
        target: str,
        scan_layers: bool,
    ) -> None:
        """No TF form, no scanned layers; a fine-tuned or bare transformers model is read as
        an init_checkpoint only."""
        if target == "tf" or scan_layers:
            raise tree.ConversionError(
                f"{src} holds a ModernBERT model, which has no TF "
                "form and no scanned layers: pass --to=hf or --to=bertjax"
                ", without --scan_layers"
            )
        if source_format == "hf":
            task = hf.finetuned_task(src)
            if task or "head" not in params:
                kind = (
                    f"a fine-tuned ModernBERT ({task})"
                    if "head" in params
                    else "a bare ModernBertModel (no MLM head)"
                )
                raise tree.ConversionError(
                    f"{src} is {kind}: bertjax reads its encoder as "
                    "a fine-tuning init_checkpoint, but does not convert "
                    "it; use it as --config.init_checkpoint"
                )

    def pad_id(self, config: ModernBertConfig) -> int | None:
        return config.pad_token_id

    def with_pad_id(self, config: ModernBertConfig, pad_id: int) -> ModernBertConfig:
        return dataclasses.replace(config, pad_token_id=pad_id)


FAMILY = families.register(ModernBertFamily())
