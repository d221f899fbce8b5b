"""What a fine-tuning run builds from its settings before the first step, each checked there:
the model against the pretraining run and the tokenizer, the mesh against the batch sizes, the
task (TASK_KINDS) and its splits, the optimizer and the trainer. FinetuneError says what to
change."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import optax
from absl import logging
from jax.sharding import Mesh

from bertjax.data.tokenization import Tokenizer
from bertjax.errors import ConfigError, UserError
from bertjax.interop import pretrained, pretrained_weights
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.tasks import features, glue, ner, squad_predict
from bertjax.training import finetune_trainer, optim, param_masks, schedules, sharded_run, sharding
from bertjax.training.finetune_settings import FinetuneSettings


class FinetuneError(UserError, ValueError):
    """A configuration or input that cannot run; the message says what to change."""


TASK_KINDS: dict[str, Callable[[features.TaskOptions, Tokenizer], features.Finetune]] = {
    "glue": glue.GlueFinetune,
    "ner": ner.NerFinetune,
    "squad": squad_predict.SquadFinetune,
}


def check_model(
    settings: FinetuneSettings, pretrain: pretrained.PretrainingRun, model_config: ModelConfig
) -> None:
    """Refuses a model whose weights would not fit init_checkpoint's (before any work), or
    that its family cannot fine-tune with these settings."""
    if pretrain.model and not settings.random_init:
        found = families.from_record(pretrain.model)
        pretrained_weights.check_architecture(found, model_config, settings.init_checkpoint)
    problem = families.of(model_config).finetune_problem(settings, settings.init_checkpoint)
    if problem:
        raise FinetuneError(problem)


def check_tokenizer(
    settings: FinetuneSettings, tokenizer: Tokenizer, model_config: ModelConfig
) -> None:
    """Refuses a tokenizer with more tokens than the model, or rows longer than its positions."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise FinetuneError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model "
            f"{model_config.vocab_size}: use the pretraining run's vocabulary"
        )
    if settings.max_seq_length > model_config.max_position_embeddings:
        raise FinetuneError(
            f"max_seq_length={settings.max_seq_length} > the model's "
            f"max_position_embeddings={model_config.max_position_embeddings}"
        )


def make_mesh(settings: FinetuneSettings, devices: list[jax.Device] | None) -> Mesh:
    """The run's mesh, on which both batch sizes divide evenly."""
    try:
        mesh = sharded_run.make_mesh(settings.mesh, devices)
    except ConfigError as e:
        raise FinetuneError(str(e)) from e
    for size in (settings.train_batch_size, settings.eval_batch_size):
        if size % (sharding.data_parallel_size(mesh) * jax.process_count()):
            raise FinetuneError(
                f"batch size {size} must be divisible by data*fsdp="
                f"{sharding.data_parallel_size(mesh)} times the process count"
            )
    return mesh


def make_task(settings: FinetuneSettings, tokenizer: Tokenizer) -> features.Finetune:
    if settings.kind not in TASK_KINDS:
        raise FinetuneError(f"kind={settings.kind!r}; choose one of {sorted(TASK_KINDS)}")
    try:
        return TASK_KINDS[settings.kind](settings.options, tokenizer)
    except ValueError as e:
        raise FinetuneError(str(e)) from e


def load_splits(task: features.Finetune) -> dict[str, features.SplitData]:
    """The training split, the dev splits and those test splits that are there."""
    try:
        data = {name: task.load(name) for name in ["train", *task.eval_splits]}
        for name in task.test_splits:  # unlabelled leaderboard inputs are optional
            try:
                data[name] = task.load(name)
            except (features.TaskDataError, FileNotFoundError) as e:
                logging.warning("no %s predictions: %s", name, e)
    except ValueError as e:  # readers' errors name the file and what is wrong
        raise FinetuneError(str(e)) from e
    return data


def optimizer(
    settings: FinetuneSettings,
    total_steps: int,
    frozen_encoder_of: nn.Module | None = None,
) -> optax.GradientTransformation:
    """BERT's optimizer for fine-tuning. With `frozen_encoder_of` (the model; feature-based),
    only the parameters outside its encoder (`Family.encoder_scope`) are trained."""
    tx = optim.make_optimizer(settings.optimizer_settings(total_steps))
    if frozen_encoder_of is None:
        return tx
    scope = families.of(frozen_encoder_of).encoder_scope
    return param_masks.train_only_outside(tx, families.abstract_params(frozen_encoder_of), scope)


def make_trainer(
    settings: FinetuneSettings,
    task: features.Finetune,
    model_config: ModelConfig,
    num_train: int,
    mesh: Mesh,
) -> finetune_trainer.Trainer:
    """The trainer for `num_train` training examples (task.num_train_examples)."""
    total_steps = settings.train_steps(num_train)
    if total_steps < 1:
        raise FinetuneError(
            f"{num_train} training examples give no step of batch "
            f"{settings.train_batch_size} in {settings.num_train_epochs} epochs: "
            "raise --config.num_train_epochs or lower "
            "--config.train_batch_size"
        )
    model = task.model(model_config)
    tx = optimizer(settings, total_steps, model if task.frozen_encoder else None)
    return finetune_trainer.build(
        task,
        model,
        tx,
        mesh,
        total_steps,
        functools.partial(schedules.learning_rate_at, settings.optimizer_settings(total_steps)),
    )
