"""Model FLOP/s of ModernBERT tiny against BERT tiny on this machine's CPU (issue 44, item 4),
in one process, their steps interleaved (the machine is shared: its load moves).

    PYTHONPATH=. python benchmarks/modern_cpu_flops.py --lengths=64,128,256,512 \
        --out=benchmarks/modern_cpu_flops.json

For each row length: `configs/tiny.py` (BERT, dropout 0, as the modern study's paper row)
and `configs/modernbert_tiny.py` (packed rows of one instance, as its recipe), batch 32,
15% of the tokens predicted, the train step of `bertjax.tools.bench` (`BertjaxTrainer`) on a
synthetic batch; ModernBERT twice: as it is (sliding windows in blocks where that computes
fewer scores, `bertjax.models.local_attention`) and with the band-masked einsum over the whole row
(the blocks switched off while its step is traced: the path before them). Rounds of
`--steps` steps of each, in turn; FLOP/s from the median step time and
`bertjax.models.flops.train_flops_per_sequence`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import statistics
import sys
import time

from bertjax.models import families, flops, local_attention
from bertjax.tools.bench_step import BertjaxTrainer, synthetic_batch
from bertjax.tools.records import machine, versions, write_record

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
BATCH = 32


def _config(name: str, length: int):
    c = runpy.run_path(str(CONFIGS / f"{name}.py"))["get_config"]()
    c.train.global_batch_size = BATCH
    c.data.max_seq_length = length
    if name == "tiny":
        c.model.hidden_dropout_prob = c.model.attention_probs_dropout_prob = 0.0
    return c


def _trainer(name: str, length: int, blocks: bool) -> tuple[BertjaxTrainer, int]:
    """The compiled trainer and its model FLOPs per step."""
    config = _config(name, length)
    predictions = max(1, round(0.15 * length))
    batch = synthetic_batch(
        BATCH,
        length,
        predictions,
        config.model.vocab_size,
        packed=1 if name == "modernbert_tiny" else 0,
    )
    trainer = BertjaxTrainer(config, batch)
    runs_blocked = local_attention.runs_blocked
    if not blocks:
        local_attention.runs_blocked = lambda *args: False
    try:
        trainer.step()  # traces and compiles
    finally:
        local_attention.runs_blocked = runs_blocked
    trainer.step()
    model_config = families.model_config(config.model.to_dict())
    step_flops = (
        flops.train_flops_per_sequence(model_config, length, batch["masked_lm_ids"].shape[1])
        * BATCH
    )
    return trainer, step_flops


def measure(length: int, rounds: int, steps: int) -> dict:
    rows = {
        "bert_tiny": ("tiny", True),
        "modernbert_tiny": ("modernbert_tiny", True),
        "modernbert_tiny_band": ("modernbert_tiny", False),
    }
    trainers = {name: _trainer(config, length, blocks) for name, (config, blocks) in rows.items()}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (trainer, _) in trainers.items():
            times[name] += [trainer.step() for _ in range(steps)]
    result = {}
    for name, (_, step_flops) in trainers.items():
        median = statistics.median(times[name])
        result[name] = {
            "model_flops_per_step": step_flops,
            "median_step_s": median,
            "model_gflops_per_second": step_flops / median / 1e9,
            "step_times_s": times[name],
        }
    bert = result["bert_tiny"]["model_gflops_per_second"]
    result["ratio_to_bert"] = {
        name: result[name]["model_gflops_per_second"] / bert
        for name in ("modernbert_tiny", "modernbert_tiny_band")
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    record = {
        "command": " ".join(["python", *sys.argv]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "machine": machine(),
        "batch": BATCH,
        "load_average_before": os.getloadavg(),
        "lengths": {},
    }
    for length in (int(n) for n in args.lengths.split(",")):
        result = measure(length, args.rounds, args.steps)
        record["lengths"][str(length)] = result
        print(
            f"L={length}: "
            + ", ".join(
                f"{name} {r['model_gflops_per_second']:.1f} GFLOP/s ({r['median_step_s'] * 1e3:.0f} ms)"
                for name, r in result.items()
                if name != "ratio_to_bert"
            )
            + "; / BERT: "
            + ", ".join(f"{name} {ratio:.2f}" for name, ratio in result["ratio_to_bert"].items()),
            flush=True,
        )
    record["load_average_after"] = os.getloadavg()
    if args.out:
        write_record(record, args.out)


if __name__ == "__main__":
    main()
