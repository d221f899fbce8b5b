"""Fine-tuning's settings as one typed, frozen value, built once at the entry point
(`FinetuneSettings.of`, in `finetune.run`, after validate.finetuning has checked the ranges):
the config's own fields (configs/finetune/common.py, same names), what its task reads
(`tasks.features.TaskOptions`), where the model and tokenizer come from (`pretrained.Source`),
the optimizer section (completed per run: `optimizer_settings`) and the mesh. No ConfigDict
travels past `finetune.run`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from bertjax.errors import ConfigError
from bertjax.interop import pretrained
from bertjax.runtime import schema
from bertjax.runtime.schema import typed
from bertjax.tasks.features import TaskOptions
from bertjax.training import optim, validate
from bertjax.training.finetune_schema import FinetuneFields, NerFields
from bertjax.training.sharding import MeshSettings


@dataclasses.dataclass(frozen=True)
class FinetuneSettings:
    """A fine-tuning config, typed (`of`)."""

    kind: str  # "glue" | "ner" | "squad"
    task: str
    init_checkpoint: str
    random_init: bool
    max_seq_length: int
    train_batch_size: int
    eval_batch_size: int
    num_train_epochs: float
    learning_rate: float
    warmup_proportion: float
    log_every: int
    profile_steps: int  # steps of each seed traced by jax.profiler; 0 = none
    seeds: tuple[int, ...]
    classifier_pooling: str
    causal_attention: bool
    feature_based: bool
    source: pretrained.Source
    options: TaskOptions
    optimizer: Mapping[str, Any]  # config.optimizer
    mesh: MeshSettings  # config.mesh
    as_json: str  # the whole config: config.json, recorded in every checkpoint

    @classmethod
    def of(cls, values: Mapping[str, Any], as_json: str = "") -> FinetuneSettings:
        """The settings of a fine-tuning config's `values` (`as_json`: the config's own JSON,
        default: `values` as JSON); fields a task's config lacks (feature_based: NER's) take
        their default."""
        own = {
            name: values.get(name, _ADDED_SINCE[name]) if name in _ADDED_SINCE else values[name]
            for name in _OWN_FIELDS
        }
        return cls(
            **own,
            seeds=tuple(validate.seeds(values["seeds"])),
            source=typed(pretrained.Source, values, "", ConfigError, recorded=True),
            options=typed(TaskOptions, values, "", ConfigError, recorded=True),
            optimizer=dict(values["optimizer"]),
            mesh=MeshSettings.of(values["mesh"]),
            as_json=as_json or json.dumps(values),
        )

    @property
    def as_dict(self) -> dict[str, Any]:
        """The whole config as JSON values (summary.json's `config`)."""
        return json.loads(self.as_json)

    def optimizer_settings(self, total_steps: int) -> optim.OptimizerConfig:
        """The optimizer and learning-rate schedule of a run of `total_steps` steps."""
        return optim.optimizer_config(
            self.optimizer,
            total_steps,
            peak_learning_rate=self.learning_rate,
            warmup_steps=int(total_steps * self.warmup_proportion),
        )

    def train_steps(self, num_examples: int) -> int:
        """Optimizer steps as run_classifier.py and run_squad.py count them:
        `int(num_train_examples / train_batch_size * num_train_epochs)`."""
        return int(num_examples / self.train_batch_size * self.num_train_epochs)


# Fields some configs lack (feature_based: NER's; profile_steps: a config written before it),
# with the value they mean there: their schema's default.
_ADDED_SINCE = {
    name: {**schema.defaults(FinetuneFields), **schema.defaults(NerFields)}[name]
    for name in ("feature_based", "profile_steps")
}
_OWN_FIELDS = [
    f.name
    for f in dataclasses.fields(FinetuneSettings)
    if f.name not in ("seeds", "source", "options", "optimizer", "mesh", "as_json")
]
