"""The paper's recipe against the modern one (ModernBERT) at CPU scale, at equal model FLOPs and
equal wall time, then each modern switch alone on top of the paper's recipe (issue 37).

    python benchmarks/modern_study.py --out=STUDY_DIR [--rows=paper,modern_flops,...] \
        [--steps=800] [--seeds=1,2,3] [--tasks=sst2,mrpc]
    python benchmarks/modern_study.py --out=STUDY_DIR --table=benchmarks/modern_study_table

Every row pretrains on the shared Gutenberg books at length 64 with the ablation study's flags
(`ablation_study.pretrain_command`: batch 32, peak lr 5e-4, 10% warmup, one phase) and is
fine-tuned like it (`ablation_study.finetune_command`). `paper` is ablation_study's paper row
(configs/tiny.py, MLM 15% + NSP, BERT Adam, linear decay) at `--steps`. `modern_flops` is
configs/modernbert_tiny.py with its recipe (30% masking, no NSP, packing, StableAdamW b2 .98
without clipping, warmup-stable-decay 1-sqrt) for as many steps as give the paper row's model
FLOPs (`bertjax.models.flops`, per row of 64 tokens, padding included: a packed row costs what an
unpacked one does and holds more real tokens). `modern_time` is the same for the paper row's
measured training wall time (log.txt, first step to last, compile included), scaled from
`modern_flops`' measured seconds per step, so it runs after both. The other rows add one
modern switch to the paper row at its steps. Commands go to STUDY_DIR/commands.txt; a
finished step is skipped when rerun. `--eval15` re-evaluates each finished row's final
checkpoint at 15% masking on unpacked rows (its own held-out split: the rows with NSP share
one, the rows without another), where held-out MLM accuracies compare. `--table` writes
TABLE.md and TABLE.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import runpy
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablation_study  # (the rows' shared pretraining and fine-tuning commands)
import finetune_study

MODERN = "configs/modernbert_tiny.py"
MODERN_MASKING = ["--config.data.max_predictions_per_seq=20"]  # 30% of 64 tokens is 19.2
# Row -> (pretraining overrides on the paper row, description).
ROWS = {
    "paper": ([], "BERT tiny, the paper's recipe (MLM 15% + NSP, BERT Adam, linear decay)"),
    "modern_flops": (
        MODERN_MASKING,
        "ModernBERT tiny + modern recipe, the paper row's model FLOPs",
    ),
    "modern_time": (MODERN_MASKING, "ModernBERT tiny + modern recipe, the paper row's wall time"),
    "mask_30": (["--config.data.masked_lm_prob=0.3", *MODERN_MASKING], "paper + 30% masking"),
    "no_nsp": (["--config.train.next_sentence_prediction=False"], "paper + no NSP"),
    "packing": (["--config.data.packing=True"], "paper + packed rows"),
    "stable_adamw": (
        [
            "--config.optimizer.name=stable_adamw",
            "--config.optimizer.b2=0.98",
            "--config.optimizer.clip_global_norm=0",
        ],
        "paper + StableAdamW (b2 .98, no global-norm clip)",
    ),
    "wsd": (
        [
            "--config.optimizer.schedule=wsd",
            "--config.optimizer.decay_fraction=0.1",
            "--config.optimizer.decay_shape=1-sqrt",
        ],
        "paper + WSD schedule (1-sqrt, last 10%)",
    ),
}
# Rows whose own held-out evaluation is at 15% on unpacked rows (no --eval15 needed).
SAME_EVAL = ("paper", "no_nsp", "stable_adamw", "wsd")
LOG_TIME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) console\] (Training steps|step \d+/)"
)


def flops_per_row(config_path: str, overrides: list[str]) -> int:
    """Model FLOPs of one pretraining row of 64 tokens (bertjax.models.flops) for a config file and
    the row's masking overrides; packed rows hold `packing.predictions_per_row` predictions."""
    from bertjax.data import packing
    from bertjax.models import families, flops

    c = runpy.run_path(config_path)["get_config"]()
    predictions = 20 if MODERN_MASKING[0] in overrides else 10
    if c.data.packing or "--config.data.packing=True" in overrides:
        predictions = packing.predictions_per_row(
            64, predictions, c.data.masked_lm_prob, c.data.packing_max_instances
        )
    return flops.train_flops_per_sequence(families.model_config(c.model.to_dict()), 64, predictions)


