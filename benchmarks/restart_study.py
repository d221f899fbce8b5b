"""Phase 2 with and without the original code's optimizer restart (issue 25) at CPU scale:
configs/tiny.py on the shared Gutenberg books, phase 1 at length 128 then phase 2 at 512,
`long_phase.restart_optimizer` off ("continue") and on ("restart"), several seeds; the
held-out MLM accuracy at the end of phase 2 and the loss curve around the switch.

    python benchmarks/restart_study.py --books="$DATA/gutenberg/*.txt" --out=STUDY_DIR \
        [--steps=500] [--long_fraction=0.1] [--seeds=1,2,3] [--lr=5e-4]
    python benchmarks/restart_study.py --out=STUDY_DIR --table=benchmarks/restart_study.json

Every run is one `python -m bertjax.train` (printed and appended to STUDY_DIR/commands.txt;
a finished run is skipped when the command is run again), all on one data cache, so every
run has the same held-out split, batches and masks (data.seed); the seed is train.seed
(the initial weights). The restart arm's phase-2 warmup is 10% of phase 2, the original's
ratio (10k warmup steps in its 100k-step second run). `--table` writes the JSON record and
prints the Markdown tables of restart_study.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ablation_study import books_pretrain_command, run_once

ARMS = ("continue", "restart")


def phase_steps(args) -> tuple[int, int]:
    """(phase-1 steps, phase-2 steps), as bertjax.training.phase_schedule splits `--steps`."""
    long_steps = round(args.steps * args.long_fraction)
    return args.steps - long_steps, long_steps


def command(arm: str, seed: int, args) -> list[str]:
    switch, long_steps = phase_steps(args)
    restart = (
        []
        if arm == "continue"
        else [
            "--config.long_phase.restart_optimizer=True",
            f"--config.long_phase.restart_warmup_steps={max(1, long_steps // 10)}",
        ]
    )
    return [
        *books_pretrain_command(
            f"{args.out}/{arm}/seed{seed}", f"{args.out}/data", args.books, args.steps, args.lr
        ),
        "--config.data.max_seq_length=128",
        "--config.data.max_predictions_per_seq=20",
        f"--config.long_phase.fraction={args.long_fraction}",
        "--config.long_phase.max_seq_length=512",
        "--config.long_phase.max_predictions_per_seq=80",
        f"--config.train.eval_every={switch}",
        "--config.train.eval_batches=20",
        "--config.train.log_every=10",
        f"--config.train.seed={seed}",
        *restart,
    ]


def run(args) -> None:
    if not args.books:
        sys.exit(
            "restart_study.py: --books is required to run (e.g. "
            '--books="$DATA/gutenberg/*.txt"); only --table reads finished runs without it'
        )
    os.makedirs(args.out, exist_ok=True)
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm in ARMS:
            run_once(
                command(arm, seed, args),
                f"{args.out}/{arm}/seed{seed}/final_metrics.json",
                args.out,
            )


def read_run(workdir: str) -> dict:
    """A finished run's eval rows (switch and end) and train rows (the loss curve)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals = [r for r in rows if r["split"] == "eval"]
    keep = ("step", "phase", "loss", "mlm_loss", "mlm_accuracy", "learning_rate")
    return {
        "eval_at_switch": evals[0] if len(evals) > 1 else None,
        "final": evals[-1],
        "train": [{k: r[k] for k in keep if k in r} for r in rows if r["split"] == "train"],
    }


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "min": min(values),
        "max": max(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def table(args) -> None:
    record = {"arms": {}}
    for arm in ARMS:
        root = os.path.join(args.out, arm)
        seeds = sorted(
            d
            for d in os.listdir(root)
            if os.path.exists(os.path.join(root, d, "final_metrics.json"))
        )
        runs = {d: read_run(os.path.join(root, d)) for d in seeds}
        record["arms"][arm] = {
            "runs": runs,
            "final_mlm_accuracy": spread([r["final"]["mlm_accuracy"] for r in runs.values()]),
            "final_mlm_loss": spread([r["final"]["mlm_loss"] for r in runs.values()]),
            "switch_mlm_accuracy": spread(
                [r["eval_at_switch"]["mlm_accuracy"] for r in runs.values()]
            ),
        }
    with open(args.table, "w") as f:
        json.dump(record, f, indent=1)
    print(
        "| arm | seeds | held-out MLM acc, end of phase 2 (x100) | per seed | held-out MLM "
        "loss | per seed | held-out MLM acc at the switch (phase 1) |\n|---|---|---|---|---|"
        "---|---|"
    )
    for arm, entry in record["arms"].items():
        acc, loss, sw = (
            entry[k] for k in ("final_mlm_accuracy", "final_mlm_loss", "switch_mlm_accuracy")
        )
        print(
            f"| {arm} | {', '.join(entry['runs'])} | {100 * acc['mean']:.2f} ± "
            f"{100 * acc['std']:.2f} | {', '.join(f'{100 * v:.2f}' for v in acc['values'])} | "
            f"{loss['mean']:.3f} ± {loss['std']:.3f} | "
            f"{', '.join(f'{v:.3f}' for v in loss['values'])} | "
            f"{100 * sw['mean']:.2f} ± {100 * sw['std']:.2f} |"
        )
    curve_table(record)


def curve_table(record: dict, before: int = 50) -> None:
    """Training MLM loss (mean over seeds) and learning rate per logged step from `before`
    steps before the switch to the end (the whole curve is in the JSON record)."""
    rows = next(iter(record["arms"]["continue"]["runs"].values()))["train"]
    switch = min(r["step"] for r in rows if r["phase"] == "long")
    print(
        "\n| step (phase) | "
        + " | ".join(f"{arm}: train MLM loss | {arm}: lr" for arm in ARMS)
        + " |\n|---"
        + "|---|---" * len(ARMS)
        + "|"
    )
    for index, step in enumerate(r["step"] for r in rows):
        if step < switch - before:
            continue
        cells = []
        for arm in ARMS:
            rows = [run["train"][index] for run in record["arms"][arm]["runs"].values()]
            cells += [
                f"{statistics.mean(r['mlm_loss'] for r in rows):.3f}",
                f"{rows[0]['learning_rate']:.2e}",
            ]
        print(f"| {step} ({rows[0]['phase']}) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--books", default="", help="glob of the books, e.g. $DATA/gutenberg/*.txt")
    parser.add_argument("--steps", type=int, default=500, help="steps per run, both phases")
    parser.add_argument("--long_fraction", type=float, default=0.1, help="phase-2 share")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak lr (both schedules)")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--table", default="", help="write this JSON record; print the tables")
    parsed = parser.parse_args()
    table(parsed) if parsed.table else run(parsed)
