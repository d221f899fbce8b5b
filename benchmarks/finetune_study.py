"""The fine-tuning study: a pretrained checkpoint vs the same architecture from random
initialisation on SST-2, MRPC and CoNLL-2003, three seeds each, on CPU.

    python benchmarks/finetune_study.py --init_checkpoint=PRETRAIN_WORKDIR --out=STUDY_DIR \
        [--inits=pretrained,random] [--tasks=sst2,mrpc,conll2003] [--extra="--config.X=Y"]
    python benchmarks/finetune_study.py --out=STUDY_DIR --table=benchmarks/finetune_study

Each (task, init) pair is one `python -m bertjax.finetune` command (printed and recorded) with
`--config.seeds=1,2,3`; `--table` collects their summary.json files into a Markdown table and
a JSON file. The random-init runs take the checkpoint's architecture and tokenizer, not its
weights (`--config.random_init=True`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys

DATA = "/work/shared/data"
# The study's settings: the original defaults (batch 32, 3 epochs, 10% warmup, BertAdam,
# dropout 0.1) except peak lr 1e-4 (the small-BERT recommendation), shorter sequences where the
# task's texts fit, and a fixed random 8000-example subset of SST-2's 67k (CPU time).
COMMON = ["--config.seeds=1,2,3", "--config.num_train_epochs=3", "--config.learning_rate=1e-4",
          "--config.log_every=50"]
TASKS = {
    "sst2": ["--config=configs/finetune/glue.py", "--config.task=sst2",
             f"--config.data_dir={DATA}/glue", "--config.max_seq_length=64",
             "--config.max_train_examples=8000"],
    "mrpc": ["--config=configs/finetune/glue.py", "--config.task=mrpc",
             f"--config.data_dir={DATA}/glue", "--config.max_seq_length=128"],
    "conll2003": ["--config=configs/finetune/ner.py", f"--config.data_dir={DATA}/conll2003",
                  "--config.max_seq_length=64"],
}
METRICS = {"sst2": ["dev/accuracy"], "mrpc": ["dev/f1", "dev/accuracy"], "conll2003": ["dev/f1"]}


def command(task: str, init: str, checkpoint: str, out: str, extra: list[str]) -> list[str]:
    return ([sys.executable, "-m", "bertjax.finetune", *TASKS[task], *COMMON, *extra,
             f"--config.init_checkpoint={checkpoint}", f"--workdir={out}/{task}_{init}"]
            + (["--config.random_init=True"] if init == "random" else []))


def run(args) -> None:
    for task in args.tasks.split(","):
        for init in args.inits.split(","):
            cmd = command(task, init, args.init_checkpoint, args.out, args.extra.split())
            print("+ " + shlex.join(cmd), flush=True)
            with open(os.path.join(args.out, "commands.txt"), "a") as f:
                f.write(shlex.join(cmd) + "\n")
            subprocess.run(cmd, check=True)


def table(args) -> None:
    rows, record = [], {}
    for task, metric_names in METRICS.items():
        for metric in metric_names:
            cells = []
            for init in ("pretrained", "random"):
                path = os.path.join(args.out, f"{task}_{init}", "summary.json")
                if not os.path.exists(path):
                    cells.append("not run")
                    continue
                summary = json.load(open(path))
                stats = summary["summary"][metric]
                record[f"{task}/{init}/{metric}"] = {**stats, "train_examples": summary["train_examples"]}
                values = ", ".join(f"{100 * v:.1f}" for v in stats["values"])
                cells.append(f"{100 * stats['mean']:.1f} ± {100 * stats['std']:.1f} "
                             f"(median {100 * stats['median']:.1f}; {values})")
            rows.append(f"| {task} | {metric} | {cells[0]} | {cells[1]} |")
    with open(args.table + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print("| task | dev metric | pretrained | random init |\n|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--init_checkpoint", default="")
    parser.add_argument("--out", required=True)
    parser.add_argument("--inits", default="pretrained,random")
    parser.add_argument("--tasks", default="sst2,mrpc,conll2003")
    parser.add_argument("--table", default="")
    parser.add_argument("--extra", default="", help="more flags, e.g. --config.learning_rate=5e-4")
    parsed = parser.parse_args()
    os.makedirs(parsed.out, exist_ok=True)
    table(parsed) if parsed.table else run(parsed)
