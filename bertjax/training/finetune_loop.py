"""The fine-tuning loop: one seed's training with a dev evaluation every epoch, the best
epoch's checkpoint and predictions; its record, its workdir's resumption. Any task that
implements `tasks.features.Finetune` runs here (on the `finetune_trainer.Trainer` its seeds
share)."""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from bertjax.checkpoints import checkpoint
from bertjax.errors import ConfigError
from bertjax.interop import pretrained_weights
from bertjax.models import families
from bertjax.runtime import console, failures, files, stopping
from bertjax.tasks.features import SplitData
from bertjax.tasks.metrics import metric_value
from bertjax.training import (
    finetune_trainer,
    loop,
    metrics_writer,
    nonfinite,
    reporting,
    resume,
    sharding,
)
from bertjax.training.finetune_settings import FinetuneSettings
from bertjax.training.state import TrainState, count_params


@dataclasses.dataclass(frozen=True)
class SeedRecord:
    """What a fine-tuning checkpoint records about its run (its `meta` JSON item)."""

    task: str
    seed: int
    config: str  # the whole fine-tuning config as JSON (FinetuneSettings.as_json)
    bert_config: dict[str, Any]  # the model's fields (families.as_record)
    tokenizer_fingerprint: str


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
    return (
        summary
        if isinstance(summary, dict) and {"best_epoch", "best_step", "dev"} <= set(summary)
        else None
    )


def _fresh_state(settings: FinetuneSettings, trainer: finetune_trainer.Trainer, seed: int) -> Any:
    """A new state from `seed`, with the encoder (`families.pretrained_parts`) from
    settings.init_checkpoint if any."""
    sharded = trainer.run
    state = sharded.init_state(jax.random.PRNGKey(seed))
    if settings.init_checkpoint and not settings.random_init:
        parts = families.pretrained_parts(sharded.model.config)
        params = dict(
            state.params,
            **pretrained_weights.load_pretrained(
                settings.init_checkpoint,
                {name: sharded.abstract_state.params[name] for name in parts},
                sharded.model.config,
                reuse=True,
                optional=families.optional_pretrained_parts(sharded.model.config),
            ),
        )
        state = state.replace(
            params=params,
            opt_state=jax.jit(sharded.tx.init, out_shardings=sharded.state_shardings.opt_state)(
                params
            ),
        )
    return state


# Config fields that say how a run is watched, not what it computes: a rerun may change them.
OBSERVING_FIELDS = ("profile_steps",)


def check_workdir(config_json: str, workdir: str, overwrite: bool) -> None:
    """Refuses a `workdir` that holds a fine-tuning run with settings other than `config_json`
    (naming them; but `OBSERVING_FIELDS`); with `overwrite`, empties it instead. The same
    settings continue (or re-evaluate) it."""
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
        raise ConfigError(f"{path} is unreadable ({e}): delete it, or use another --workdir") from e
    new = json.loads(config_json)
    changed = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted({*old, *new} - set(OBSERVING_FIELDS))
        if old.get(key) != new.get(key)
    ]
    if changed:
        raise ConfigError(
            f"{workdir} holds a fine-tuning run with other settings ("
            f"{'; '.join(changed[:5])}"
            f"{'; ...' if len(changed) > 5 else ''}): use a new "
            "--workdir, or --overwrite to replace that run"
        )


