"""`python -m bertjax.tools.bench --config=configs/base.py`: how fast the pretraining step runs.

Compiles the jitted train step of the config (random parameters, a synthetic batch of the
first phase's shape: train.global_batch_size x data.max_seq_length, data.max_predictions_per_seq
masked positions) and prints compile time, median step time, sequences/s and tokens/s (global
and per chip), model FLOPs per step (`bertjax.models.flops`), MFU against the device's bf16 peak
(`--peak_tflops` overrides; CPUs have none) and peak device memory where reported.

`--padding=F` leaves that share of every row's tokens as padding and `--packed=K` makes the
rows packed (`data.packing`): K instances per row, block-diagonal attention, K next-sentence
and `packing.predictions_per_row` masked-LM slots; `real_tokens_per_second` counts only the
tokens that are not padding, so packed and unpacked runs compare at their padding fractions.

`--compare=hf` also trains Hugging Face `BertForPreTraining` (PyTorch) on the same config
and batch, alternating rounds of steps with bertjax in this process, and prints the
throughput ratios: eager on the CPU; on a GPU both eager and `torch.compile` (bf16 autocast,
SDPA attention, fused AdamW), recorded as `speedup_vs_hf_eager` and `speedup_vs_hf_compile`. `--out=benchmarks/NAME.json` records everything with the command, versions
and machine.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from absl import flags

from bertjax import cli
from bertjax.models import flops
from bertjax.tools.bench_step import BertjaxTrainer, synthetic_batch
from bertjax.tools.records import machine, versions, write_record

FLAGS = flags.FLAGS


def _time_rounds(
    trainers: dict[str, Any],
    rounds: int,
    steps_per_round: int,
) -> dict[str, list[float]]:
    """Alternates `steps_per_round` steps of each trainer, `rounds` times."""
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, trainer in trainers.items():
            times[name].extend(trainer.step() for _ in range(steps_per_round))
    return times


def peak_memory_bytes() -> int | None:
    """The backend's peak bytes in use on device 0 (None where it reports none, e.g. CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def throughput(
    step_seconds: float, batch: int, length: int, chips: int, padding: float = 0.0
) -> dict[str, float]:
    real_tokens = batch * (length - int(round(padding * length)))
    return {
        "step_ms": step_seconds * 1e3,
        "sequences_per_second": batch / step_seconds,
        "tokens_per_second": batch * length / step_seconds,
        "real_tokens_per_second": real_tokens / step_seconds,
        "sequences_per_second_per_chip": batch / step_seconds / chips,
        "tokens_per_second_per_chip": batch * length / step_seconds / chips,
    }


