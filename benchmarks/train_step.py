"""Times the jitted pretraining step of a config on the available devices.

    python benchmarks/train_step.py --config=configs/base.py --batch=8 --steps=5

Random parameters and a synthetic batch of the phase-1 shapes (max_seq_length,
max_predictions_per_seq); reports compile time, median step time, tokens/s and, given the
devices' peak FLOP/s (--peak_tflops), model FLOPs utilisation.
"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from bertjax import optim, sharding, steps
from bertjax.model import BertConfig, BertForPreTraining
from bertjax.state import count_params, create_train_state
from bertjax.train import optimizer_config

config_flags.DEFINE_config_file("config", "configs/base.py", "Config file.")
flags.DEFINE_integer("batch", 8, "Global batch size (sequences).")
flags.DEFINE_integer("steps", 5, "Timed steps after one warm-up step.")
flags.DEFINE_float("peak_tflops", 0.0, "Peak TFLOP/s of all devices together, for MFU.")
FLAGS = flags.FLAGS


def synthetic_batch(batch: int, length: int, predictions: int, vocab: int) -> dict:
    rng = np.random.default_rng(0)
    return {
        "input_ids": rng.integers(5, vocab, (batch, length)).astype(np.int32),
        "input_mask": np.ones((batch, length), np.int32),
        "segment_ids": (np.arange(length) >= length // 2).astype(np.int32)[None].repeat(batch, 0),
        "masked_lm_positions": np.sort(rng.choice(length, (batch, predictions)), 1).astype(np.int32),
        "masked_lm_ids": rng.integers(5, vocab, (batch, predictions)).astype(np.int32),
        "masked_lm_weights": np.ones((batch, predictions), np.float32),
        "next_sentence_labels": rng.integers(0, 2, (batch,)).astype(np.int32),
    }


def train_flops_per_sequence(config: BertConfig, length: int, predictions: int) -> float:
    """6 x (matmul parameters x tokens) + attention scores, forward + backward."""
    h, f, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = layers * (4 * h * h + 2 * h * f)
    attention = layers * 2 * length * length * h  # QK^T and PV
    head = predictions * (h * h + h * config.vocab_size) + h * h + 2 * h
    return 6.0 * (per_token * length + head) + 3.0 * 2 * attention


def main(argv):
    del argv
    config = FLAGS.config
    model_config = BertConfig.from_dict(config.model.to_dict())
    length, predictions = config.data.max_seq_length, config.data.max_predictions_per_seq
    mesh = sharding.make_mesh(config.mesh.to_dict())
    model = BertForPreTraining(model_config)
    tx = optim.make_optimizer(optimizer_config(config))
    example = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
    state, _, shardings = create_train_state(model, tx, jax.random.PRNGKey(0), example, mesh)
    step = steps.jit_train_step(steps.make_train_step(model, tx, config.train.grad_accum_steps),
                                shardings, mesh)
    host = synthetic_batch(FLAGS.batch, length, predictions, model_config.vocab_size)
    with sharding.activate(mesh):
        batch = sharding.global_batch_from_host(host, mesh)
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        compile_seconds = time.perf_counter() - start
        times = []
        for _ in range(FLAGS.steps):
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = train_flops_per_sequence(model_config, length, predictions) * FLAGS.batch
    print(f"device {jax.devices()[0].device_kind} x{len(jax.devices())}; "
          f"{count_params(state.params):,} params; batch {FLAGS.batch} x {length} tokens, "
          f"{predictions} predictions; dtype {model_config.dtype}")
    print(f"compile+first step {compile_seconds:.1f} s; step {seconds * 1000:.0f} ms (median of "
          f"{FLAGS.steps}); {FLAGS.batch * length / seconds:,.0f} tokens/s; "
          f"{flops / seconds / 1e9:.1f} GFLOP/s model")
    if FLAGS.peak_tflops:
        print(f"MFU {flops / seconds / (FLAGS.peak_tflops * 1e12):.1%}")


if __name__ == "__main__":
    app.run(main)
