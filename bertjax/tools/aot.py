"""Compile the train step for a target mesh on fake CPU devices, before renting a TPU:

    python -m bertjax.tools.aot --config=configs/large.py --num_devices=32 \
        --config.mesh.data=1 --config.mesh.fsdp=-1 [--phases=long]

Nothing is materialised: the train state and the batches are abstract (shapes, dtypes and
shardings), so BERT-large compiles for 32 devices on a laptop. Prints the start-up memory
report, XLA's memory analysis of the compiled step (per device, on CPU; TPU layouts differ
somewhat) and the compile time per phase. A mesh that cannot split the model or the batch
ends with one `error: ...` line and exit status 1.
"""
from __future__ import annotations

import sys
import time

import jax
from absl import flags
from ml_collections import config_flags

from bertjax import cli, memory, optim, run, schedule, sharding
from bertjax.model import BertConfig


def compile_train_step(config, devices: list[jax.Device],
                       phase_names: list[str] | None = None) -> dict[str, dict]:
    """Lowers and compiles the train step for each phase; prints the memory report and
    returns `{phase: {"compile_seconds": ..., "memory": {...}}}`."""
    mesh = sharding.make_mesh(config.mesh.to_dict(), devices)
    phases = schedule.phases(config.train, config.data, config.long_phase)
    run.check_batches(mesh, phases, config.train.grad_accum_steps,
                      config.model.max_position_embeddings)
    phases = [p for p in phases if not phase_names or p.name in phase_names]
    sharded = run.build_pretraining(
        BertConfig.from_dict(config.model.to_dict()),
        optim.optimizer_config(config.optimizer, config.train.total_steps), mesh, phases,
        config.train.grad_accum_steps)
    results = {}
    for phase in phases:
        start = time.time()
        with sharding.activate(mesh):
            compiled = sharded.train_step.lower(sharded.abstract_state, memory.abstract_batch(
                phase, phase.global_batch_size, sharding.batch_sharding(mesh))).compile()
        seconds = time.time() - start
        analysis = compiled.memory_analysis()
        sizes = {} if analysis is None else {
            name: getattr(analysis, f"{name}_size_in_bytes")
            for name in ("argument", "output", "alias", "temp", "generated_code")}
        results[phase.name] = {"compile_seconds": seconds, "memory": sizes}
        print(f"Phase {phase.name} (L={phase.max_seq_length}, global batch "
              f"{phase.global_batch_size}): lowered and compiled in {seconds:.1f} s", flush=True)
        if sizes:
            peak = sizes["argument"] + sizes["output"] - sizes["alias"] + sizes["temp"]
            print("  XLA memory analysis per device: " + ", ".join(
                f"{name} {memory.format_bytes(size)}" for name, size in sizes.items())
                + f"; arguments + outputs - aliased + temporaries = {memory.format_bytes(peak)}",
                flush=True)
    return results


FLAGS = flags.FLAGS


def define_flags() -> None:
    config_flags.DEFINE_config_file("config", None, "Config file with get_config().",
                                    lock_config=True)
    flags.DEFINE_integer("num_devices", 32, "Fake CPU devices to compile for (the mesh must "
                         "cover them exactly).")
    flags.DEFINE_list("phases", [], "Phases to compile (short, long); default: all.")
    flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    del argv
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", FLAGS.num_devices)
    try:
        compile_train_step(FLAGS.config, jax.devices()[:FLAGS.num_devices], FLAGS.phases)
    except Exception as e:  # sharding and shape errors from JAX/XLA included: one clear line
        print(f"error: compiling the train step for mesh {FLAGS.config.mesh.to_dict()} on "
              f"{FLAGS.num_devices} devices failed: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    cli.run(main)