def hf_missing() -> str | None:
    """Why `--compare=hf` cannot run here (torch or transformers missing), or None."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    return (
        f"{' and '.join(missing)} not installed (pip install -e '.[parity]')" if missing else None
    )


def run(
    config: ml_collections.ConfigDict,
    steps_per_round: int,
    rounds: int,
    compare: str,
    peak_tflops: float,
    log: Callable[[str], None] = print,
    padding: float = 0.0,
    packed: int = 0,
    unpacked_padding: float = 0.0,
) -> dict[str, Any]:
    """Benchmarks the config's train step (and the reference) on rows with `padding` (share
    of tokens), `packed` with that many instances per row; `compare="unpacked"` alternates
    with unpacked rows of `unpacked_padding`. Returns the result record."""
    batch_size, length = config.train.global_batch_size, config.data.max_seq_length
    predictions = config.data.max_predictions_per_seq
    if (packed and compare == "hf") or (compare == "unpacked" and not packed):
        raise ValueError("--compare=hf runs on unpacked rows; --compare=unpacked needs --packed=K")
    host_batch = synthetic_batch(
        batch_size, length, predictions, config.model.vocab_size, padding=padding, packed=packed
    )
    predictions = host_batch["masked_lm_ids"].shape[1]  # packed rows have more slots
    load_before = os.getloadavg()
    bertjax = BertjaxTrainer(config, host_batch)
    compile_seconds = bertjax.step()  # compile + first step
    bertjax.step()  # warm-up
    trainers: dict[str, Any] = {"bertjax": bertjax}
    skipped = hf_missing() if compare == "hf" else None
    if skipped:
        log(f"no Hugging Face comparison: {skipped}")
    elif compare == "hf":
        from bertjax.tools import bench_hf  # torch is imported only here

        opt = config.optimizer
        device = "cuda" if jax.default_backend() == "gpu" else "cpu"
        references = (
            {"hf_eager": False, "hf_compile": True} if device == "cuda" else {"hf_eager": False}
        )
        for name, compile_model in references.items():
            trainers[name] = bench_hf.HFTrainer(
                bertjax.model_config,
                host_batch,
                opt.peak_learning_rate,
                opt.weight_decay_rate,
                opt.eps,
                opt.clip_global_norm,
                device=device,
                compile=compile_model,
            )
            trainers[name].step()  # warm-up (and compilation)
            trainers[name].step()
    if compare == "unpacked":
        trainers["unpacked"] = BertjaxTrainer(
            config,
            synthetic_batch(
                batch_size,
                length,
                config.data.max_predictions_per_seq,
                config.model.vocab_size,
                padding=unpacked_padding,
            ),
        )
        trainers["unpacked"].step()  # compile
        trainers["unpacked"].step()
    times = _time_rounds(trainers, rounds, steps_per_round)

    chips = jax.device_count()
    device_kind = jax.devices()[0].device_kind
    peak = peak_tflops or flops.peak_tflops(device_kind)
    step_flops = (
        flops.train_flops_per_sequence(bertjax.model_config, length, predictions) * batch_size
    )
    median = statistics.median(times["bertjax"])
    result: dict[str, Any] = {
        "command": " ".join(
            [os.path.basename(sys.executable), "-m", "bertjax.tools.bench", *sys.argv[1:]]
        ),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        "machine": machine(),
        "load_average_before": load_before,
        "config": {
            "model": config.model.to_dict(),
            "batch": batch_size,
            "length": length,
            "predictions": predictions,
            "padding": padding,
            "packed_instances_per_row": packed,
            "grad_accum_steps": config.train.grad_accum_steps or 1,  # no phase: no auto
            "mesh": dict(bertjax.mesh.shape),
        },
        "num_params": bertjax.num_params,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "compile_and_first_step_s": compile_seconds,
        "model_flops_per_step": step_flops,
        "model_tflops_per_second": step_flops / median / 1e12,
        "peak_tflops_per_chip": peak,
        "mfu": flops.mfu(step_flops / median, chips, peak),
        "peak_memory_bytes": peak_memory_bytes(),
        "bertjax": {
            **throughput(median, batch_size, length, chips, padding),
            "step_times_s": times["bertjax"],
        },
    }
    if skipped:
        result["compare_skipped"] = skipped
    for name in (n for n in trainers if n.startswith("hf")):
        hf_median = statistics.median(times[name])
        result[name] = {
            **throughput(hf_median, batch_size, length, 1),
            "mfu": flops.mfu(step_flops / hf_median, 1, peak),
            "step_times_s": times[name],
            **trainers[name].describe(),
        }
        result[f"speedup_vs_{name}"] = hf_median / median
    if "unpacked" in trainers:
        result["unpacked"] = {
            **throughput(
                statistics.median(times["unpacked"]), batch_size, length, chips, unpacked_padding
            ),
            "padding": unpacked_padding,
            "step_times_s": times["unpacked"],
        }
        gain = (
            result["bertjax"]["real_tokens_per_second"]
            / result["unpacked"]["real_tokens_per_second"]
        )
        bound = 1.0 / (1.0 - unpacked_padding)
        costs = {name: trainers[name].cost() for name in ("bertjax", "unpacked")}
        real_share = (1.0 - padding) / (1.0 - unpacked_padding)  # real tokens per row, ratio
        result["packing"] = {
            "real_token_gain": gain,
            "bound": bound,
            "share_of_bound": gain / bound,
            "xla_cost": costs,
            "xla_cost_gain": {  # the gain if step time followed the cost
                key: real_share * costs["unpacked"][key] / costs["bertjax"][key]
                for key in ("flops", "bytes_accessed")
            },
        }
    _print_summary(result, log)
    return result


def _print_summary(r: dict[str, Any], log: Callable[[str], None]) -> None:
    m, c, b = r["machine"], r["config"], r["bertjax"]
    log(
        f"{m['device_kind']} x{m['devices']} ({m['cpu']}, {m['cpu_cores']} cores, load "
        f"{m['load_average'][0]:.2f}); {r['num_params']:,} params, dtype {c['model']['dtype']}; "
        f"batch {c['batch']} x {c['length']} tokens, {c['predictions']} predictions, padding "
        f"{c['padding']:.1%}"
        + (
            f", packed {c['packed_instances_per_row']} instances per row"
            if c["packed_instances_per_row"]
            else ""
        )
    )
    log(
        f"compile + first step {r['compile_and_first_step_s']:.1f} s; step {b['step_ms']:.1f} ms "
        f"(median of {len(b['step_times_s'])}); {b['sequences_per_second']:,.1f} seq/s, "
        f"{b['tokens_per_second']:,.0f} tokens/s, {b['real_tokens_per_second']:,.0f} real tokens/s "
        f"({b['sequences_per_second_per_chip']:,.1f} seq/s, "
        f"{b['tokens_per_second_per_chip']:,.0f} tokens/s per chip)"
    )
    mfu = (
        f"MFU {r['mfu']:.1%}"
        if r["mfu"] is not None
        else "MFU n/a (no peak for this device; pass --peak_tflops)"
    )
    memory = r["peak_memory_bytes"]
    log(
        f"model {r['model_flops_per_step'] / 1e9:,.2f} GFLOP/step, "
        f"{r['model_tflops_per_second'] * 1e3:,.1f} GFLOP/s; {mfu}; peak memory "
        + (f"{memory / 2**30:.2f} GiB" if memory else "not reported by this backend")
    )
    for name in (n for n in r if n.startswith("hf")):
        h = r[name]
        log(
            f"{name} BertForPreTraining (torch {h['torch']} on {h['device']}, "
            f"{h['torch_threads']} threads): step {h['step_ms']:.1f} ms (median of "
            f"{len(h['step_times_s'])}), {h['sequences_per_second']:,.1f} seq/s; bertjax / "
            f"{name} throughput {r[f'speedup_vs_{name}']:.2f}x"
        )
    if "packing" in r:
        u, p = r["unpacked"], r["packing"]
        log(
            f"unpacked rows (padding {u['padding']:.1%}): step {u['step_ms']:.1f} ms (median of "
            f"{len(u['step_times_s'])}), {u['real_tokens_per_second']:,.0f} real tokens/s; packed "
            f"/ unpacked real tokens/s {p['real_token_gain']:.3f}x of the {p['bound']:.3f}x the "
            f"padding allows ({p['share_of_bound']:.1%}); by XLA's cost analysis "
            f"{p['xla_cost_gain']['flops']:.3f}x (FLOPs), "
            f"{p['xla_cost_gain']['bytes_accessed']:.3f}x (bytes accessed)"
        )


def define_flags() -> None:
    from ml_collections import config_flags

    config_flags.DEFINE_config_file(
        "config", None, "Config file, e.g. configs/base.py.", lock_config=True
    )
    flags.DEFINE_integer("steps", 5, "Timed steps per round, after compile and one warm-up.")
    flags.DEFINE_integer("rounds", 3, "Rounds; with --compare each round runs both in turn.")
    flags.DEFINE_enum(
        "compare",
        "",
        ["", "hf", "unpacked"],
        "Also time a reference: Hugging "
        "Face, or (with --packed) unpacked rows of --unpacked_padding.",
    )
    flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s per chip for MFU (default: the table).")
    flags.DEFINE_string("out", "", "Write the result record as JSON here.")
    flags.DEFINE_float("padding", 0.0, "Share of every row's tokens left as padding.")
    flags.DEFINE_float(
        "unpacked_padding", 0.0, "Padding share of the unpacked rows that --compare=unpacked times."
    )
    flags.DEFINE_integer(
        "packed",
        0,
        "Packed rows (data.packing) of this many instances each; "
        "0 = one instance per row, as the original.",
    )
    flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    del argv
    result = run(
        FLAGS.config,
        FLAGS.steps,
        FLAGS.rounds,
        FLAGS.compare,
        FLAGS.peak_tflops,
        padding=FLAGS.padding,
        packed=FLAGS.packed,
        unpacked_padding=FLAGS.unpacked_padding,
    )
    if FLAGS.out:
        write_record(result, FLAGS.out)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
