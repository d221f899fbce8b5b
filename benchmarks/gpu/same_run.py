"""bertjax's train step beside transformers' BertForPreTraining on the same card in the same
run (issue 51), then bertjax's resume bit-exactness there.

    bash benchmarks/gpu/same_run.sh OUT_DIR                       # on a lent GPU: < 9 minutes
    python benchmarks/gpu/same_run.py --dry_run --out=DIR           # CPU, configs/tiny.py

Per shape (BERT-large, the recipe of configs/large.py: bf16, dropout 0.1 everywhere, BERT-Adam,
clipping; `attention_impl=auto`, which picks the fused path where there is one):
`bertjax.tools.bench` with `--compare=hf`, so that bertjax's jitted step and transformers'
(SDPA, bf16 autocast, fused AdamW; eager and `torch.compile`) alternate rounds of steps on
one batch: step time, throughput, MFU and the ratio bertjax / transformers, written to
OUT/same_run_L{L}_B{B}.json. Then the resume check: 2N steps uninterrupted against N steps,
the state fetched to the host (what a checkpoint holds) and placed on a freshly built step,
then N more; every leaf of the two final states compared bit for bit
(OUT/resume_check.json). It checks that the step's randomness (the dropout masks, fused
kernel's included) is a function of the state, not of a generator outside it; Orbax's own
round trip is tested on the CPU (tests/test_resume*.py), not here.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

# What the script imports beyond the lent machine's image (KINDS.md lists that image):
# each must travel as a wheel (benchmarks/gpu/README.md says how).
NEEDED = ("jax", "flax", "optax", "ml_collections", "absl", "numpy")
SHAPES = ((128, 128, 20), (512, 32, 80))  # (L, B, masked positions): the shapes
H100_PEAK_TFLOPS = 989.0  # dense bf16, H100 SXM; an H200 has the same compute


def missing_modules() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def config_for(dry_run: bool, length: int, batch: int, predictions: int, layers: int = 0):
    """configs/large.py (configs/tiny.py in a dry run) at one shape, `auto` attention."""
    name = "tiny" if dry_run else "large"
    config = runpy.run_path(os.path.join(REPO_ROOT, "configs", f"{name}.py"))["get_config"]()
    config.train.global_batch_size = batch
    config.data.max_seq_length = length
    config.data.max_predictions_per_seq = predictions
    config.model.attention_impl = "auto"
    if layers:
        config.model.num_hidden_layers = layers
    return config


def compare(args, length: int, batch: int, predictions: int) -> dict:
    from bertjax.tools import bench
    from bertjax.tools.records import write_record

    config = config_for(args.dry_run, length, batch, predictions)
    peak = 0.0 if args.dry_run else H100_PEAK_TFLOPS
    result = bench.run(config, args.steps, args.rounds, "hf", peak)
    write_record(result, os.path.join(args.out, f"same_run_L{length}_B{batch}.json"))
    return result


def resume_check(args) -> dict:
    """2N steps against N, a host round trip of the state, N more: identical bits?"""
    import jax
    import numpy as np

    from bertjax.tools.bench_step import BertjaxTrainer, synthetic_batch
    from bertjax.training import sharding

    length, batch, predictions = 128, args.resume_batch, 20
    layers = 0 if args.dry_run else args.resume_layers
    config = config_for(args.dry_run, length, batch, predictions, layers=layers)
    config.model.attention_probs_dropout_prob = 0.1  # the recipe's, in a dry run too
    host_batch = synthetic_batch(batch, length, predictions, config.model.vocab_size, padding=0.2)
    start = time.time()
    straight = BertjaxTrainer(config, host_batch)
    for _ in range(2 * args.resume_steps):
        straight.step()
    first = BertjaxTrainer(config, host_batch)
    for _ in range(args.resume_steps):
        first.step()
    saved = jax.device_get(first.state)  # what a checkpoint keeps, on the host
    resumed = BertjaxTrainer(config, host_batch)
    shardings = jax.tree.map(lambda x: x.sharding, resumed.state)
    with sharding.activate(resumed.mesh):
        resumed.state = jax.device_put(saved, shardings)
    for _ in range(args.resume_steps):
        resumed.step()
    with sharding.activate(straight.mesh):
        impl = straight.model_config.resolved_attention_impl()
    a, b = jax.device_get(straight.state), jax.device_get(resumed.state)
    paths = jax.tree_util.tree_flatten_with_path(a)[0]
    differing = [
        jax.tree_util.keystr(path)
        for (path, x), y in zip(paths, jax.tree.leaves(b), strict=True)
        if not np.array_equal(np.asarray(x), np.asarray(y))
    ]
    record = {
        "steps": [args.resume_steps, args.resume_steps],
        "layers": config.model.num_hidden_layers,
        "length": length,
        "batch": batch,
        "attention_impl": impl,
        "leaves": len(paths),
        "differing_leaves": differing,
        "bit_exact": not differing,
        "seconds": time.time() - start,
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
    }
    with open(os.path.join(args.out, "resume_check.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(
        f"resume after {args.resume_steps} steps: "
        + ("bit-exact" if not differing else f"{len(differing)} leaves differ: {differing[:3]}"),
        flush=True,
    )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder of the records")
    parser.add_argument("--dry_run", action="store_true", help="configs/tiny.py, on any backend")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--resume_steps", type=int, default=3, help="N")
    parser.add_argument("--resume_layers", type=int, default=4, help="BERT-large's layers")
    parser.add_argument("--resume_batch", type=int, default=32)
    parser.add_argument("--skip_compare", action="store_true", help="the resume check alone")
    parser.add_argument("--shapes", default="128,512", help="lengths to compare (SHAPES)")
    parser.add_argument("--skip_resume", action="store_true", help="the comparison alone")
    args = parser.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(
            f"error: {', '.join(missing)} not importable here: carry the wheels in .whl/ "
            "(benchmarks/gpu/README.md) or pip install -e .",
            file=sys.stderr,
        )
        return 1
    os.makedirs(args.out, exist_ok=True)
    if not args.skip_compare:
        lengths = [int(length) for length in args.shapes.split(",")]
        shapes = ((32, 8, 5),) if args.dry_run else [s for s in SHAPES if s[0] in lengths]
        for length, batch, predictions in shapes:
            compare(args, length, batch, predictions)
    if args.skip_resume:
        return 0
    return 0 if resume_check(args)["bit_exact"] else 3


if __name__ == "__main__":
    sys.exit(main())
