"""What every seed of a fine-tuning run shares: the Trainer (the task, its model and optimizer
compiled on the mesh, the step count and schedule, `build`), the rows each step trains on
(shuffled passes, the epochs' ends, this process's slice of a batch) and the outputs over a
split (`predict`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh

from bertjax.models.layers import losses
from bertjax.tasks.features import Finetune, SplitData
from bertjax.training import sharded_run, sharding, steps

Batch = dict[str, jax.Array]


def host_batch(data: SplitData, rows: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """This process's slice of the global batch `rows`, padded to `batch_size` with weight-0
    copies of row 0 (the last evaluation batch)."""
    weights = np.ones(batch_size, np.float32)
    weights[len(rows) :] = 0.0
    rows = np.concatenate([rows, np.zeros(batch_size - len(rows), rows.dtype)])
    local = batch_size // jax.process_count()
    mine = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
    batch = {key: value[rows[mine]] for key, value in data.features.items()}
    batch["weights"] = weights[mine]
    return batch


def apply_model(
    model: nn.Module,
    params: optax.Params,
    batch: Batch,
    deterministic: bool,
    rng: jax.Array | None = None,
) -> Any:
    """The task model's outputs on `batch` (logits, or a span model's (start, end) logits)."""
    return model.apply(
        {"params": params},
        batch["input_ids"],
        batch["segment_ids"],
        batch["input_mask"],
        deterministic=deterministic,
        rngs=None if deterministic or rng is None else {"dropout": rng},
    )


@dataclasses.dataclass
class Trainer:
    """What every seed of a run shares: the task, the sharded run (model, optimizer, compiled
    train and predict steps) and the step count."""

    task: Finetune
    run: sharded_run.ShardedRun
    total_steps: int
    learning_rate: Callable[[int], float]  # the schedule's value at a step, for the log


def build(
    task: Finetune,
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    total_steps: int,
    learning_rate: Callable[[int], float],
) -> Trainer:
    """Builds and compiles `model` + `tx` on `mesh` with the task's loss and outputs."""

    def loss_fn(params: optax.Params, batch: Batch, rng: jax.Array) -> losses.Loss:
        return task.loss(apply_model(model, params, batch, False, rng), batch)

    def predict_step(params: optax.Params, batch: Batch) -> Any:
        return task.outputs(apply_model(model, params, batch, True))

    sharded = sharded_run.build(
        model, tx, mesh, steps.make_loss_train_step(loss_fn, tx), predict_step
    )
    return Trainer(task, sharded, total_steps, learning_rate)


def shuffled_batches(rng: np.random.Generator, rows: int, batch_size: int) -> Iterator[np.ndarray]:
    """Row indices, `batch_size` at a time, from one permutation of the rows after another (a
    batch spans two passes where one ends): the original's repeated, shuffled training set."""
    order = np.zeros(0, np.int64)
    while True:
        while len(order) < batch_size:
            order = np.concatenate([order, rng.permutation(rows)])
        yield order[:batch_size]
        order = order[batch_size:]


def epoch_ends(rows: int, batch_size: int, total_steps: int) -> list[int]:
    """The steps after which a dev evaluation runs: where each pass over the `rows` training
    rows ends, and `total_steps` (the last)."""
    ends: list[int] = []
    epoch = 1
    while not ends or ends[-1] < total_steps:
        end = min(epoch * rows // batch_size, total_steps)
        if end > (ends[-1] if ends else 0):
            ends.append(end)
        epoch += 1
    return ends


def predict(
    predict_step: Callable[[optax.Params, Batch], Any],
    params: optax.Params,
    data: SplitData,
    batch_size: int,
    mesh: Mesh,
) -> Any:
    """Outputs for every row of `data` (host numpy), in order."""
    chunks = []
    for start in range(0, len(data), batch_size):
        rows = np.arange(start, min(start + batch_size, len(data)))
        batch = sharding.global_batch_from_host(host_batch(data, rows, batch_size), mesh)
        chunks.append(
            jax.tree.map(
                lambda x: np.asarray(x)[: len(rows)],  # noqa: B023 (at once)
                jax.device_get(predict_step(params, batch)),
            )
        )
    return jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)
