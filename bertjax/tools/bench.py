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
SDPA attention, fused AdamW), recorded as `speedup_vs_hf_eager` and `speedup_vs_hf_compile`.
`--compare=xla_dense` times the same step with `model.dense_impl=xla` (XLA's ops for the FFN
and the dense outputs instead of bertjax's Triton kernels) in alternating rounds, recorded as
`speedup_vs_xla_dense`. `--out=benchmarks/NAME.json` records everything with the command,
versions and machine.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from absl import flags

from bertjax import cli
from bertjax.tools import bench_report
from bertjax.tools.bench_step import BertjaxTrainer, synthetic_batch
from bertjax.tools.records import write_record

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
    if compare == "xla_dense":
        xla_dense = copy.deepcopy(config)
        xla_dense.model.dense_impl = "xla"
        trainers["xla_dense"] = BertjaxTrainer(xla_dense, host_batch)
        trainers["xla_dense"].step()  # compile
        trainers["xla_dense"].step()
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
    result = bench_report.result_record(
        config,
        trainers,
        times,
        compile_seconds=compile_seconds,
        load_before=load_before,
        rounds=rounds,
        steps_per_round=steps_per_round,
        peak_tflops=peak_tflops,
        predictions=predictions,
        padding=padding,
        packed=packed,
        unpacked_padding=unpacked_padding,
        skipped=skipped,
    )
    bench_report.print_summary(result, log)
    return result


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
        ["", "hf", "unpacked", "xla_dense"],
        "Also time a reference: Hugging Face, (with --packed) unpacked rows of "
        "--unpacked_padding, or the same step with model.dense_impl=xla (XLA's ops for the "
        "FFN and the dense outputs, not bertjax's Triton kernels).",
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
