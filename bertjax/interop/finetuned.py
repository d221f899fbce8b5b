"""A fine-tuned bertjax model as the `transformers` class of its task: GLUE ->
`BertForSequenceClassification` (`classifier`, label maps, `problem_type`), CoNLL-2003 NER ->
`BertForTokenClassification`, SQuAD -> `BertForQuestionAnswering` (`qa_outputs`). The output
layers are stored `[labels, hidden]`, as a torch Linear's weight; the pooler goes only where
the transformers class has one (sequence classification). A ModernBERT model gets the
`ModernBertFor...` class of its task, whose weights (`head`, `classifier`) are its own
parameters' names (`families.modernbert_hf` writes them)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from bertjax.interop.tree import ConversionError
from bertjax.tasks import glue_tasks, ner

if TYPE_CHECKING:
    from bertjax.models.families import HfForm


@dataclasses.dataclass(frozen=True)
class HFHead:
    """What a Hugging Face export of a fine-tuned model adds to the encoder's weights."""

    architecture: str  # the transformers class
    tensors: dict[str, np.ndarray]  # the output layer, by transformers' names
    config: dict[str, Any]  # config.json entries (label maps, problem_type)
    pooler: bool  # whether the class has BERT's pooler
    description: str  # for the model card


def encoder_only(form: HfForm) -> HFHead:
    """An encoder without pretraining or task heads (imported from a fine-tuned HF model): the
    family's `{prefix}Model`."""
    return HFHead(
        f"{form.class_prefix}Model",
        {},
        {},
        form.sequence_pooler,
        "the encoder only: no pretraining or task heads",
    )


def label_maps(labels: tuple[str, ...]) -> dict[str, Any]:
    return {
        "num_labels": len(labels),
        "id2label": {str(i): name for i, name in enumerate(labels)},
        "label2id": {name: i for i, name in enumerate(labels)},
    }


def _linear(prefix: str, output: dict[str, Any]) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.weight": np.asarray(output["output_weights"]),
        f"{prefix}.bias": np.asarray(output["output_bias"]),
    }


def hf_head(task_config: dict[str, Any], params: dict[str, Any], form: HfForm) -> HFHead:
    """The transformers form of the output layer in `params`, fine-tuned with `task_config`
    (the fine-tuning config a checkpoint recorded), in the model family's transformers `form`
    (its class names; BERT's output layers renamed, ModernBERT's written as they are)."""
    kind, task = task_config.get("kind"), task_config.get("task", "")
    family = form.class_prefix

    def linear(prefix: str, output: dict[str, Any]) -> dict[str, np.ndarray]:
        return _linear(prefix, output) if form.output_layer_names else {}

    if task_config.get("causal_attention"):
        raise ConversionError(
            "a left-to-right (causal_attention) model has no transformers "
            "BERT class (they attend both ways); convert --to=bertjax or tf"
        )
    if kind == "squad":
        return HFHead(
            f"{family}ForQuestionAnswering",
            linear("qa_outputs", params.get("cls", {}).get("squad")),
            {},
            False,
            "fine-tuned for SQuAD span prediction",
        )
    if kind == "ner":
        if task_config.get("feature_based"):
            raise ConversionError(
                "a feature-based tagger (a BiLSTM on the frozen encoder's "
                "last four layers) has no transformers class; convert "
                "--to=bertjax or tf"
            )
        return HFHead(
            f"{family}ForTokenClassification",
            linear("classifier", params),
            label_maps(ner.LABELS),
            False,
            "fine-tuned for CoNLL-2003 NER",
        )
    if kind == "glue":
        spec = glue_tasks.get_task(task)
        if spec.is_regression:
            config = {**label_maps(("score",)), "problem_type": "regression"}
        else:
            config = {**label_maps(spec.class_names), "problem_type": "single_label_classification"}
        return HFHead(
            f"{family}ForSequenceClassification",
            linear("classifier", params),
            config,
            form.sequence_pooler,
            f"fine-tuned on GLUE {spec.name}",
        )
    raise ConversionError(f"fine-tuning kind {kind!r} has no Hugging Face form here")
