"""The jitted train step: gradient accumulation equals the large batch, non-finite steps
are skipped (each cause named), scanned + rematerialised layers shard correctly, and eval
applies no dropout and matches a numpy computation of the held-out metrics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.models.bert.model import BertConfig, BertForPreTraining
from bertjax.models.layers import losses
from bertjax.training import nonfinite, optim, pretrain_loop, schedules, sharding, steps
from bertjax.training.state import TrainState, create_train_state

CONFIG = BertConfig(
    vocab_size=50,
    hidden_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
BATCH, LENGTH, PREDICTIONS = 8, 12, 3


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    weights = np.ones((BATCH, PREDICTIONS), np.float32)
    weights[::3, -1] = 0.0  # uneven weights: accumulation must weight micro-batches correctly
    return {
        "input_ids": rng.integers(5, 50, (BATCH, LENGTH)).astype(np.int32),
        "input_mask": np.ones((BATCH, LENGTH), np.int32),
        "segment_ids": (np.arange(LENGTH) >= 6).astype(np.int32)[None].repeat(BATCH, 0),
        "masked_lm_positions": np.sort(rng.integers(1, LENGTH, (BATCH, PREDICTIONS)), 1).astype(
            np.int32
        ),
        "masked_lm_ids": rng.integers(5, 50, (BATCH, PREDICTIONS)).astype(np.int32),
        "masked_lm_weights": weights,
        "next_sentence_labels": rng.integers(0, 2, (BATCH,)).astype(np.int32),
    }


def _setup(mesh, config=CONFIG):
    model = BertForPreTraining(config)
    tx = optim.make_optimizer(
        optim.OptimizerConfig(peak_learning_rate=1e-2, warmup_steps=2, total_steps=10)
    )
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
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), big.params, accumulated.params
    )
    assert int(accumulated.step) == 3


def test_non_finite_steps_are_skipped_and_their_cause_named():
    """A NaN batch is skipped (cause: inputs). Then one NaN in a parameter (as bit rot in a
    checkpoint would leave): it is skipped too, and the cause is the state, not the learning
    rate."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    model, tx, state, shardings = _setup(mesh)
    before = jax.device_get(state.params)
    step = steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh)
    bad = _batch()
    bad["masked_lm_weights"] = bad["masked_lm_weights"] * np.float32(np.nan)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(bad, mesh))
    assert nonfinite.NonFinite(int(metrics["nonfinite"])).what == "inputs"
    assert int(state.step) == 1
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(_batch(), mesh))
    assert float(metrics["nonfinite"]) == 0.0

    params = jax.tree.map(np.array, jax.device_get(state.params))  # (writable copies)
    params["bert"]["embeddings"]["LayerNorm"]["scale"][0] = np.nan
    state = jax.device_put(state.replace(params=params), shardings)
    with sharding.activate(mesh):
        state, metrics = step(state, sharding.global_batch_from_host(_batch(), mesh))
    assert nonfinite.NonFinite(int(metrics["nonfinite"])).what == "state"
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), params)


