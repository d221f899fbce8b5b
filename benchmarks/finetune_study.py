"""The fine-tuning study: a pretrained checkpoint vs the same architecture from random
initialisation on SST-2, MRPC and CoNLL-2003, three seeds each, on CPU.

    python benchmarks/finetune_study.py --init_checkpoint=PRETRAIN_WORKDIR --out=STUDY_DIR \
        [--inits=pretrained,random] [--tasks=sst2,mrpc,conll2003] [--extra="--config.X=Y"]
    python benchmarks/finetune_study.py --out=STUDY_DIR[,STUDY_DIR...] --table=benchmarks/finetune_study

Each (task, init) pair is one `python -m bertjax.finetune` command (printed and recorded) with
`--config.seeds=1,2,3`; `--table` collects their summary.json files into a Markdown table and
a JSON file. Given several study directories (e.g. one per learning rate), it reports for each
task and init the learning rate with the best mean dev score, as the paper chose its
fine-tuning learning rate on dev. The random-init runs take the checkpoint's architecture
and tokenizer, not its weights (`--config.random_init=True`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

# The shared data sets (glue/, conll2003/, gutenberg/): the directory $DATA names, else ./data.
DATA = os.environ.get("DATA", "data")
TASK_DIRS = {"sst2": "glue", "mrpc": "glue", "conll2003": "conll2003"}


def missing_data(tasks: list[str], books: bool = False) -> str | None:
    """The first data set that the study's `tasks` (and with `books`, the Gutenberg books)
    need and $DATA does not hold, as one line saying what to set; None when all are there."""
    needed = [f"{DATA}/{TASK_DIRS[t]}" for t in tasks if t in TASK_DIRS]
    for path in needed + ([f"{DATA}/gutenberg"] if books else []):
        if not glob.glob(os.path.join(path, "*")):
            return (
                f"{path} is missing or empty: set DATA to the directory that holds gutenberg/, "
                f"glue/ and conll2003/ (now {'DATA=' + DATA if 'DATA' in os.environ else './data'}"
                "; docs/probing-and-ablations.md)"
            )
    return None


# The study's settings: the original defaults (batch 32, 3 epochs, 10% warmup, BertAdam,
# dropout 0.1) except peak lr 1e-4 (the small-BERT recommendation), shorter sequences where the
# task's texts fit, and a fixed random 8000-example subset of SST-2's 67k (CPU time).
COMMON = [
    "--config.seeds=1,2,3",
    "--config.num_train_epochs=3",
    "--config.learning_rate=1e-4",
    "--config.log_every=50",
]
TASKS = {
    "sst2": [
        "--config=configs/finetune/glue.py",
        "--config.task=sst2",
        f"--config.data_dir={DATA}/glue",
        "--config.max_seq_length=64",
        "--config.max_train_examples=8000",
    ],
    "mrpc": [
        "--config=configs/finetune/glue.py",
        "--config.task=mrpc",
        f"--config.data_dir={DATA}/glue",
        "--config.max_seq_length=128",
    ],
    "conll2003": [
        "--config=configs/finetune/ner.py",
        f"--config.data_dir={DATA}/conll2003",
        "--config.max_seq_length=64",
    ],
}
METRICS = {"sst2": ["dev/accuracy"], "mrpc": ["dev/f1", "dev/accuracy"], "conll2003": ["dev/f1"]}


def command(task: str, init: str, checkpoint: str, out: str, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bertjax.finetune",
        *TASKS[task],
        *COMMON,
        *extra,
        f"--config.init_checkpoint={checkpoint}",
        f"--workdir={out}/{task}_{init}",
    ] + (["--config.random_init=True"] if init == "random" else [])


def run(args) -> None:
    for task in args.tasks.split(","):
        for init in args.inits.split(","):
            cmd = command(task, init, args.init_checkpoint, args.out, args.extra.split())
            print("+ " + shlex.join(cmd), flush=True)
            with open(os.path.join(args.out, "commands.txt"), "a") as f:
                f.write(shlex.join(cmd) + "\n")
            subprocess.run(cmd, check=True)


def learning_rate(run_dir: str, summary: dict) -> float:
    """The peak learning rate a fine-tuning run used (summary.json's config, or for runs from
    before it recorded one, the config in a kept checkpoint's metadata)."""
    if "config" in summary:
        return float(summary["config"]["learning_rate"])
    metadata = sorted(
        glob.glob(os.path.join(run_dir, "seed_*", "checkpoints", "*", "meta", "metadata"))
    )
    return float(json.loads(json.load(open(metadata[0]))["config"])["learning_rate"])


def best_runs(
    out_dirs: list[str], task: str, init: str
) -> tuple[dict | None, list[tuple[float, float]]]:
    """Among the study directories that ran (task, init), the summary with the best mean main
    metric (the paper picks each task's learning rate on dev), and every (lr, mean) tried."""
    main_metric, tried, best = METRICS[task][0], [], None
    for out in out_dirs:
        run_dir = os.path.join(out, f"{task}_{init}")
        if not os.path.exists(os.path.join(run_dir, "summary.json")):
            continue
        summary = json.loads(Path(os.path.join(run_dir, "summary.json")).read_text())
        summary["learning_rate"] = learning_rate(run_dir, summary)
        tried.append((summary["learning_rate"], summary["summary"][main_metric]["mean"]))
        if best is None or tried[-1][1] > best["summary"][main_metric]["mean"]:
            best = summary
    return best, sorted(tried)


def table(args) -> None:
    out_dirs = args.out.split(",")
    rows, grid, record = [], [], {}
    for task, metric_names in METRICS.items():
        best = {init: best_runs(out_dirs, task, init) for init in ("pretrained", "random")}
        for init, (_, tried) in best.items():
            if tried:
                grid.append(
                    f"| {task} | {init} | "
                    + ", ".join(f"{lr:g}: {100 * mean:.1f}" for lr, mean in tried)
                    + " |"
                )
        for metric in metric_names:
            cells = []
            for init, (summary, _) in best.items():
                if summary is None:
                    cells.append("not run")
                    continue
                stats = summary["summary"][metric]
                record[f"{task}/{init}/{metric}"] = {
                    **stats,
                    "train_examples": summary["train_examples"],
                    "learning_rate": summary["learning_rate"],
                }
                values = ", ".join(f"{100 * v:.1f}" for v in stats["values"])
                cells.append(
                    f"{100 * stats['mean']:.1f} ± {100 * stats['std']:.1f} "
                    f"(lr {summary['learning_rate']:g}; median {100 * stats['median']:.1f}; {values})"
                )
            rows.append(f"| {task} | {metric} | {cells[0]} | {cells[1]} |")
    with open(args.table + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print("| task | dev metric | pretrained | random init |\n|---|---|---|---|\n" + "\n".join(rows))
    print(
        "\nMean dev main metric per learning rate:\n\n| task | init | lr: mean |\n|---|---|---|\n"
        + "\n".join(grid)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init_checkpoint", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inits", default="pretrained,random")
    parser.add_argument("--tasks", default="sst2,mrpc,conll2003")
    parser.add_argument("--table", default="")
    parser.add_argument("--extra", default="", help="more flags, e.g. --config.learning_rate=5e-4")
    parsed = parser.parse_args()
    if parsed.table:
        table(parsed)
    else:
        os.makedirs(parsed.out, exist_ok=True)
        run(parsed)
