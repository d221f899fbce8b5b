"""The fine-tuning loop: batches from encoded splits, one seed's training with a dev
evaluation every epoch, the best epoch's checkpoint and predictions, and the summary over
seeds. Any task that implements `tasks.features.Finetune` runs here."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from bertjax import (checkpoint, console, failures, families, files, metrics_writer, nonfinite,
                     pretrained, reporting, resume, sharding, steps, stopping)
from bertjax import sharded_run
from bertjax.state import count_params
from bertjax.tasks import metrics
from bertjax.tasks.features import Finetune, SplitData
from bertjax.errors import ConfigError

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Settings:
    """The fine-tuning config fields the loop reads (configs/finetune/common.py)."""

    task: str
    init_checkpoint: str
    random_init: bool
    train_batch_size: int
    eval_batch_size: int
    num_train_epochs: float
    log_every: int
    config: str  # the whole fine-tuning config as JSON, recorded in every checkpoint
    bert_config: dict  # the model's BertConfig fields, recorded in every checkpoint
    tokenizer_fingerprint: str  # the tokenizer's, recorded in every checkpoint


def host_batch(data: SplitData, rows: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
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


def apply_model(model: nn.Module, params: Any, batch: Batch, deterministic: bool, rng=None):
    return model.apply({"params": params}, batch["input_ids"], batch["segment_ids"],
                       batch["input_mask"], deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng})


@dataclasses.dataclass
class Trainer:
    """What every seed of a run shares: the task, the sharded run (model, optimizer, compiled
    train and predict steps) and the step count."""

    task: Finetune
    run: sharded_run.ShardedRun
    total_steps: int
    learning_rate: Callable[[int], float]  # the schedule's value at a step, for the log


def make_trainer(task: Finetune, model: nn.Module, tx: optax.GradientTransformation, mesh: Mesh,
                 total_steps: int,
                 learning_rate: Callable[[int], float]) -> Trainer:
    """Builds and compiles `model` + `tx` on `mesh` with the task's loss and outputs."""

    def loss_fn(params, batch, rng):
        return task.loss(apply_model(model, params, batch, False, rng), batch)

    def predict_step(params, batch):
        return task.outputs(apply_model(model, params, batch, True))

    sharded = sharded_run.build(model, tx, mesh, steps.make_loss_train_step(loss_fn, tx),
                                predict_step)
    return Trainer(task, sharded, total_steps, learning_rate)


