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

import contextlib
import dataclasses
import json
import os
import sys
from typing import Any

import jax
import ml_collections
from absl import flags, logging
from ml_collections import config_flags

from bertjax import cli
from bertjax.errors import UserError
from bertjax.interop import native, pretrained
from bertjax.models import families
from bertjax.runtime import console, failures, files, locks
from bertjax.tasks import metrics
from bertjax.training import finetune_loop, finetune_setup, validate
from bertjax.training.finetune_settings import FinetuneSettings


def run(
    config: ml_collections.ConfigDict,
    workdir: str,
    devices: list[jax.Device] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Fine-tunes every seed in `config.seeds` (each in `workdir/seed_N`) and writes
    `workdir/summary.json`; returns it. The same command again resumes an interrupted run,
    or predicts again with a finished one's best checkpoints; `workdir` is locked meanwhile.
    A `workdir` of a run with other settings is refused unless `overwrite`."""
    validate.finetuning(config)
    settings = FinetuneSettings.of(config.to_dict(), config.to_json())  # (typed, built once)
    if settings.init_checkpoint:  # (before the workdir is made: a mistake creates nothing)
        pretrained.check_exists(settings.init_checkpoint, "init_checkpoint")
    with locks.held_workdir(workdir, jax.process_index()), contextlib.ExitStack() as accepted:
        if jax.process_index() == 0:
            finetune_loop.check_workdir(settings.as_json, workdir, overwrite)
        return _run(settings, workdir, devices, accepted)


def _run(
    settings: FinetuneSettings,
    workdir: str,
    devices: list[jax.Device] | None,
    accepted: contextlib.ExitStack,
) -> dict[str, Any]:
    """The run in its locked `workdir`; once its settings and inputs are accepted, it writes
    config.json and its log file (held open by `accepted`)."""
    source = settings.source
    pretrain = pretrained.pretraining_run(source)
    model_config = pretrained.model_config_of(source, pretrain)
    finetune_setup.check_model(settings, pretrain, model_config)  # (before any work)
    tokenizer = pretrained.tokenizer_of(source, pretrain)
    finetune_setup.check_tokenizer(settings, tokenizer, model_config)
    mesh = finetune_setup.make_mesh(settings, devices)
    if pretrain.finetuned_task:
        console.chief_print(
            f"init_checkpoint {settings.init_checkpoint} was fine-tuned on "
            f"{pretrain.finetuned_task}: this run starts from its encoder, "
            "with a new output layer"
        )
    task = finetune_setup.make_task(settings, tokenizer)
    data = finetune_setup.load_splits(task)
    trainer = finetune_setup.make_trainer(
        settings, task, model_config, task.num_train_examples(data["train"]), mesh
    )
    record = finetune_loop.SeedRecord(
        settings.task,
        0,
        settings.as_json,
        families.as_record(model_config),
        tokenizer.fingerprint(),
    )
    accepted.enter_context(console.logging_to(console.log_file(workdir)))  # (once accepted)
    if jax.process_index() == 0:
        files.write_text(
            os.path.join(workdir, "config.json"), json.dumps(settings.as_dict, indent=1)
        )
        tokenizer_files = native.save_tokenizer(tokenizer, workdir)  # (the model stands alone)
    results = [
        finetune_loop.train_one_seed(
            settings,
            dataclasses.replace(record, seed=seed),
            trainer,
            data,
            os.path.join(workdir, f"seed_{seed}"),
        )
        for seed in settings.seeds
    ]
    baselines = {
        name: found
        for name in task.eval_splits
        if (found := task.baseline(data["train"], data[name]))
    }
    stats = metrics.summarize_seeds(results)
    summary = {
        "task": settings.task,
        "init_checkpoint": settings.init_checkpoint,
        "random_init": bool(settings.random_init),
        "main_metric": task.main_metric,
        "train_examples": len(data["train"]),
        "skipped": {name: split.skipped for name, split in data.items()},
        "seeds": results,
        "summary": stats,
        "baselines": {
            name: {"predicts": how, **values} for name, (how, values) in baselines.items()
        },
        "config": settings.as_dict,
    }
    if jax.process_index() == 0:
        files.write_text(os.path.join(workdir, "summary.json"), json.dumps(summary, indent=1))
        lines, warnings = metrics.summary_lines(
            settings.task, stats, len(results), baselines, task.percent_metrics
        )
        print("\n".join(lines), flush=True)
        for warning in warnings:
            logging.warning("%s", warning)
        print(outputs_listing(workdir, results, tokenizer_files), flush=True)
    return summary


def outputs_listing(workdir: str, results: list[dict[str, Any]], tokenizer_files: list[str]) -> str:
    """The run's outputs, each named once: the workdir's files, then per seed its folder's
    (the best epoch's checkpoint, the predictions, its summary and logs)."""
    lines = [
        f"Outputs in {workdir}: summary.json, config.json, "
        f"{os.path.basename(console.log_file(workdir))}, tokenizer "
        f"{' + '.join(tokenizer_files)}"
    ]
    for result in results:
        folder = f"seed_{result['seed']}"
        lines.append(
            f"  {folder}/: checkpoints/{result['best_step']} (best epoch "
            f"{result['best_epoch']}), "
            + "".join(
                f"{os.path.relpath(path, os.path.join(workdir, folder))}, "
                for path in result["predictions"].values()
            )
            + "summary.json, metrics.jsonl, tensorboard/"
        )
    return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "configs/finetune/*.py", lock_config=True)
    flags.DEFINE_string("workdir", None, "output directory (checkpoints, predictions, summary)")
    flags.DEFINE_bool("overwrite", False, "replace the run in --workdir if it has other settings")
    flags.mark_flags_as_required(["config", "workdir"])


def main(argv: list[str]) -> None:
    del argv
    failures.one_line_thread_errors()
    try:
        run(FLAGS.config, FLAGS.workdir, overwrite=FLAGS.overwrite)
    except failures.Stopped as e:  # (its last line said so)
        sys.exit(e.status)
    except KeyboardInterrupt:
        cli.leave(
            "interrupted (Ctrl-C) outside the training steps; rerun the same command to "
            "resume from the last checkpoint",
            130,
            at_once=True,
        )
    except (UserError, OSError) as e:
        cli.leave_on(e, FLAGS.workdir)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
