"""The TPU compiler's own estimate of a pretraining step with a given attention path.

    JAX_PLATFORMS=cpu python benchmarks/flash_dropout_estimate.py \
        --target=tpu-v5p-8 --impl=pallas --out=benchmarks/aot/flash_dropout_large_v5p_pallas.json

Compiles configs/large.py's train step deviceless for `--target` with
`model.attention_impl=--impl` (as `python -m bertjax.tools.aot` does) and records, per phase,
libtpu's `optimal_seconds` from `compiled.cost_analysis()` (its cost model's time, not a
measurement), the MFU it implies (model FLOPs / time / the chip's peak), the compiler's and
the model's FLOPs and the bytes accessed, all per device.
"""

import argparse
import json
import runpy

import jax

from bertjax.runtime import targets
from bertjax.tools import aot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/large.py")
    parser.add_argument("--target", default="tpu-v5p-8")
    parser.add_argument("--impl", default="pallas")
    parser.add_argument("--phases", default="", help="comma-separated; empty: every phase")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    config = runpy.run_path(args.config)["get_config"]()
    config.model.attention_impl = args.impl
    costs = []
    compile_lowered = jax.stages.Lowered.compile

    def compile_and_record(lowered, *a, **k):  # tools.aot keeps only the FLOPs
        compiled = compile_lowered(lowered, *a, **k)
        cost = compiled.cost_analysis()
        costs.append(cost[0] if isinstance(cost, list) else cost)
        return compiled

    jax.stages.Lowered.compile = compile_and_record
    target = targets.parse(args.target)
    result = aot.compile_train_step(
        config, targets.devices(target), args.phases.split(",") if args.phases else None, target
    )
    record = {
        "command": f"benchmarks/flash_dropout_estimate.py --config={args.config} "
        f"--target={args.target} --impl={args.impl} --phases={args.phases}",
        "jax": jax.__version__,
        "attention_impl": result["attention_impl"],
        "phases": {},
    }
    for (name, phase), cost in zip(result["phases"].items(), costs[-len(result["phases"]) :]):
        seconds, model = cost.get("optimal_seconds", 0.0), phase["model_flops_per_device"]
        record["phases"][name] = {
            "max_seq_length": phase["max_seq_length"],
            "per_device_batch": phase["per_device_batch"],
            "grad_accum_steps": phase["grad_accum_steps"],
            "verdict": phase["verdict"]["text"],
            "optimal_seconds": seconds,
            "model_flops": model,
            "compiler_flops": cost.get("flops"),
            "bytes_accessed": cost.get("bytes accessed"),
            "estimated_mfu": model / seconds / (target.peak_tflops * 1e12) if seconds > 0 else None,
        }
        print(name, json.dumps(record["phases"][name]), flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