def shuffled_batches(rng: np.random.Generator, rows: int, batch_size: int
                     ) -> Iterator[np.ndarray]:
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
    ends, epoch = [], 1
    while not ends or ends[-1] < total_steps:
        end = min(epoch * rows // batch_size, total_steps)
        if end > (ends[-1] if ends else 0):
            ends.append(end)
        epoch += 1
    return ends


def predict(predict_step, params, data: SplitData, batch_size: int, mesh) -> Any:
    """Outputs for every row of `data` (host numpy), in order."""
    chunks = []
    for start in range(0, len(data), batch_size):
        rows = np.arange(start, min(start + batch_size, len(data)))
        batch = sharding.global_batch_from_host(host_batch(data, rows, batch_size), mesh)
        chunks.append(jax.tree.map(lambda x, n=len(rows): np.asarray(x)[:n],
                                   jax.device_get(predict_step(params, batch))))
    return jax.tree.map(lambda *xs: np.concatenate(xs), *chunks)


def _keep_rows_up_to(path: str | None, step: int) -> None:
    """Drops the rows of `path` (metrics.jsonl) after `step`: a resumed run writes them again;
    and rows that are not JSON (a damaged file), with a warning naming them."""
    if not path or not files.exists(path):
        return
    rows, damaged = [], 0
    with files.open(path) as f:
        for line in filter(str.strip, f):
            try:
                rows += [line] if json.loads(line)["step"] <= step else []
            except (ValueError, TypeError, KeyError):
                damaged += 1
    if damaged:
        logging.warning("%s: dropped %d damaged row(s)", path, damaged)
    files.write_text(path, "".join(rows))


def _finished(workdir: str) -> dict[str, Any] | None:
    """The summary of a seed that finished in `workdir` (None if it did not, or if its
    summary.json is damaged: the seed then resumes from its best checkpoint, exactly)."""
    try:
        summary = json.loads(files.read_text(os.path.join(workdir, "summary.json")))
    except (FileNotFoundError, ValueError):
        return None
    return summary if isinstance(summary, dict) and {"best_epoch", "best_step", "dev"} <= \
        set(summary) else None


def _fresh_state(settings: Settings, trainer: Trainer, seed: int) -> Any:
    """A new state from `seed`, with the encoder (`families.pretrained_parts`) from
    settings.init_checkpoint if any."""
    sharded = trainer.run
    state = sharded.init_state(jax.random.PRNGKey(seed))
    if settings.init_checkpoint and not settings.random_init:
        parts = families.pretrained_parts(sharded.model.config)
        params = dict(state.params, **pretrained.load_pretrained(
            settings.init_checkpoint, {name: sharded.abstract_state.params[name]
                                       for name in parts},
            sharded.model.config, reuse=True,
            optional=families.optional_pretrained_parts(sharded.model.config)))
        state = state.replace(params=params, opt_state=jax.jit(
            sharded.tx.init, out_shardings=sharded.state_shardings.opt_state)(params))
    return state


def check_workdir(config_json: str, workdir: str, overwrite: bool) -> None:
    """Refuses a `workdir` that holds a fine-tuning run with settings other than `config_json`
    (naming them); with `overwrite`, empties it instead. The same settings continue (or
    re-evaluate) it."""
    path = os.path.join(workdir, "config.json")
    if not files.exists(path):
        return
    if overwrite:
        for name in files.listdir(workdir):
            if not name.startswith("run.lock"):
                files.remove(os.path.join(workdir, name))
        return
    try:
        old = json.loads(files.read_text(path))
    except ValueError as e:
        raise ConfigError(f"{path} is unreadable ({e}): delete it, or use another "
                          "--workdir") from e
    new = json.loads(config_json)
    changed = [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in sorted({*old, *new})
               if old.get(key) != new.get(key)]
    if changed:
        raise ConfigError(f"{workdir} holds a fine-tuning run with other settings ("
                          f"{'; '.join(changed[:5])}"
                          f"{'; ...' if len(changed) > 5 else ''}): use a new "
                          "--workdir, or --overwrite to replace that run")


@jax.jit
def _add_metrics(sums: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """`sums` (empty: none yet) plus one step's metrics, `skipped` counting the steps whose
    update a non-finite loss or gradient skipped; one dispatch, no wait for the step."""
    metrics = dict(metrics, skipped=(metrics["nonfinite"] > 0).astype(jnp.int32))
    return jax.tree.map(jnp.add, sums, metrics) if sums else metrics


def train_one_seed(settings: Settings, trainer: Trainer, data: dict[str, SplitData], seed: int,
                   workdir: str) -> dict[str, Any]:
    """Fine-tunes with one seed in `workdir`; returns the best epoch's dev metrics. Every
    epoch ends with a checkpoint (the latest and the best one are kept), which a rerun
    resumes from; at the end only the best one is kept (and named on the console). A rerun
    of a finished seed only predicts again with its best checkpoint."""
    files.makedirs(workdir)
    train = data["train"]
    batch_size, task, sharded = settings.train_batch_size, trainer.task, trainer.run
    total_steps = trainer.total_steps
    mesh, abstract_state = sharded.mesh, sharded.abstract_state
    train_step, predict_step = sharded.train_step, sharded.eval_step
    # (Not announced per epoch: all but the best epoch's are deleted; the kept one is named
    # once the others are gone.)
    checkpointer = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                           save_every=10 ** 9, keep_latest=1)
    meta = {"task": settings.task, "seed": seed, "config": settings.config,
            "bert_config": settings.bert_config,
            "tokenizer_fingerprint": settings.tokenizer_fingerprint}
    best: dict[str, Any] = {"epoch": -1}
    jsonl = os.path.join(workdir, "metrics.jsonl") if jax.process_index() == 0 else None
    ends = epoch_ends(len(train), batch_size, total_steps)
    epochs = len(ends)
    finished, latest = _finished(workdir), checkpointer.latest_step()
    if finished:
        start_epoch, best = epochs, {key: finished[f"best_{key}"] for key in ("epoch", "step")}
        best["dev"] = finished["dev"]
        state = None
        reporting.chief_print(f"seed {seed}: finished (best epoch {best['epoch']}); predicting "
                              "again with its best checkpoint")
    elif latest is not None:
        state, position = resume.restore_exactly(checkpointer, latest, abstract_state, meta)
        start_epoch, best = position["epoch"], position["best"]
        checkpointer.pin(best.get("step"))  # (none before the first epoch's end)
        reporting.chief_print(f"seed {seed}: resuming from {checkpointer.directory}/{latest} "
                              f"(epoch {start_epoch} of {epochs})")
    else:
        start_epoch, state = 0, _fresh_state(settings, trainer, seed)
    if not finished:
        _keep_rows_up_to(jsonl, latest or 0)
    writer = metrics_writer.open_writer(workdir)
    step = latest or 0
    batches = shuffled_batches(np.random.default_rng(seed), len(train), batch_size)
    for _ in range(step):  # the batches already trained on
        next(batches)
    reporting.chief_print(f"seed {seed}: {len(train)} training rows, {total_steps} steps "
                          f"({len(train) / batch_size:.1f}/epoch), "
                          f"{count_params(abstract_state.params):,} parameters")
    first_step = step + 1
    sums, steps_summed, started = {}, 0, time.time()
    clock, eval_seconds = reporting.StepClock(), 0.0

    def eta(epoch: int) -> float | None:
        """Steps left at the measured rate (compile excluded), plus the dev evaluations left."""
        seconds = clock.seconds_per_step("train")
        return None if seconds is None else \
            seconds * (total_steps - step) + eval_seconds * (epochs - epoch)

    def save(epoch: int) -> None:
        """Saves the state at `step` with `epoch` epochs done (a stop within the next one)."""
        nonfinite.check_finite(state, step, "; an update of this run made them so from "
                               "finite gradients: lower --config.learning_rate")
        checkpointer.save(step, state, {"epoch": epoch, "best": best}, meta, force=True)

    def stop_if_asked(ctrl_c: failures.CtrlC, epochs_done: int, saved: bool) -> None:
        """After Ctrl-C: saves at `step` with `epochs_done` epochs done (unless `saved`),
        says how to continue and stops."""
        if ctrl_c.requested:
            if not saved:
                reporting.chief_print(f"Ctrl-C: saving a checkpoint at step {step} and exiting")
                save(epochs_done)
            checkpointer.wait()
            reporting.chief_print(failures.stopped_line(
                f"seed {seed} step {step} of {total_steps}", signal.SIGINT))
            raise failures.Stopped(signal.SIGINT)

    try:
        with sharding.activate(mesh), failures.CtrlC(forward_as_sigterm=False) as ctrl_c:
            for epoch in range(start_epoch, epochs):
                while step < ends[epoch]:
                    stopping.now_doing(f"training step {step + 1}")
                    rows = next(batches)
                    batch = sharding.global_batch_from_host(host_batch(train, rows, batch_size),
                                                            mesh)
                    state, metrics = train_step(state, batch)
                    step += 1
                    # Summed on the device: the host waits for a step only when it logs.
                    sums = _add_metrics(sums, metrics)
                    steps_summed += 1
                    if step == first_step:  # compiled and run: the clock starts here
                        jax.block_until_ready(metrics)
                        clock.tick("train", step)
                    if step % settings.log_every == 0 or step == total_steps:
                        sums = jax.device_get(sums)
                        clock.tick("train", step)
                        means = {"loss": float(sums["loss_sum"] / max(sums["count"], 1.0)),
                                 "grad_norm": float(sums["grad_norm"]) / steps_summed,
                                 "learning_rate": trainer.learning_rate(step - 1)}
                        left = eta(epoch)
                        reporting.chief_print(
                            f"seed {seed} step {step}/{total_steps} loss {means['loss']:.4f} "
                            f"lr {means['learning_rate']:.3e} ({time.time() - started:.0f}s"
                            + (f", eta {reporting.duration(left)})" if left is not None else ")"))
                        if sums["skipped"]:
                            logging.warning(
                                "seed %d: %d of the %d steps up to step %d skipped: their loss "
                                "or gradients held NaN or Inf", seed, sums["skipped"],
                                steps_summed, step)
                        metrics_writer.log_scalars(writer, "train", means, step)
                        metrics_writer.write_jsonl(jsonl, {"step": step, "split": "train", **means})
                        sums, steps_summed = {}, 0
                    console.TERMINAL.show(reporting.status_bar(step, total_steps, eta(epoch)))
                    if step < ends[epoch]:  # (an epoch's last step is saved after its evaluation)
                        stop_if_asked(ctrl_c, epoch, saved=False)
                stopping.now_doing(f"evaluating epoch {epoch + 1}")
                evaluated = time.time()
                dev = {name: task.evaluate(data[name], predict(
                    predict_step, state.params, data[name], settings.eval_batch_size, mesh))
                    for name in task.eval_splits}
                eval_seconds = time.time() - evaluated
                clock.restart()  # the evaluation was no training step
                clock.tick("train", step)
                for name, values in dev.items():
                    reporting.chief_print(f"seed {seed} epoch {epoch + 1} {name}: " + " ".join(
                        f"{k} {metric_value(k, v, task.percent_metrics)}"
                        for k, v in values.items()))
                    metrics_writer.log_scalars(writer, f"eval_{name}", values, step)
                    metrics_writer.write_jsonl(jsonl, {"step": step, "epoch": epoch + 1,
                                                  "split": name, **values})
                score = dev[task.eval_splits[0]][task.main_metric]
                if best["epoch"] < 0 or score > best["score"]:
                    best = {"epoch": epoch + 1, "step": step, "score": score, "dev": dev}
                    reporting.chief_print(f"seed {seed} epoch {epoch + 1}: best "
                                          f"{task.main_metric} so far")
                checkpointer.pin(best["step"])
                save(epoch + 1)
                stop_if_asked(ctrl_c, epoch + 1, saved=True)  # (a rerun predicts after the last)
            ctrl_c.release()  # predicting: Ctrl-C interrupts (KeyboardInterrupt)
            checkpointer.wait()
            if state is None or best["step"] != step:
                state, _ = resume.restore_exactly(checkpointer, best["step"], abstract_state, meta)
            outputs, scored_tests = {}, {}
            files.makedirs(os.path.join(workdir, "predictions"))
            for name in [n for n in task.test_splits if n in data]:
                test = data[name]
                test_outputs = predict(predict_step, state.params, test,
                                       settings.eval_batch_size, mesh)
                outputs[name] = task.write_predictions(test, test_outputs,
                                                       os.path.join(workdir, "predictions"))
                if name in task.scored_test_splits:
                    scored_tests[name] = task.evaluate(test, test_outputs)
            if not task.test_splits:  # SQuAD: the best epoch's dev predictions
                first = data[task.eval_splits[0]]
                outputs["dev"] = task.write_predictions(
                    first, predict(predict_step, state.params, first, settings.eval_batch_size,
                                   mesh),
                    os.path.join(workdir, "predictions"))
            result = {"seed": seed, "best_epoch": best["epoch"], "best_step": best["step"],
                      "dev": best["dev"], "test": scored_tests, "predictions": outputs,
                      "seconds": round(time.time() - started, 1)}
            if jax.process_index() == 0:  # (marks the seed as finished)
                files.write_text(os.path.join(workdir, "summary.json"),
                                     json.dumps(result, indent=1))
            for other in set(checkpointer.all_steps()) - {best["step"]}:
                checkpointer.delete(other)
            reporting.chief_print(f"seed {seed}: best epoch {best['epoch']} kept, checkpoint "
                                  f"step {best['step']} -> {checkpointer.directory}/{best['step']}")
    finally:
        checkpointer.close()
        if writer:
            writer.close()
    return result


def summarize_seeds(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation (ddof 0) and median of every dev (and labelled test) metric
    over the seeds."""
    table: dict[str, list[float]] = {}
    for result in results:
        for split, values in {**result["dev"], **result["test"]}.items():
            for key, value in values.items():
                table.setdefault(f"{split}/{key}", []).append(value)
    return {key: metrics.spread(v) for key, v in table.items()}


def metric_value(name: str, value: float, percent: frozenset[str] = frozenset()) -> str:
    """A metric as printed: `88.50%` for one reported in percent (SQuAD's official EM/F1),
    `0.8850` for a fraction of 1 (GLUE, CoNLL-2003)."""
    return f"{value:.2f}%" if name in percent else f"{value:.4f}"


def summary_lines(task: str, stats: dict[str, dict[str, float]], num_seeds: int,
                  baselines: dict[str, tuple[str, dict[str, float]]],
                  percent: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """The run's summary lines (each metric over the seeds, beside its split's baseline), and
    per split a warning naming the metrics whose mean does not beat the baseline: `baselines`
    maps a split to (how the baseline predicts, its metrics); `percent` names the metrics
    reported in percent."""
    lines, behind = [], {}
    for key, values in stats.items():
        split, metric = key.split("/", 1)
        mean, std, median = (metric_value(metric, values[k], percent)
                             for k in ("mean", "std", "median"))
        line = f"{task} {key}: mean {mean} std {std} median {median} over {num_seeds} seeds"
        if split in baselines and metric in baselines[split][1]:
            baseline = baselines[split][1][metric]
            line += f"; baseline {baseline:.4f}"
            if values["mean"] <= baseline:
                behind.setdefault(split, []).append(
                    f"{metric} {values['mean']:.4f} (baseline {baseline:.4f})")
        lines.append(line)
    warnings = [f"{split}: {', '.join(names)} do not beat the baseline that ignores the input "
                f"({baselines[split][0]}): the model has not learned {task}; try more epochs "
                "(--config.num_train_epochs), another --config.learning_rate, or a longer "
                "pretrained init_checkpoint" for split, names in behind.items()]
    return lines, warnings