@jax.jit
def _add_metrics(sums: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """`sums` (empty: none yet) plus one step's metrics, `skipped` counting the steps whose
    update a non-finite loss or gradient skipped; one dispatch, no wait for the step."""
    metrics = dict(metrics, skipped=(metrics["nonfinite"] > 0).astype(jnp.int32))
    return jax.tree.map(jnp.add, sums, metrics) if sums else metrics


def train_one_seed(
    settings: FinetuneSettings,
    record: SeedRecord,
    trainer: finetune_trainer.Trainer,
    data: dict[str, SplitData],
    workdir: str,
) -> dict[str, Any]:
    """Fine-tunes with one seed in `workdir`; returns the best epoch's dev metrics. Every
    epoch ends with a checkpoint (the latest and the best one are kept), which a rerun
    resumes from; at the end only the best one is kept (and named on the console). A rerun
    of a finished seed only predicts again with its best checkpoint."""
    files.makedirs(workdir)
    # (Not announced per epoch: all but the best epoch's are deleted; the kept one is named
    # once the others are gone.)
    checkpointer = checkpoint.Checkpointer(
        os.path.join(workdir, "checkpoints"), save_every=10**9, keep_latest=1
    )
    seed_run = SeedRun(settings, record, trainer, data, workdir, checkpointer)
    try:
        with loop.running(trainer.run.mesh) as ctrl_c:
            seed_run.train(ctrl_c)
            ctrl_c.release()  # predicting: Ctrl-C interrupts (KeyboardInterrupt)
            return seed_run.predict_with_best()
    finally:
        checkpointer.close()
        if seed_run.writer:
            seed_run.writer.close()


class SeedRun(loop.Loop):
    """One seed's fine-tuning on the loop skeleton (bertjax.training.loop): its state, where it
    stands (step, epoch, best epoch so far), its step and the actions after each step."""

    def __init__(
        self,
        settings: FinetuneSettings,
        record: SeedRecord,
        trainer: finetune_trainer.Trainer,
        data: dict[str, SplitData],
        workdir: str,
        checkpointer: checkpoint.Checkpointer,
    ) -> None:
        self.settings, self.trainer, self.data, self.seed = settings, trainer, data, record.seed
        self.workdir, self.checkpointer, self.task = workdir, checkpointer, trainer.task
        self.total_steps, train, seed = trainer.total_steps, data["train"], record.seed
        self.meta = dataclasses.asdict(record)
        self.best: dict[str, Any] = {"epoch": -1}
        self.jsonl = os.path.join(workdir, "metrics.jsonl") if jax.process_index() == 0 else None
        self.ends = finetune_trainer.epoch_ends(
            len(train), settings.train_batch_size, self.total_steps
        )
        self.nonfinite = nonfinite.NonFiniteSteps(
            0,
            state_advice=(  # (warns, never stops)
                "an update of this run made them so from finite gradients: lower "
                "--config.learning_rate"
            ),
        )
        self.finished, latest = _finished(workdir), checkpointer.latest_step()
        self.state: TrainState | None = None
        if self.finished:
            self.best = {key: self.finished[f"best_{key}"] for key in ("epoch", "step")}
            self.best["dev"] = self.finished["dev"]
            console.chief_print(
                f"seed {seed}: finished (best epoch {self.best['epoch']}); "
                "predicting again with its best checkpoint"
            )
        elif latest is not None:
            self.state, position = resume.restore_exactly(
                checkpointer, latest, trainer.run.abstract_state, self.meta
            )
            self.best = position["best"]
            checkpointer.pin(self.best.get("step"))  # (none before the first epoch's end)
            console.chief_print(
                f"seed {seed}: resuming from {checkpointer.directory}/"
                f"{latest} (epoch {position['epoch']} of {len(self.ends)})"
            )
        else:
            self.state = _fresh_state(settings, trainer, seed)
        if not self.finished:
            _keep_rows_up_to(self.jsonl, latest or 0)
        self.writer = metrics_writer.open_writer(workdir)
        self.step = self.first_step = latest or 0
        self.batches = finetune_trainer.shuffled_batches(
            np.random.default_rng(seed), len(train), settings.train_batch_size
        )
        for _ in range(self.step):  # the batches already trained on
            next(self.batches)
        console.chief_print(
            f"seed {seed}: {len(train)} training rows, {self.total_steps} steps "
            f"({len(train) / settings.train_batch_size:.1f}/epoch), "
            f"{count_params(trainer.run.abstract_state.params):,} parameters"
        )
        self.sums: dict[str, Any] = {}
        self.steps_summed, self.started = 0, time.time()
        self.clock, self.eval_seconds = reporting.StepClock(), 0.0

    def epoch(self, step: int) -> int:
        """The epoch (from 0) that step `step` (steps done) ends or is inside of."""
        return bisect.bisect_left(self.ends, step)

    def eta(self) -> float | None:
        """Steps left at the measured rate (compile excluded), plus the dev evaluations left."""
        seconds = self.clock.seconds_per_step("train")
        return (
            None
            if seconds is None
            else seconds * (self.total_steps - self.step)
            + self.eval_seconds * (len(self.ends) - self.epoch(self.step))
        )

    def save(self, epochs_done: int) -> None:
        """Saves the state at `step` with `epochs_done` epochs done (a stop within the next)."""
        assert self.state is not None  # (set in __init__: restored or fresh)
        loop.save(
            self.checkpointer,
            self.nonfinite,
            self.step,
            self.state,
            {"epoch": epochs_done, "best": self.best},
            self.meta,
            force=True,
        )

    def train(self, ctrl_c: failures.CtrlC) -> None:
        """The steps left, on the loop skeleton; after Ctrl-C, a save, then Stopped."""
        _, stopped = self.train_steps(
            self.step,
            self.step if self.finished else self.total_steps,
            ctrl_c,
            self.settings.profile_steps,
            os.path.join(self.workdir, "profile"),
        )
        if stopped:
            self.checkpointer.wait()
            console.chief_print(
                failures.stopped_line(
                    f"seed {self.seed} step {self.step} of {self.total_steps}", stopped
                )
            )
            raise failures.Stopped(stopped)

    def actions(self, ctrl_c: failures.CtrlC) -> list[loop.Periodic]:
        """Loss lines, the status bar, each epoch's end, the stop request."""
        return [
            loop.Periodic(self.log, self.settings.log_every, at={self.total_steps}),
            loop.Periodic(
                lambda step: console.TERMINAL.show(
                    reporting.status_bar(step, self.total_steps, self.eta())
                )
            ),
            loop.Periodic(self.end_epoch, 0, at=set(self.ends)),
            loop.Periodic(lambda step: self.stop_request(ctrl_c, step)),
        ]

    def train_step(self, index: int) -> None:
        rows = next(self.batches)
        batch = sharding.global_batch_from_host(
            finetune_trainer.host_batch(self.data["train"], rows, self.settings.train_batch_size),
            self.trainer.run.mesh,
        )
        self.state, metrics = self.trainer.run.train_step(self.state, batch)
        self.step = index + 1
        # Summed on the device: the host waits for a step only when it logs.
        self.sums = _add_metrics(self.sums, metrics)
        self.steps_summed += 1
        if self.step == self.first_step + 1:  # compiled and run: the clock starts here
            jax.block_until_ready(metrics)
            self.clock.tick("train", self.step)

    def log(self, step: int) -> None:
        sums = jax.device_get(self.sums)
        self.clock.tick("train", step)
        means = {
            "loss": float(sums["loss_sum"] / max(sums["count"], 1.0)),
            "grad_norm": float(sums["grad_norm"]) / self.steps_summed,
            "learning_rate": self.trainer.learning_rate(step - 1),
        }
        left = self.eta()
        console.chief_print(
            f"seed {self.seed} step {step}/{self.total_steps} loss {means['loss']:.4f} "
            f"lr {means['learning_rate']:.3e} ({time.time() - self.started:.0f}s"
            + (f", eta {reporting.duration(left)})" if left is not None else ")")
        )
        self.nonfinite.add_counted(
            step, int(sums["skipped"]), self.steps_summed, f"seed {self.seed}: "
        )
        metrics_writer.write(self.writer, self.jsonl, "train", step, means, split="train")
        self.sums, self.steps_summed = {}, 0

    def end_epoch(self, step: int) -> None:
        """The dev evaluation of the epoch that ends at `step`, the best so far, a save."""
        epoch, task = self.epoch(step), self.task
        stopping.now_doing(f"evaluating epoch {epoch + 1}")
        evaluated = time.time()
        dev = {
            name: task.evaluate(self.data[name], self.predict(name)) for name in task.eval_splits
        }
        self.eval_seconds = time.time() - evaluated
        self.clock.restart()  # the evaluation was no training step
        self.clock.tick("train", step)
        for name, values in dev.items():
            console.chief_print(
                f"seed {self.seed} epoch {epoch + 1} {name}: "
                + " ".join(
                    f"{k} {metric_value(k, v, task.percent_metrics)}" for k, v in values.items()
                )
            )
            metrics_writer.write(
                self.writer, self.jsonl, f"eval_{name}", step, values, epoch=epoch + 1, split=name
            )
        score = dev[task.eval_splits[0]][task.main_metric]
        if self.best["epoch"] < 0 or score > self.best["score"]:
            self.best = {"epoch": epoch + 1, "step": step, "score": score, "dev": dev}
            console.chief_print(
                f"seed {self.seed} epoch {epoch + 1}: best {task.main_metric} so far"
            )
        self.checkpointer.pin(self.best["step"])
        self.save(epoch + 1)

    def stop_request(self, ctrl_c: failures.CtrlC, step: int) -> int:
        """After Ctrl-C: a save at `step` (an epoch's end has saved already; a rerun predicts
        after the last), then SIGINT."""
        stopped = loop.stop_request(ctrl_c, step)
        if stopped and step not in self.ends:
            loop.announce_stop(ctrl_c, step)
            self.save(self.epoch(step))
        return stopped

    def predict(self, split: str) -> Any:
        assert self.state is not None  # (set in __init__: restored or fresh)
        return finetune_trainer.predict(
            self.trainer.run.eval_step,
            self.state.params,
            self.data[split],
            self.settings.eval_batch_size,
            self.trainer.run.mesh,
        )

    def predict_with_best(self) -> dict[str, Any]:
        """The best epoch's predictions and the seed's summary (its summary.json, which marks
        it finished); every checkpoint but the best one deleted."""
        checkpointer, best, task, workdir = self.checkpointer, self.best, self.task, self.workdir
        checkpointer.wait()
        if self.state is None or best["step"] != self.step:
            self.state, _ = resume.restore_exactly(
                checkpointer, best["step"], self.trainer.run.abstract_state, self.meta
            )
        outputs, scored_tests = {}, {}
        folder = os.path.join(workdir, "predictions")
        files.makedirs(folder)
        for name in [n for n in task.test_splits if n in self.data]:
            test_outputs = self.predict(name)
            outputs[name] = task.write_predictions(self.data[name], test_outputs, folder)
            if name in task.scored_test_splits:
                scored_tests[name] = task.evaluate(self.data[name], test_outputs)
        if not task.test_splits:  # SQuAD: the best epoch's dev predictions
            first = task.eval_splits[0]
            outputs["dev"] = task.write_predictions(self.data[first], self.predict(first), folder)
        result = {
            "seed": self.seed,
            "best_epoch": best["epoch"],
            "best_step": best["step"],
            "dev": best["dev"],
            "test": scored_tests,
            "predictions": outputs,
            "seconds": round(time.time() - self.started, 1),
        }
        if jax.process_index() == 0:  # (marks the seed as finished)
            files.write_text(os.path.join(workdir, "summary.json"), json.dumps(result, indent=1))
        for other in set(checkpointer.all_steps()) - {best["step"]}:
            checkpointer.delete(other)
        console.chief_print(
            f"seed {self.seed}: best epoch {best['epoch']} kept, checkpoint "
            f"step {best['step']} -> {checkpointer.directory}/{best['step']}"
        )
        return result
