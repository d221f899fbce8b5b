"""`python -m bertjax.finetune --config=configs/finetune/glue.py --config.task=mrpc
--config.init_checkpoint=PRETRAIN_WORKDIR --workdir=DIR`: fine-tuning and evaluation.

Trains for `num_train_epochs`, evaluates on the dev split(s) after every epoch, keeps the best
checkpoint (by the task's main metric), then writes the dev metrics of the best epoch, test-set
predictions (GLUE leaderboard TSVs, CoNLL predictions, SQuAD predictions.json) and a JSON
summary. `--config.seeds=1,2,3` repeats the run per seed and summarises mean/std/median.

The model architecture and the tokenizer come from the pretraining run that wrote
`init_checkpoint` (its checkpoint metadata); `vocab_file` and `model_config` override them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags
from tensorboardX import SummaryWriter

from bertjax import checkpoint, optim, pretrained, sharding, steps
from bertjax import model as bert_model
from bertjax.interop.tree import ConversionError
from bertjax.data import pipeline
from bertjax.model import BertConfig
from bertjax.state import count_params, create_train_state
from bertjax.tasks import features, glue, ner, squad_predict
from bertjax.tasks.features import SplitData

Batch = dict[str, jax.Array]


class FinetuneError(ValueError):
    """A configuration or input that cannot run; the message says what to change."""


TASK_KINDS = {"glue": glue.GlueFinetune, "ner": ner.NerFinetune, "squad": squad_predict.SquadFinetune}


def make_task(config, tokenizer):
    if config.kind not in TASK_KINDS:
        raise FinetuneError(f"kind={config.kind!r}; choose one of {sorted(TASK_KINDS)}")
    try:
        return TASK_KINDS[config.kind](features.TaskOptions.from_dict(config.to_dict()), tokenizer)
    except ValueError as e:
        raise FinetuneError(str(e)) from e


# ----------------------------------------------------------------------------- batches and steps


def _host_batch(data: SplitData, rows: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """This process's slice of the global batch `rows`, padded to `batch_size` with weight-0
    copies of row 0 (the last evaluation batch)."""
    weights = np.ones(batch_size, np.float32)
    weights[len(rows):] = 0.0
    rows = np.concatenate([rows, np.zeros(batch_size - len(rows), rows.dtype)])
    local = batch_size // jax.process_count()
    mine = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
    batch = {key: value[rows[mine]] for key, value in data.features.items()}
    batch["weights"] = weights[mine]
    return batch


def _apply(model: nn.Module, params: Any, batch: Batch, deterministic: bool, rng=None):
    return model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                       batch["input_mask"], deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng})


def make_steps(task, model: nn.Module, tx, state_shardings, mesh):
    """Jitted `(train_step(state, batch), predict_step(params, batch))`."""

    def loss_fn(params, batch, rng):
        return task.loss(_apply(model, params, batch, False, rng), batch)

    def predict_step(params, batch):
        outputs = _apply(model, params, batch, True)
        return task.outputs(outputs)

    train_step = steps.jit_train_step(steps.make_loss_train_step(loss_fn, tx), state_shardings, mesh)
    return train_step, steps.jit_eval_step(predict_step, state_shardings.params, mesh)


def predict(predict_step, params, data: SplitData, batch_size: int, mesh) -> Any:
    """Outputs for every row of `data` (host numpy), in order."""
    chunks = []
    for start in range(0, len(data), batch_size):
        rows = np.arange(start, min(start + batch_size, len(data)))
        batch = sharding.global_batch_from_host(_host_batch(data, rows, batch_size), mesh)
        chunks.append(jax.tree.map(lambda x, n=len(rows): np.asarray(x)[:n],
                                   jax.device_get(predict_step(params, batch))))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)


def optimizer(config, total_steps: int, frozen_encoder_of: Any = None) -> optax.GradientTransformation:
    """BERT's optimizer for fine-tuning. With `frozen_encoder_of` (the model's parameter tree;
    feature-based), only the parameters outside `bert` are trained."""
    tx = optim.make_optimizer(optim.optimizer_config(
        config.optimizer, total_steps, peak_learning_rate=config.learning_rate,
        warmup_steps=int(total_steps * config.warmup_proportion)))
    return tx if frozen_encoder_of is None else optim.train_only_outside(tx, frozen_encoder_of, "bert")


# ----------------------------------------------------------------------------- one seed


def _log(writer: SummaryWriter | None, prefix: str, values: dict[str, float], step: int) -> None:
    if writer:
        for key, value in values.items():
            writer.add_scalar(f"{prefix}/{key}", value, step)
        writer.flush()


@dataclasses.dataclass
class Trainer:
    """What every seed of a run shares: the model, optimizer, step counts and the compiled
    steps (built by the first seed, reused by the others)."""

    model: nn.Module
    tx: optax.GradientTransformation
    steps_per_epoch: int
    total_steps: int
    steps: tuple[Callable, Callable] | None = None


def make_trainer(config, task, bert_config: BertConfig, num_train: int) -> Trainer:
    steps_per_epoch = num_train // config.train_batch_size  # the original drops the remainder
    total_steps = int(steps_per_epoch * config.num_train_epochs)
    if total_steps < 1:
        raise FinetuneError(f"{num_train} training examples give no step of batch "
                            f"{config.train_batch_size}")
    model = task.model(bert_config)
    tx = optimizer(config, total_steps,
                    bert_model.abstract_params(model) if task.frozen_encoder else None)
    return Trainer(model, tx, steps_per_epoch, total_steps)


def train_one_seed(config, task, trainer: Trainer, data: dict[str, SplitData], seed: int,
                   workdir: str, mesh) -> dict[str, Any]:
    """Fine-tunes with one seed in `workdir`; returns the best epoch's dev metrics."""
    os.makedirs(workdir, exist_ok=True)
    train = data["train"]
    batch_size = config.train_batch_size
    model, tx = trainer.model, trainer.tx
    steps_per_epoch, total_steps = trainer.steps_per_epoch, trainer.total_steps
    state, abstract_state, state_shardings = create_train_state(
        model, tx, jax.random.PRNGKey(seed), bert_model.example_inputs(model), mesh)
    if config.init_checkpoint and not config.random_init:
        params = dict(state.params, **pretrained.load_pretrained(
            config.init_checkpoint, {"bert": abstract_state.params["bert"]}, model.config,
            reuse=True))
        state = state.replace(params=params, opt_state=jax.jit(
            tx.init, out_shardings=state_shardings.opt_state)(params))
    if trainer.steps is None:
        trainer.steps = make_steps(task, model, tx, state_shardings, mesh)
    train_step, predict_step = trainer.steps
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                           save_every=10 ** 9, keep_latest=1)
    writer = SummaryWriter(os.path.join(workdir, "tensorboard")) if jax.process_index() == 0 else None
    meta = {"task": config.task, "seed": seed, "config": config.to_json()}
    best: dict[str, Any] = {"epoch": -1}
    rng = np.random.default_rng(seed)
    print(f"seed {seed}: {len(train)} training examples, {total_steps} steps "
          f"({steps_per_epoch}/epoch), {count_params(state.params):,} parameters", flush=True)
    step, sums, steps_summed, started = 0, {}, 0, time.time()
    try:
        with sharding.activate(mesh):
            for epoch in range(int(np.ceil(config.num_train_epochs))):
                order = rng.permutation(len(train))
                for index in range(steps_per_epoch):
                    if step >= total_steps:
                        break
                    rows = order[index * batch_size:(index + 1) * batch_size]
                    batch = sharding.global_batch_from_host(_host_batch(train, rows, batch_size), mesh)
                    state, metrics = train_step(state, batch)
                    step += 1
                    # Summed on the device: the host waits for a step only when it logs.
                    sums = jax.tree.map(jnp.add, sums, metrics) if sums else metrics
                    steps_summed += 1
                    if step % config.log_every == 0 or step == total_steps:
                        sums = jax.device_get(sums)
                        means = {"loss": float(sums["loss_sum"] / max(sums["count"], 1.0)),
                                 "grad_norm": float(sums["grad_norm"]) / steps_summed}
                        print(f"seed {seed} step {step}/{total_steps} loss {means['loss']:.4f} "
                              f"({time.time() - started:.0f}s)", flush=True)
                        _log(writer, "train", means, step)
                        sums, steps_summed = {}, 0
                dev = {name: task.evaluate(data[name], predict(
                    predict_step, state.params, data[name], config.eval_batch_size, mesh))
                    for name in task.eval_splits}
                for name, values in dev.items():
                    print(f"seed {seed} epoch {epoch + 1} {name}: " +
                          " ".join(f"{k} {v:.4f}" for k, v in values.items()), flush=True)
                    _log(writer, f"eval_{name}", values, step)
                score = dev[task.eval_splits[0]][task.main_metric]
                if best["epoch"] < 0 or score > best["score"]:
                    best = {"epoch": epoch + 1, "step": step, "score": score, "dev": dev}
                    checkpointer.save(step, state, {"epoch": epoch + 1}, meta, force=True)
            checkpointer.wait()
            if best["step"] != step:
                state, _, _ = checkpointer.restore(best["step"], abstract_state, meta)
            outputs, scored_tests = {}, {}
            os.makedirs(os.path.join(workdir, "predictions"), exist_ok=True)
            for name in [n for n in task.test_splits if n in data]:
                test = data[name]
                test_outputs = predict(predict_step, state.params, test, config.eval_batch_size, mesh)
                outputs[name] = task.write_predictions(test, test_outputs,
                                                       os.path.join(workdir, "predictions"))
                if name in task.scored_test_splits:
                    scored_tests[name] = task.evaluate(test, test_outputs)
            if not task.test_splits:  # SQuAD: the best epoch's dev predictions
                first = data[task.eval_splits[0]]
                outputs["dev"] = task.write_predictions(
                    first, predict(predict_step, state.params, first, config.eval_batch_size, mesh),
                    os.path.join(workdir, "predictions"))
    finally:
        checkpointer.close()
        if writer:
            writer.close()
    result = {"seed": seed, "best_epoch": best["epoch"], "best_step": best["step"],
              "dev": best["dev"], "test": scored_tests, "predictions": outputs,
              "seconds": round(time.time() - started, 1)}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