def _numpy_metric_sums(mlm_logits, nsp_logits, batch):
    """The original run_pretraining.py metric sums, in float64 numpy."""

    def nll_and_correct(logits, labels):
        logits = np.asarray(logits, np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
        return nll, logits.argmax(-1) == labels

    weights = batch["masked_lm_weights"].astype(np.float64)
    mlm_nll, mlm_correct = nll_and_correct(mlm_logits, batch["masked_lm_ids"])
    nsp_nll, nsp_correct = nll_and_correct(nsp_logits, batch["next_sentence_labels"])
    return {
        "mlm_loss_sum": (weights * mlm_nll).sum(),
        "mlm_correct_sum": (weights * mlm_correct).sum(),
        "mlm_weight_sum": weights.sum(),
        "nsp_loss_sum": nsp_nll.sum(),
        "nsp_correct_sum": nsp_correct.sum(),
        "nsp_count": len(nsp_nll),
    }


class _Loader:
    """A stand-in for a held-out BatchLoader: fixed batches."""

    def __init__(self, batches):
        self.batches, self.batches_per_epoch = batches, len(batches)

    def batch(self, index):
        return self.batches[index]


def test_eval_is_deterministic_with_dropout_and_matches_numpy():
    """With dropout 0.1 in the config, evaluation applies none: its metric sums equal numpy's
    from the logits of the same parameters in a model without dropout, and the held-out means
    over two batches are the ratios of the summed sums. (tests/mutation_check.py shows this
    test failing with dropout switched on in the eval step.)"""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, _, state, shardings = _setup(mesh)  # CONFIG: dropout rates 0
    with_dropout = BertForPreTraining(
        dataclasses.replace(CONFIG, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    )
    evaluate = steps.jit_eval_step(steps.make_eval_step(with_dropout), shardings.params, mesh)
    batches = [_batch(0), _batch(1)]
    with sharding.activate(mesh):
        got = [
            jax.device_get(evaluate(state.params, sharding.global_batch_from_host(b, mesh)))
            for b in batches
        ]
        means = pretrain_loop.evaluate(evaluate, state.params, _Loader(batches), 5, mesh)
    both = {name: np.concatenate([b[name] for b in batches]) for name in batches[0]}
    mlm, nsp = BertForPreTraining(CONFIG).apply(
        {"params": state.params},
        both["input_ids"],
        both["segment_ids"],
        both["input_mask"],
        both["masked_lm_positions"],
    )
    total = {}
    for index, (batch, sums) in enumerate(zip(batches, got)):
        rows = slice(index * BATCH, (index + 1) * BATCH)
        want = _numpy_metric_sums(mlm[rows], nsp[rows], batch)
        for key, value in want.items():
            np.testing.assert_allclose(float(sums[key]), value, rtol=1e-5, err_msg=key)
            total[key] = total.get(key, 0.0) + value
    assert float(got[0]["mlm_weight_sum"]) == batches[0]["masked_lm_weights"].sum()
    assert float(got[0]["nsp_count"]) == BATCH
    assert means["mlm_loss"] == pytest.approx(
        total["mlm_loss_sum"] / total["mlm_weight_sum"], rel=1e-5
    )
    assert means["mlm_accuracy"] == pytest.approx(
        total["mlm_correct_sum"] / total["mlm_weight_sum"]
    )
    assert means["nsp_accuracy"] == pytest.approx(total["nsp_correct_sum"] / (2 * BATCH))
    assert means["loss"] == pytest.approx(
        means["mlm_loss"] + total["nsp_loss_sum"] / (2 * BATCH), rel=1e-5
    )


@pytest.mark.slow  # (CI's `slow` stage: the default run stays under 10 minutes)
def test_scanned_rematerialised_layers_shard_and_match_one_device():
    """scan_layers + remat on a (data=2, fsdp=2, tensor=2) mesh equals one device."""
    config = dataclasses.replace(CONFIG, scan_layers=True, remat_policy="full", num_hidden_layers=2)
    batches = [_batch(i) for i in range(2)]
    one, one_losses = _run(1, batches, sharding.make_mesh({"data": 1}, jax.devices()[:1]), config)
    eight, eight_losses = _run(
        2, batches, sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}), config
    )
    np.testing.assert_allclose(one_losses, eight_losses, rtol=1e-5)
    kernel = eight.params["bert"]["encoder"]["layers"]["intermediate"]["dense"]["kernel"]
    assert kernel.shape[0] == 2
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), one.params, eight.params)


def test_after_a_skipped_step_the_applied_learning_rate_is_the_logged_one():
    """Steps 1 and 3 finite, step 2 NaN (skipped). Step 3's update is measured from the
    parameters and Adam's moments: its learning rate is schedule(2), the one the log reports
    for step 3 (schedules.learning_rate_at(cfg, step - 1)), not schedule(1)."""
    cfg = optim.OptimizerConfig(
        peak_learning_rate=0.1,
        warmup_steps=4,
        total_steps=10,
        weight_decay_rate=0.0,
        clip_global_norm=0.0,
    )
    tx = optim.make_optimizer(cfg)
    params = {"w": jnp.ones(3)}
    state = TrainState(
        step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0)
    )
    step = jax.jit(
        steps.make_loss_train_step(lambda p, batch, rng: (jnp.sum(p["w"] * batch["x"]), {}), tx)
    )
    for x in ([1.0, 2.0, 3.0], [np.nan] * 3):
        state, metrics = step(state, {"x": jnp.array(x)})
    assert float(metrics["nonfinite"]) == 1.0
    before = state.params["w"]
    state, metrics = step(state, {"x": jnp.array([3.0, -1.0, 2.0])})
    assert float(metrics["nonfinite"]) == 0.0 and int(state.step) == 3
    mu, nu = (optax.tree_utils.tree_get(state.opt_state, name)["w"] for name in ("mu", "nu"))
    applied = (before - state.params["w"]) / (mu / (jnp.sqrt(nu) + cfg.eps))
    logged = schedules.learning_rate_at(cfg, 2)
    assert logged != schedules.learning_rate_at(cfg, 1)
    np.testing.assert_allclose(applied, [logged] * 3, rtol=1e-5)


