"""The jitted train step: gradient accumulation equals the large batch, non-finite steps
are skipped, scanned + rematerialised layers shard correctly, and eval is deterministic."""
import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from bertjax import optim, sharding, steps
from bertjax.model import BertConfig, BertForPreTraining
from bertjax.state import create_train_state

CONFIG = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
BATCH, LENGTH, PREDICTIONS = 8, 12, 3


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    weights = np.ones((BATCH, PREDICTIONS), np.float32)
    weights[::3, -1] = 0.0  # uneven weights: accumulation must weight micro-batches correctly
    return {
        "input_ids": rng.integers(5, 50, (BATCH, LENGTH)).astype(np.int32),
        "input_mask": np.ones((BATCH, LENGTH), np.int32),
        "segment_ids": (np.arange(LENGTH) >= 6).astype(np.int32)[None].repeat(BATCH, 0),
        "masked_lm_positions": np.sort(rng.integers(1, LENGTH, (BATCH, PREDICTIONS)), 1).astype(np.int32),
        "masked_lm_ids": rng.integers(5, 50, (BATCH, PREDICTIONS)).astype(np.int32),
        "masked_lm_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, (BATCH,)).astype(np.int32),
    }


def _setup(mesh, config=CONFIG):
    model = BertForPreTraining(config)
    tx = optim.make_optimizer(ml_collections.ConfigDict(
        dict(peak_learning_rate=1e-2, warmup_steps=2, total_steps=10)))
    example = (jnp.zeros((1, 8), jnp.int32),) * 3 + (jnp.zeros((1, 2), jnp.int32),)
    state, _, shardings = create_train_state(model, tx, jax.random.PRNGKey(0), example, mesh)
    return model, tx, state, shardings


def _run(accum_steps, batches, mesh, config=CONFIG):
    model, tx, state, shardings = _setup(mesh, config)
    step = steps.jit_train_step(steps.make_train_step(model, tx, accum_steps), shardings, mesh)
    losses = []
    with sharding.activate(mesh):
        for batch in batches:
            state, metrics = step(state, sharding.global_batch_from_host(batch, mesh))
            losses.append(float(metrics["mlm_loss_sum"] / metrics["mlm_weight_sum"]))
    return state, losses


def test_gradient_accumulation_equals_the_large_batch():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
    batches = [_batch(i) for i in range(3)]
    big, big_losses = _run(1, batches, mesh)
    # 4 micro-batches for batches of this shape (a phase's), as train's auto accumulation gives
    accumulated, accumulated_losses = _run({(BATCH, LENGTH): 4}, batches, mesh)
    np.testing.assert_allclose(big_losses, accumulated_losses, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), big.params,
                 accumulated.params)
    assert int(accumulated.step) == 3


def test_non_finite_steps_are_skipped_and_their_cause_named():
    """A NaN batch is skipped (cause: inputs). Then one NaN in Adam's second moment (as bit
    rot in a checkpoint would leave): loss and gradients stay finite but the update would be
    NaN; it is skipped too, and the cause is the state, not the learning rate."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    model, tx, state, shardings = _setup(mesh)
    before = jax.device_get(state.params)
    step = steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh)
    bad = _batch()
    bad["masked_lm_weights"] = bad["masked_lm_weights"] * np.float32(np.nan)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(bad, mesh))
    assert steps.NONFINITE_CAUSES[int(metrics["nonfinite"])][0] == "inputs"
    assert int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(_batch(), mesh))
    assert float(metrics["nonfinite"]) == 0.0

    second_moments = [path for path, _ in jax.tree_util.tree_leaves_with_path(state.opt_state)
                      if ".nu" in jax.tree_util.keystr(path)]
    opt_state = jax.tree_util.tree_map_with_path(
        lambda path, x: x.at[(0,) * x.ndim].set(jnp.nan) if path == second_moments[0] else x,
        state.opt_state)
    state = jax.device_put(state.replace(opt_state=opt_state), shardings)
    before = jax.device_get(state.params)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(_batch(), mesh))
    assert np.isfinite(float(metrics["grad_norm"]))
    assert steps.NONFINITE_CAUSES[int(metrics["nonfinite"])][0] == "state"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)


def test_eval_step_is_deterministic_and_counts_weights():
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    model, _, state, shardings = _setup(mesh)
    evaluate = steps.jit_eval_step(steps.make_eval_step(model), shardings.params, mesh)
    batch = _batch()
    with sharding.activate(mesh):
        a = evaluate(state.params, sharding.global_batch_from_host(batch, mesh))
        b = evaluate(state.params, sharding.global_batch_from_host(batch, mesh))
    assert float(a["mlm_loss_sum"]) == float(b["mlm_loss_sum"])
    assert float(a["mlm_weight_sum"]) == batch["masked_lm_weights"].sum()
    assert float(a["nsp_count"]) == BATCH


def test_scanned_rematerialised_layers_shard_and_match_one_device():
    """scan_layers + remat on a (data=2, fsdp=2, tensor=2) mesh equals one device."""
    config = dataclasses.replace(CONFIG, scan_layers=True, remat_policy="full",
                                 num_hidden_layers=2)
    batches = [_batch(i) for i in range(2)]
    one, one_losses = _run(1, batches, sharding.make_mesh({"data": 1}, jax.devices()[:1]), config)
    eight, eight_losses = _run(2, batches, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}),
                               config)
    np.testing.assert_allclose(one_losses, eight_losses, rtol=1e-5)
    kernel = eight.params["bert"]["encoder"]["layers"]["intermediate"]["dense"]["kernel"]
    assert kernel.shape[0] == 2
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), one.params, eight.params)