# ----------------------------------------------------------------------------- several seeds


def summarize_seeds(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation (ddof 0) and median of every dev (and labelled test) metric
    over the seeds."""
    table: dict[str, list[float]] = {}
    for result in results:
        for split, values in {**result["dev"], **result["test"]}.items():
            for key, value in values.items():
                table.setdefault(f"{split}/{key}", []).append(value)
    return {key: {"mean": float(np.mean(v)), "std": float(np.std(v)),
                  "median": float(np.median(v)), "values": v} for key, v in table.items()}


def parse_seeds(seeds: Any) -> list[int]:
    try:
        return [int(s) for s in str(seeds).replace(" ", "").split(",") if s]
    except ValueError as e:
        raise FinetuneError(f"seeds={seeds!r}: expected comma-separated integers") from e


def run(config: ml_collections.ConfigDict, workdir: str,
        devices: list[jax.Device] | None = None) -> dict[str, Any]:
    """Fine-tunes every seed in `config.seeds` (each in `workdir/seed_N`) and writes
    `workdir/summary.json`; returns it."""
    source = pretrained.Source.from_dict(config.to_dict())
    pretrain = pretrained.pretraining_run(source)
    bert_config = pretrained.bert_config_of(source, pretrain)
    tokenizer = pretrained.tokenizer_of(source, pretrain)
    if tokenizer.vocab_size > bert_config.vocab_size:
        raise FinetuneError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model "
                            f"{bert_config.vocab_size}: use the pretraining run's vocabulary")
    if config.max_seq_length > bert_config.max_position_embeddings:
        raise FinetuneError(f"max_seq_length={config.max_seq_length} > the model's "
                            f"max_position_embeddings={bert_config.max_position_embeddings}")
    try:
        mesh = sharding.make_mesh(config.mesh.to_dict(), devices)
    except ValueError as e:
        raise FinetuneError(str(e)) from e
    for size in (config.train_batch_size, config.eval_batch_size):
        if size % (sharding.data_parallel_size(mesh) * jax.process_count()):
            raise FinetuneError(f"batch size {size} must be divisible by data*fsdp="
                                f"{sharding.data_parallel_size(mesh)} times the process count")
    task = make_task(config, tokenizer)
    try:
        data = {name: task.load(name) for name in ["train", *task.eval_splits]}
        for name in task.test_splits:  # unlabelled leaderboard inputs are optional
            try:
                data[name] = task.load(name)
            except (features.TaskDataError, FileNotFoundError) as e:
                logging.warning("no %s predictions: %s", name, e)
    except ValueError as e:  # readers' errors name the file and what is wrong
        raise FinetuneError(str(e)) from e
    trainer = make_trainer(config, task, bert_config, len(data["train"]))
    results = [train_one_seed(config, task, trainer, data, seed,
                              os.path.join(workdir, f"seed_{seed}"), mesh)
               for seed in parse_seeds(config.seeds)]
    summary = {"task": config.task, "init_checkpoint": config.init_checkpoint,
               "random_init": bool(config.random_init), "main_metric": task.main_metric,
               "train_examples": len(data["train"]),
               "skipped": {name: split.skipped for name, split in data.items()},
               "seeds": results, "summary": summarize_seeds(results), "config": config.to_dict()}
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        for key, stats in summary["summary"].items():
            print(f"{config.task} {key}: mean {stats['mean']:.4f} std {stats['std']:.4f} "
                  f"median {stats['median']:.4f} over {len(results)} seeds", flush=True)
    return summary


FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "configs/finetune/*.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory (checkpoints, predictions, summary)")
    flags.mark_flags_as_required(["config", "workdir"])


def main(argv) -> None:
    del argv
    try:
        run(FLAGS.config, FLAGS.workdir)
    except (FinetuneError, pretrained.PretrainedError, features.TaskDataError, pipeline.DataError,
            checkpoint.CheckpointMismatch, checkpoint.CheckpointWriteError, FileNotFoundError,
            ConversionError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
