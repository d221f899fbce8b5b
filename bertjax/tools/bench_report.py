"""What a bench run reports: the rates of a median step (`throughput`), the result record
(command, versions, machine, config, compile time, model FLOPs and MFU, peak memory, each
reference's rates and bertjax's speedup over it, packing's gain) and its summary lines.
`python -m bertjax.tools.bench` times the steps and hands them here."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from bertjax.models import flops
from bertjax.tools.records import machine, versions


def peak_memory_bytes() -> int | None:
    """The backend's peak bytes in use on device 0 (None where it reports none, e.g. CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def throughput(
    step_seconds: float, batch: int, length: int, chips: int, padding: float = 0.0
) -> dict[str, float]:
    real_tokens = batch * (length - round(padding * length))
    return {
        "step_ms": step_seconds * 1e3,
        "sequences_per_second": batch / step_seconds,
        "tokens_per_second": batch * length / step_seconds,
        "real_tokens_per_second": real_tokens / step_seconds,
        "sequences_per_second_per_chip": batch / step_seconds / chips,
        "tokens_per_second_per_chip": batch * length / step_seconds / chips,
    }


def result_record(  # noqa: PLR0913 (the record's fields, keyword-only)
    config: ml_collections.ConfigDict,
    trainers: dict[str, Any],
    times: dict[str, list[float]],
    *,
    compile_seconds: float,
    load_before: tuple[float, float, float],
    rounds: int,
    steps_per_round: int,
    peak_tflops: float,
    predictions: int,
    padding: float,
    packed: int,
    unpacked_padding: float,
    skipped: str | None,
) -> dict[str, Any]:
    """The record of a bench run of `config`: `times` holds each of `trainers`' step times
    (`bertjax` first; `hf_*` references, `xla_dense` (the step on XLA's dense ops), or
    `unpacked` rows of `unpacked_padding`); the rest
    is how it ran (`skipped`: why the Hugging Face comparison did not)."""
    bertjax = trainers["bertjax"]
    batch_size, length = config.train.global_batch_size, config.data.max_seq_length
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

    def reference(name: str, on_chips: int, rows_padding: float, extra: dict[str, Any]) -> None:
        """A reference's throughput and MFU, and bertjax's speedup over it."""
        ref_median = statistics.median(times[name])
        result[name] = {
            **throughput(ref_median, batch_size, length, on_chips, rows_padding),
            "mfu": flops.mfu(step_flops / ref_median, on_chips, peak),
            "step_times_s": times[name],
            **extra,
        }
        result[f"speedup_vs_{name}"] = ref_median / median

    for name in (n for n in trainers if n.startswith("hf")):
        reference(name, 1, 0.0, trainers[name].describe())
    if "xla_dense" in trainers:
        reference("xla_dense", chips, padding, {})
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
    return result


def print_summary(r: dict[str, Any], log: Callable[[str], None]) -> None:
    """The record `r` as the lines a bench run prints."""
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

    def versus(name: str, what: str) -> str:
        x = r[name]
        return (
            f"{name} {what}: step {x['step_ms']:.1f} ms (median of {len(x['step_times_s'])}), "
            f"{x['sequences_per_second']:,.1f} seq/s; bertjax / {name} throughput "
            f"{r[f'speedup_vs_{name}']:.2f}x"
        )

    for name in (n for n in r if n.startswith("hf")):
        h = r[name]
        log(
            versus(
                name,
                f"BertForPreTraining (torch {h['torch']} on {h['device']}, "
                f"{h['torch_threads']} threads)",
            )
        )
    if "xla_dense" in r:
        log(versus("xla_dense", "(model.dense_impl=xla)"))
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
