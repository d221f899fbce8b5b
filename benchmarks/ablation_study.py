"""The paper's pretraining ablations at CPU scale: one small model per row of Table 5 (No NSP,
LTR & No NSP) and Table 8 (the masking mix), pretrained under the same budget, each fine-tuned
on SST-2, MRPC and CoNLL-2003 with several seeds.

    python benchmarks/ablation_study.py --out=STUDY_DIR [--rows=paper,no_nsp,...] \
        [--steps=1500] [--seeds=1,2,3] [--train_examples=1000] [--epochs=3]
    python benchmarks/ablation_study.py --out=STUDY_DIR --table=benchmarks/ablation_study_table

Each row is one `python -m bertjax.train` (configs/tiny.py on the shared Gutenberg books,
dynamic masking, length 64) and one `python -m bertjax.finetune` per task (printed and
appended to STUDY_DIR/commands.txt); a finished step is skipped when the command is run
again. All rows share one data cache (one SentencePiece model). `random_init` fine-tunes the
paper row's architecture and tokenizer without its weights: the floor pretraining must beat.
`--table` writes TABLE.md, TABLE.json and TABLE.png (mean ± std over seeds per task and row).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import finetune_study  # (the fine-tuning tasks' data and settings)

GUTENBERG = os.path.join(finetune_study.DATA, "gutenberg", "*.txt")
# Row -> (pretraining overrides, description). "paper" is the paper's recipe.
ROWS = {
    "paper": ([], "MLM 80/10/10 + NSP (the paper)"),
    "random_init": (None, "no pretraining (paper row's architecture, random weights)"),
    "no_nsp": (["--config.train.next_sentence_prediction=False"], "No NSP (Table 5)"),
    "ltr_no_nsp": (["--config.train.objective=ltr"], "LTR & No NSP (Table 5)"),
    "mask_100_0_0": (
        ["--config.data.mask_token_prob=1.0", "--config.data.random_token_prob=0.0"],
        "100% [MASK] (Table 8)",
    ),
    "mask_80_0_20": (
        ["--config.data.mask_token_prob=0.8", "--config.data.random_token_prob=0.0"],
        "80/0/20 (Table 8)",
    ),
    "mask_80_20_0": (
        ["--config.data.mask_token_prob=0.8", "--config.data.random_token_prob=0.2"],
        "80/20/0 (Table 8)",
    ),
    "mask_0_20_80": (
        ["--config.data.mask_token_prob=0.0", "--config.data.random_token_prob=0.2"],
        "0/20/80 (Table 8)",
    ),
    "mask_0_0_100": (
        ["--config.data.mask_token_prob=0.0", "--config.data.random_token_prob=0.0"],
        "0/0/100 (Table 8)",
    ),
    "rate_10": (["--config.data.masked_lm_prob=0.10"], "masking rate 10%"),
    # 20% of 64 tokens is 13 predictions: raise the cap of 10 (else full rows stay at 10, 15.6%).
    "rate_20": (
        ["--config.data.masked_lm_prob=0.20", "--config.data.max_predictions_per_seq=13"],
        "masking rate 20%",
    ),
}


def books_pretrain_command(
    workdir: str, cache_dir: str, books: str, steps: int, lr: float, config: str = "configs/tiny.py"
) -> list[str]:
    """The `python -m bertjax.train` flags that the CPU studies on the shared books share:
    `config` (configs/tiny.py; or configs/modernbert_tiny.py, whose dropout is already 0),
    dynamic masking, dropout 0, batch 32, `steps` steps at peak `lr` with 10% warmup, one
    checkpoint at the end. Each study adds its lengths, phases and evaluation."""
    no_dropout = (
        []
        if "modernbert" in config
        else [
            "--config.model.hidden_dropout_prob=0",
            "--config.model.attention_probs_dropout_prob=0",
        ]
    )
    return [
        sys.executable,
        "-m",
        "bertjax.train",
        f"--config={config}",
        f"--workdir={workdir}",
        "--config.data.source=text",
        f"--config.data.input_files={books}",
        f"--config.data.cache_dir={cache_dir}",
        "--config.data.masking=dynamic",
        "--config.data.num_workers=1",
        "--config.data.dupe_factor=2",
        *no_dropout,
        f"--config.train.total_steps={steps}",
        "--config.train.global_batch_size=32",
        f"--config.optimizer.peak_learning_rate={lr}",
        f"--config.optimizer.warmup_steps={steps // 10}",
        f"--config.train.checkpoint_every={steps}",
    ]


def pretrain_command(
    row: str, args, overrides: list[str] | None = None, config: str = "configs/tiny.py"
) -> list[str]:
    """Row `row`'s pretraining: the paper row's flags, then `overrides` (default: ROWS')."""
    return [
        *books_pretrain_command(
            f"{args.out}/pretrain/{row}", f"{args.out}/data", GUTENBERG, args.steps, args.lr, config
        ),
        "--config.data.max_seq_length=64",
        "--config.data.max_predictions_per_seq=10",
        "--config.long_phase.fraction=0",
        "--config.train.eval_every=0",
        "--config.train.eval_batches=20",
        "--config.train.log_every=100",
        *(ROWS[row][0] if overrides is None else overrides),
    ]


def finetune_command(row: str, task: str, args) -> list[str]:
    source = "paper" if row == "random_init" else row
    return (
        [
            sys.executable,
            "-m",
            "bertjax.finetune",
            *finetune_study.TASKS[task],
            f"--config.seeds={args.seeds}",
            f"--config.num_train_epochs={args.epochs}",
            f"--config.learning_rate={args.finetune_lr}",
            "--config.log_every=100",
            f"--config.max_train_examples={args.train_examples}",
            f"--config.max_seq_length={args.finetune_length}",
            f"--config.init_checkpoint={args.out}/pretrain/{source}",
            f"--workdir={args.out}/finetune/{row}/{task}",
        ]
        + (["--config.random_init=True"] if row == "random_init" else [])
        # The paper keeps the LTR model's left-only constraint at fine-tuning (section 5.1).
        + (
            ["--config.causal_attention=True"]
            if "--config.train.objective=ltr" in (ROWS.get(row, ([],))[0] or [])
            else []
        )
    )


def run_once(cmd: list[str], done_file: str, out: str) -> None:
    """Runs `cmd` (printed and appended to OUT/commands.txt) unless `done_file` exists."""
    if os.path.exists(done_file):
        print(f"= done: {done_file}", flush=True)
        return
    print("+ " + shlex.join(cmd), flush=True)
    with open(os.path.join(out, "commands.txt"), "a") as f:
        f.write(shlex.join(cmd) + "\n")
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: that step exited {e.returncode} (its output is above); rerun to go on")


def run(args) -> None:
    missing = finetune_study.missing_data(args.tasks.split(","), books=True)
    if missing:
        sys.exit(f"error: {missing}")
    os.makedirs(args.out, exist_ok=True)
    for row in args.rows.split(","):
        if ROWS[row][0] is not None:
            run_once(
                pretrain_command(row, args),
                f"{args.out}/pretrain/{row}/final_metrics.json",
                args.out,
            )
        for task in args.tasks.split(","):
            run_once(
                finetune_command(row, task, args),
                f"{args.out}/finetune/{row}/{task}/summary.json",
                args.out,
            )


def collect(out: str, rows: dict = ROWS) -> dict:
    """{row: {"pretraining": final_metrics, task: {metric: stats}}} of the finished runs of
    `rows` ({row: (overrides, description)})."""
    record = {}
    for row, (_, description) in rows.items():
        entry = {"description": description}
        final = os.path.join(out, "pretrain", row, "final_metrics.json")
        if os.path.exists(final):
            entry["pretraining"] = json.loads(Path(final).read_text())
        for task, metrics in finetune_study.METRICS.items():
            path = os.path.join(out, "finetune", row, task, "summary.json")
            if os.path.exists(path):
                summary = json.loads(Path(path).read_text())["summary"]
                entry[task] = {m: summary[m] for m in metrics}
        if len(entry) > 1:
            record[row] = entry
    return record


def table(args) -> None:
    record = collect(args.out)
    columns = [(task, m) for task, metrics in finetune_study.METRICS.items() for m in metrics]
    lines = [
        "| row | held-out MLM acc (LM acc for LTR) | "
        + " | ".join(f"{t} {m}" for t, m in columns)
        + " |",
        "|---" * (len(columns) + 2) + "|",
    ]
    for row, entry in record.items():
        pre = entry.get("pretraining", {})
        cells = [f"{100 * pre['mlm_accuracy']:.1f}" if "mlm_accuracy" in pre else "-"]
        lines.append(
            f"| {row}: {entry['description']} | "
            + " | ".join(cells + task_cells(entry, columns))
            + " |"
        )
    write_table(args.table, lines, record)
    plot(record, columns, args.table + ".png")


def task_cells(entry: dict, columns: list[tuple[str, str]]) -> list[str]:
    """A row's "mean ± std" (x100) per (task, metric) column, "-" where it did not run."""
    cells = []
    for task, metric in columns:
        stats = entry.get(task, {}).get(metric)
        cells.append(f"{100 * stats['mean']:.1f} ± {100 * stats['std']:.1f}" if stats else "-")
    return cells


def write_table(path: str, lines: list[str], record: dict) -> None:
    """Writes PATH.md (the Markdown `lines`) and PATH.json (`record`), and prints the table."""
    with open(path + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(path + ".json", "w") as f:
        json.dump(record, f, indent=1)
    print("\n".join(lines))


def plot(record: dict, columns: list[tuple[str, str]], path: str) -> None:
    """One panel per task metric: mean ± std over seeds for each row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(record)
    fig, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 4.5), sharey=False)
    for ax, (task, metric) in zip(axes, columns):
        means = [
            100 * record[r].get(task, {}).get(metric, {}).get("mean", float("nan")) for r in rows
        ]
        stds = [100 * record[r].get(task, {}).get(metric, {}).get("std", 0.0) for r in rows]
        ax.errorbar(range(len(rows)), means, yerr=stds, fmt="o", capsize=3)
        ax.set_xticks(range(len(rows)), rows, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{task} {metric}")
        ax.grid(alpha=0.3)
    fig.suptitle("Pretraining ablations at CPU scale (dev, mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def study_parser(description: str, rows: str, tasks: str, steps: int) -> argparse.ArgumentParser:
    """The command line of a pretrain-then-fine-tune study (this one's defaults after the
    row list, the tasks and the steps)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rows", default=rows)
    parser.add_argument("--tasks", default=tasks)
    parser.add_argument("--steps", type=int, default=steps, help="pretraining steps per row")
    parser.add_argument("--lr", type=float, default=5e-4, help="pretraining peak lr")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--train_examples", type=int, default=1000)
    parser.add_argument("--epochs", type=float, default=3)
    parser.add_argument("--finetune_length", type=int, default=64)
    parser.add_argument("--finetune_lr", type=float, default=3e-4)
    parser.add_argument("--table", default="")
    return parser


if __name__ == "__main__":
    parsed = study_parser(
        __doc__.splitlines()[0],
        "paper,random_init,no_nsp,ltr_no_nsp,mask_100_0_0,mask_80_0_20,"
        "mask_80_20_0,mask_0_20_80,mask_0_0_100",
        "sst2,mrpc,conll2003",
        1500,
    ).parse_args()
    table(parsed) if parsed.table else run(parsed)
