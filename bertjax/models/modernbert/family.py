"""ModernBERT as a model family (`families.Family`): ModernBertForMaskedLM (MLM only, no
segments), transformers' ModernBertFor... heads and its Hugging Face form. Registered as
"modernbert"; its records name the family."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import flax.linen as nn
import jax

from bertjax.errors import ConfigError
from bertjax.interop import hf, hf_modernbert, tree
from bertjax.interop.finetuned import HFHead
from bertjax.interop.hf import TO_HF_ACTIVATION
from bertjax.interop.pretrained import PretrainedError, Source
from bertjax.models import families
from bertjax.models.bert import model as bert_model
from bertjax.models.modernbert import config as modernbert_config, model as modernbert
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.models.modernbert.heads import (
    ModernBertForQuestionAnswering,
    ModernBertForSequenceClassification,
    ModernBertForTokenClassification,
)

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
    """`(mlm_logits, None)` of ModernBertForMaskedLM (no segments, no NSP head)."""
    logits = model.apply(
        {"params": params},
        batch["input_ids"],
        mask,
        batch["masked_lm_positions"],
        deterministic=deterministic,
        rngs=rngs,
        position_ids=batch.get("position_ids"),
        instance_ids=batch.get("instance_ids"),
    )
    return cast(jax.Array, logits), None  # (flax types `apply` for `mutable` too)


def all_layers(
    model: nn.Module,
    params: dict[str, Any],
    input_ids: jax.Array,
    segment_ids: jax.Array,
    input_mask: jax.Array,
) -> jax.Array:
    del segment_ids  # (no segment embeddings)
    layers = model.apply({"params": params}, input_ids, input_mask, True, all_layers=True)
    return cast(jax.Array, layers)  # (flax types `apply` for `mutable` too)


def example_inputs(model: nn.Module) -> tuple:
    """The pretraining model's and the encoder's; the heads take BERT's (their call signature
    is BERT's heads')."""
    if not isinstance(model, (modernbert.ModernBertForMaskedLM, modernbert.ModernBertModel)):
        return bert_model.example_inputs(model)
    # (128 tokens where the model allows them: TPU's Pallas kernel, which "auto" picks for
    # this family's dropout-free attention, takes multiples of 128 only)
    return modernbert.example_inputs(min(128, model.config.max_position_embeddings))


def flops(config: ModernBertConfig, seq_length: int, predictions: int) -> int:
    """`6*S*L*(4H^2 + 3HI) + 12*H*S*sum(keys per query over layers) + 6*P*(H^2 + HV)`: the
    GeGLU's three H x I matmuls, a sliding-window layer's queries seeing at most
    `2 * (local_attention // 2) + 1` keys, no pooler or NSP."""
    s, layers, h = seq_length, config.num_hidden_layers, config.hidden_size
    i, v, p = config.intermediate_size, config.vocab_size, predictions
    window = min(s, 2 * (config.local_attention // 2) + 1)
    keys = sum(s if config.is_global(layer) else window for layer in range(layers))
    return 6 * s * layers * (4 * h * h + 3 * h * i) + 12 * h * s * keys + 6 * p * (h * h + h * v)


def check_pretraining(model: Mapping[str, Any], train: TrainSettings) -> None:
    """What a ModernBERT pretraining run cannot have: an NSP head, a left-to-right
    objective."""
    if train.next_sentence_prediction:
        raise ConfigError(
            "model.family='modernbert' has no next-sentence head; set "
            "--config.train.next_sentence_prediction=False"
        )
    if train.objective != "mlm":
        raise ConfigError(
            f"model.family='modernbert' trains objective 'mlm' only, not "
            f"{train.objective!r}; set --config.train.objective=mlm"
        )


def finetune_config(values: dict[str, Any], source: Source) -> ModernBertConfig:
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
        raise PretrainedError(f"the model of init_checkpoint {source.init_checkpoint}: {e}") from e


def finetune_problem(options: object, init_checkpoint: str) -> str | None:
    """The BERT-only fine-tuning options, refused."""
    for field in ("causal_attention", "feature_based"):
        if getattr(options, field, False):
            return (
                f"{field}=True is for BERT models; init_checkpoint "
                f"{init_checkpoint} holds a ModernBERT model: set "
                f"--config.{field}=False"
            )
    return None


def sequence_head(model_config: ModernBertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return ModernBertForSequenceClassification(model_config, labels)


def tagging_head(model_config: ModernBertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return ModernBertForTokenClassification(model_config, labels)


def span_head(model_config: ModernBertConfig, labels: int, options: TaskOptions) -> nn.Module:
    return ModernBertForQuestionAnswering(model_config)


def recorded_fields(model: Mapping[str, Any]) -> dict[str, Any]:
    """The family, its architecture and the padding id (what an export's embeddings name)."""
    config = families.model_config(model)
    return {
        "family": "modernbert",
        **modernbert_config.architecture(config),
        "pad_token_id": config.pad_token_id,
        "param_dtype": config.param_dtype,
    }


def check_export(
    model_config: ModernBertConfig,
    params: dict[str, Any],
    src: str,
    source_format: str,
    target: str,
    scan_layers: bool,
) -> None:
    """No TF form, no scanned layers; a fine-tuned or bare transformers model is read as an
    init_checkpoint only."""
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


def write_hf(
    config: ModernBertConfig,
    params: dict[str, Any],
    path: str,
    head: HFHead | None = None,
    pad_token_id: int = 0,
) -> int:
    del pad_token_id  # (its config's own)
    return hf_modernbert.save_hf(config, params, path, head)


def describe(config: ModernBertConfig) -> str:
    return (
        f"GeGLU ({TO_HF_ACTIVATION[config.hidden_activation]}), global attention every "
        f"{config.global_attn_every_n_layers} layers, sliding windows of "
        f"{config.local_attention} tokens between"
    )


FAMILY = families.register(
    families.Family(
        name="modernbert",
        title="ModernBERT",
        configs="configs/modernbert_tiny.py, configs/modernbert_base.py or "
        "configs/modernbert_large.py",
        config_class=ModernBertConfig,
        check=modernbert_config.check,
        recorded_fields=recorded_fields,
        architecture=modernbert_config.architecture,
        pretraining_model=modernbert.ModernBertForMaskedLM,
        encoder=modernbert.ModernBertModel,
        encoder_scope="model",
        example_inputs=example_inputs,
        forward=forward,
        all_layers=all_layers,
        heads={"classification": sequence_head, "tagging": tagging_head, "span": span_head},
        flops=flops,
        check_pretraining=check_pretraining,
        finetune_config=finetune_config,
        finetune_problem=finetune_problem,
        pretrained_parts=("model", "head"),
        optional_parts=("head",),
        token_type_ids=False,
        tokenizer_pad=True,
        check_export=check_export,
        hf=families.HfForm(
            model_type="modernbert",
            read=hf_modernbert.load_hf,
            config=hf_modernbert.hf_config,
            write=write_hf,
            class_prefix="ModernBert",
            pretraining_class="ModernBertForMaskedLM",
            pretraining_heads="masked-LM head",
            describe=describe,
            output_layer_names=False,
            sequence_pooler=False,
        ),
    )
)
