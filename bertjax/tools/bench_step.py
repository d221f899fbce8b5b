"""What `python -m bertjax.tools.bench` times: a synthetic batch of a phase's shape (plain or
packed rows) and bertjax's jitted, sharded train step on it."""

from __future__ import annotations

import time

import jax
import ml_collections
import numpy as np

from bertjax.data import batch as batch_spec, packing
from bertjax.models import families
from bertjax.training import optim, sharded_run, sharding
from bertjax.training.state import count_params


def synthetic_batch(
    batch: int,
    length: int,
    predictions: int,
    vocab: int,
    seed: int = 0,
    padding: float = 0.0,
    packed: int = 0,
) -> dict[str, np.ndarray]:
    """Sequence pairs with `predictions` distinct masked positions per row, the last `padding`
    share of each row's tokens padding; with `packed` = K, packed rows of K equal instances."""
    rng = np.random.default_rng(seed)
    real = length - round(padding * length)
    instances = max(packed, 1)
    if packed:
        predictions = packing.predictions_per_row(length, predictions, 0.15, packed)
    if real < 2 * instances:
        raise ValueError(
            f"--padding={padding} leaves {real} tokens per row: too few for {instances} instance(s)"
        )
    instance_ids = np.minimum(np.arange(length) * instances // real + 1, instances + 1)
    instance_ids = np.where(np.arange(length) < real, instance_ids, 0).astype(np.int32)
    starts = np.searchsorted(instance_ids[:real], np.arange(1, instances + 1)).astype(np.int32)
    positions = (np.arange(length) - starts[np.maximum(instance_ids, 1) - 1]) * (instance_ids > 0)
    candidates = np.tile(np.setdiff1d(np.arange(real), starts), (batch, 1))
    chosen = min(predictions, candidates.shape[1])  # the other slots: weight 0, as in short rows
    rows = {
        "input_ids": np.where(instance_ids > 0, rng.integers(5, vocab, (batch, length)), 0),
        "input_mask": (instance_ids > 0)[None].repeat(batch, 0),
        "segment_ids": (positions >= (real // instances) // 2)[None].repeat(batch, 0),
        "masked_lm_positions": np.pad(
            np.sort(rng.permuted(candidates, axis=1)[:, :chosen], axis=1),
            ((0, 0), (0, predictions - chosen)),
        ),
        "masked_lm_ids": rng.integers(5, vocab, (batch, predictions)),
        "masked_lm_weights": (np.arange(predictions) < chosen)[None].repeat(batch, 0),
        "next_sentence_labels": rng.integers(0, 2, (batch,) + ((packed,) if packed else ())),
    }
    if packed:
        rows.update(
            position_ids=positions[None].repeat(batch, 0),
            instance_ids=instance_ids[None].repeat(batch, 0),
            next_sentence_positions=starts[None].repeat(batch, 0),
            next_sentence_weights=np.ones((batch, packed), np.float32),
        )
    return {name: value.astype(batch_spec.DTYPES[name]) for name, value in rows.items()}


class BertjaxTrainer:
    """The jitted, donated, sharded train step of `bertjax.train` on one fixed batch."""

    def __init__(self, config: ml_collections.ConfigDict, batch: dict[str, np.ndarray]) -> None:
        self.model_config = families.model_config(config.model.to_dict())
        self.mesh = sharding.make_mesh(config.mesh.to_dict())
        sharded = sharded_run.build_pretraining(
            self.model_config,
            optim.optimizer_config(config.optimizer, config.train.total_steps),
            self.mesh,
            [],
            config.train.grad_accum_steps,
            report=False,
        )
        self.state = sharded.init_state(jax.random.PRNGKey(0))
        self.num_params = count_params(self.state.params)
        self._step = sharded.train_step
        # the step compiled for this batch, by the first step()
        self._compiled: jax.stages.Compiled | None = None
        with sharding.activate(self.mesh):
            self.batch = sharding.global_batch_from_host(batch, self.mesh)

    def cost(self) -> dict[str, float]:
        """XLA's cost analysis of the compiled step (after a step()): FLOPs and bytes accessed
        (noise-free)."""
        assert self._compiled is not None, "cost() reads the step that step() compiled"
        cost = self._compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert cost is not None, "XLA's compiles have a cost analysis"
        return {"flops": float(cost["flops"]), "bytes_accessed": float(cost["bytes accessed"])}

    def step(self) -> float:
        """Runs one step to completion (the first compiles it); returns its wall-clock seconds."""
        start = time.perf_counter()
        with sharding.activate(self.mesh):
            if self._compiled is None:
                self._compiled = self._step.lower(self.state, self.batch).compile()
            self.state, metrics = self._compiled(self.state, self.batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start