def test_non_finite_loss_and_non_finite_update_are_named():
    """Finite inputs and state, yet a non-finite loss (an embedding of 1e30: LayerNorm's
    variance overflows) is cause "loss or gradients", and the step leaves the parameters as
    they were. Finite gradients with Adam's first moment at 3e38 and its second at 0 (a state
    no run reaches: see the test below) divide into an infinite update: the step is applied
    (the new state is not checked in the step) and the next one finds a non-finite state."""
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    model, tx, state, shardings = _setup(mesh)
    state = jax.device_get(state)  # on the host: each run below puts (and donates) its own copy
    step = steps.jit_train_step(steps.make_train_step(model, tx), shardings, mesh)
    batch = _batch()

    def run(state):
        state = jax.device_put(state, shardings)
        with sharding.activate(mesh):
            state, metrics = step(state, sharding.global_batch_from_host(batch, mesh))
        cause = int(metrics["nonfinite"])
        return jax.device_get(state), nonfinite.NonFinite(cause).what if cause else "applied"

    huge = jax.tree.map(np.array, state.params)  # (writable copies)
    huge["bert"]["embeddings"]["word_embeddings"][batch["input_ids"][0, 0]] = 1e30
    after, cause = run(state.replace(params=huge))
    assert cause == "loss or gradients"
    jax.tree.map(np.testing.assert_array_equal, after.params, huge)

    def moments(path, x):
        name = jax.tree_util.keystr(path)
        return (
            jnp.full_like(x, 3e38) if ".mu" in name else jnp.zeros_like(x) if ".nu" in name else x
        )

    opt_state = jax.tree_util.tree_map_with_path(moments, state.opt_state)
    assert bool(nonfinite.all_finite(opt_state))
    after, cause = run(state.replace(opt_state=opt_state))
    assert cause == "applied" and not bool(nonfinite.all_finite(after.params))
    assert run(after)[1] == "state"  # (which `reporting` names "update" after a finite step)


@pytest.mark.parametrize("name", optim.names())
def test_finite_gradients_keep_a_reachable_state_finite(name):
    """Why the step checks only the loss and the gradients' norm: a finite norm means every
    gradient's square is finite, and from there each optimizer's moments and update stay
    finite, here with gradients up to 3e18 (a squared norm near 2e38) in alternating signs,
    no clipping, for 30 steps from the initial state."""
    params = {
        "dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.zeros(4)},
        "LayerNorm": {"scale": jnp.ones(4)},
    }
    tx = optim.make_optimizer(
        optim.OptimizerConfig(
            name=name, peak_learning_rate=1e-2, warmup_steps=2, total_steps=30, clip_global_norm=0.0
        )
    )
    opt_state = tx.init(params)
    for i in range(30):
        grads = jax.tree.map(lambda x: jnp.full_like(x, (-1) ** i * 1e18 * (1 + i % 3)), params)  # noqa: B023 (called within this iteration)
        assert np.isfinite(float(optim.global_norm(grads)))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        assert bool(nonfinite.all_finite((params, opt_state))), (name, i)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_grouped_finiteness_equals_the_per_leaf_check(bad):
    """The non-finite cause's grouped check (a sum of x * 0 per shape) agrees with
    `all_finite`: true for the largest finite floats (whose squares would overflow), false
    for one bad element in any leaf, the second of two leaves of one shape included."""
    tree = {
        "a": jnp.full((3, 4), 3e38),
        "b": jnp.full((3, 4), -3e38),
        "c": jnp.ones(5, jnp.bfloat16),
        "ids": jnp.arange(4),
    }
    assert bool(steps.all_finite_grouped(tree)) and bool(nonfinite.all_finite(tree))
    for name in ("b", "c"):
        broken = dict(tree, **{name: tree[name].at[1].set(bad)})
        assert not bool(steps.all_finite_grouped(broken)) and not bool(nonfinite.all_finite(broken))


def test_loss_equals_log_softmax_and_gather_bit_for_bit():
    """The pretraining loss's negative log-likelihood (the label picked by an iota compare)
    and its gradient are those of log_softmax + take_along_axis, bit for bit in float32."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 1000)) * 8
    labels = jax.random.randint(jax.random.PRNGKey(1), (3, 5), 0, 1000)
    weights = jax.random.uniform(jax.random.PRNGKey(2), (3, 5))

    def reference(x):
        log_probs = jax.nn.log_softmax(x, axis=-1)
        return -jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]

    def value_and_grad(nll):
        return jax.jit(jax.value_and_grad(lambda x: jnp.sum(weights * nll(x))))(logits)

    expected = value_and_grad(reference)
    actual = value_and_grad(lambda x: losses.nll(x, labels))
    for a, b in zip(actual, expected):
        np.testing.assert_array_equal(a, b)
