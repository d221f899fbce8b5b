"""Loader throughput with and without prepared data verified as it is read (issue 34).

    python benchmarks/read_check/measure.py --checkout before=DIR --checkout after=DIR \
        [--config configs/tiny.py] [--global_batch_size 0] [--batches 2000] [--repeats 5] \
        [--out FILE.json]

Each checkout's `bertjax` (its `PYTHONPATH`) prepares the config's first phase once (static
and dynamic masking, in its own cache), then, in a fresh process per measurement, loads
`--batches` batches of the config's global batch with `BatchLoader` (the training loop's
loader): CPU seconds of this process (`time.process_time`), so that other jobs on a shared
machine change them less than wall time. The checkouts alternate, `--repeats` times, and the
medians are reported.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
from ml_collections import config_flags  # noqa: F401
import importlib.util
spec = importlib.util.spec_from_file_location("config", sys.argv[1])
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
config = module.get_config()
from bertjax.training import phase_schedule
from bertjax.training.settings import plan_phases
from bertjax.data import corpus_source, loaders, pipeline
config.data.masking, config.data.num_workers = sys.argv[3], 1
config.train.global_batch_size = int(sys.argv[5]) or config.train.global_batch_size
phase = plan_phases(config.train, config.data, config.long_phase)[0]
try:  # (a checkout with typed data settings, or one before them)
    from bertjax.data.settings import DataSettings
    data = DataSettings.of(config.data)
except ImportError:
    data = config.data
tokenizer = corpus_source.load_or_train_tokenizer(data, sys.argv[2])
split = pipeline.prepare(data, phase, tokenizer, sys.argv[2])["train"]
masking = (corpus_source.specials_of(tokenizer, config.data.whole_word_mask),
           config.data.masked_lm_prob, phase.max_predictions_per_seq, config.data.whole_word_mask)
loader = loaders.BatchLoader(split, phase.global_batch_size, config.data.seed, masking=masking)
loader.batch(0)
batches = int(sys.argv[4])
wall, cpu = time.perf_counter(), time.process_time()
for i in range(1, batches + 1):
    loader.batch(i)
cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
print(json.dumps({"sequences": batches * phase.global_batch_size, "cpu_seconds": cpu,
                  "wall_seconds": wall, "batch": phase.global_batch_size,
                  "max_seq_length": phase.max_seq_length}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkout", action="append", required=True, help="NAME=DIR")
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--global_batch_size", type=int, default=0, help="0: the config's")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    checkouts = dict(item.split("=", 1) for item in args.checkout)
    config = os.path.abspath(args.config)
    caches = {name: tempfile.mkdtemp(prefix=f"read_check_{name}_") for name in checkouts}
    runs: dict = {
        f"{name} {masking}": [] for masking in ("static", "dynamic") for name in checkouts
    }
    for repeat in range(args.repeats + 1):  # the first round prepares (not counted)
        for masking in ("static", "dynamic"):
            for name, directory in checkouts.items():
                env = {
                    **os.environ,
                    "PYTHONPATH": os.path.abspath(directory),
                    "JAX_PLATFORMS": "cpu",
                }
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        config,
                        caches[name],
                        masking,
                        str(args.batches),
                        str(args.global_batch_size),
                    ],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
                if repeat:
                    runs[f"{name} {masking}"].append(result)
                    print(
                        f"{name} {masking}: {result['sequences'] / result['cpu_seconds']:,.0f}"
                        f" seq/CPU-s ({os.getloadavg()[0]:.1f} load)",
                        flush=True,
                    )
    summary = {}
    for key, results in runs.items():
        rates = [r["sequences"] / r["cpu_seconds"] for r in results]
        summary[key] = {"median_sequences_per_cpu_second": statistics.median(rates), "all": rates}
        print(
            f"{key}: median {statistics.median(rates):,.0f} sequences per CPU second "
            f"({', '.join(f'{r:,.0f}' for r in rates)})"
        )
    record = {
        "command": " ".join(["python", *sys.argv]),
        "config": args.config,
        "batches": args.batches,
        "batch": results[0]["batch"],
        "max_seq_length": results[0]["max_seq_length"],
        "results": summary,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