def train_seconds(workdir: str) -> tuple[float, int]:
    """(seconds from the `Training steps` line to the last progress line, steps) of log.txt."""
    stamps, last_step = [], 0
    with open(os.path.join(workdir, "log.txt")) as f:
        for line in f:
            match = LOG_TIME.match(line)
            if match:
                stamps.append(datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f"))
                last_step = (
                    int(line.split("step ")[1].split("/")[0])
                    if match.group(2) != "Training steps"
                    else last_step
                )
    return (stamps[-1] - stamps[0]).total_seconds(), last_step


def row_steps(row: str, args) -> int:
    """The row's pretraining steps (module docstring)."""
    if row == "modern_flops":
        return round(
            args.steps
            * flops_per_row("configs/tiny.py", [])
            / flops_per_row(MODERN, MODERN_MASKING)
        )
    if row == "modern_time":
        paper_s, _ = train_seconds(f"{args.out}/pretrain/paper")
        modern_s, modern_steps = train_seconds(f"{args.out}/pretrain/modern_flops")
        return round(paper_s * modern_steps / modern_s)
    return args.steps


def pretrain_command(row: str, args) -> list[str]:
    steps = argparse.Namespace(**{**vars(args), "steps": row_steps(row, args)})
    return ablation_study.pretrain_command(
        row, steps, ROWS[row][0], MODERN if row.startswith("modern") else "configs/tiny.py"
    )


def eval15(row: str, args) -> None:
    """Re-evaluates `row`'s final checkpoint at 15% masking, unpacked: a copy of its checkpoints
    run again with the paper row's masking and packing flags (a finished run only evaluates)."""
    source, target = f"{args.out}/pretrain/{row}", f"{args.out}/eval15/{row}"
    if not os.path.exists(f"{target}/final_metrics.json"):
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(f"{source}/checkpoints", f"{target}/checkpoints")
    cmd = pretrain_command(row, args)
    cmd[cmd.index(f"--workdir={source}")] = f"--workdir={target}"
    paper_data = [
        "--config.data.masked_lm_prob=0.15",
        "--config.data.max_predictions_per_seq=10",
        "--config.data.packing=False",
        "--config.train.allow_changed_data=True",
    ]
    ablation_study.run_once([*cmd, *paper_data], f"{target}/final_metrics.json", args.out)


def run(args) -> None:
    os.makedirs(args.out, exist_ok=True)
    for row in args.rows.split(","):
        ablation_study.run_once(
            pretrain_command(row, args), f"{args.out}/pretrain/{row}/final_metrics.json", args.out
        )
        for task in args.tasks.split(","):
            ablation_study.run_once(
                ablation_study.finetune_command(row, task, args),
                f"{args.out}/finetune/{row}/{task}/summary.json",
                args.out,
            )


def table(args) -> None:
    record = ablation_study.collect(args.out, ROWS)
    columns = [(task, m) for task in args.tasks.split(",") for m in finetune_study.METRICS[task]]
    lines = [
        "| row | steps | model TFLOPs | train s | held-out MLM acc (own masking) | "
        "held-out MLM acc (15%, unpacked) | " + " | ".join(f"{t} {m}" for t, m in columns) + " |",
        "|---" * (len(columns) + 6) + "|",
    ]
    for row, entry in record.items():
        config = MODERN if row.startswith("modern") else "configs/tiny.py"
        seconds, steps = train_seconds(f"{args.out}/pretrain/{row}")
        entry.update(
            train_seconds=seconds,
            steps=steps,
            model_flops=steps * 32 * flops_per_row(config, ROWS[row][0]),
        )
        again = f"{args.out}/eval15/{row}/final_metrics.json"
        if os.path.exists(again):
            entry["eval15"] = json.loads(Path(again).read_text())
        elif row in SAME_EVAL:  # its own evaluation already is one at 15%, unpacked
            entry["eval15"] = entry["pretraining"]
        cells = [
            str(steps),
            f"{entry['model_flops'] / 1e12:.2f}",
            f"{seconds:.0f}",
            f"{100 * entry['pretraining']['mlm_accuracy']:.1f}",
            f"{100 * entry['eval15']['mlm_accuracy']:.1f}" if "eval15" in entry else "-",
        ]
        lines.append(
            f"| {row}: {entry['description']} | "
            + " | ".join(cells + ablation_study.task_cells(entry, columns))
            + " |"
        )
    ablation_study.write_table(args.table, lines, record)


if __name__ == "__main__":
    parser = ablation_study.study_parser(__doc__.splitlines()[0], ",".join(ROWS), "sst2,mrpc", 800)
    parser.add_argument("--eval15", action="store_true", help="re-evaluate on 15%% batches")
    parsed = parser.parse_args()
    if parsed.table:
        table(parsed)
    elif parsed.eval15:
        for name in parsed.rows.split(","):
            if os.path.exists(f"{parsed.out}/pretrain/{name}/final_metrics.json"):
                eval15(name, parsed)
    else:
        run(parsed)
