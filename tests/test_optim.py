"""Tests for bertjax.training.optim, optimizers, schedules and param_masks against a numpy
re-implementation of BERT's optimizer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.core import FrozenDict

from bertjax.errors import ConfigError
from bertjax.training import nonfinite, optim, optimizers, param_masks, schedules

B1, B2, EPS, WD = 0.9, 0.999, 1e-6, 0.01


def _params() -> dict:
    """Small BERT-like tree: dense, LayerNorm, embeddings and a top-level output bias."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.normal(size=shape).astype(np.float32)

    return {
        "layer": {
            "dense": {"kernel": normal(4, 3), "bias": normal(3)},
            "LayerNorm": {"scale": normal(3), "bias": normal(3)},
        },
        "word_embeddings": {"embedding": normal(5, 4)},
        "output_bias": normal(5),
    }


def _grads(step: int) -> dict:
    """Known gradients per step, small enough that eps matters."""
    rng = np.random.default_rng(100 + step)
    return jax.tree_util.tree_map(
        lambda p: (1e-3 * rng.normal(size=p.shape)).astype(np.float32), _params()
    )


def _flat(tree) -> dict:
    """Flatten a nested dict to {"a/b/c": leaf}, the original's variable naming."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        flat["/".join(str(entry.key) for entry in path)] = np.asarray(leaf, np.float64)
    return flat


def _reference_decay(name: str) -> bool:
    """The original `_do_use_weight_decay`: regex search of each excluded word."""
    return not any(re.search(word, name) for word in ("LayerNorm", "layer_norm", "bias"))


def _reference_bert_adam(params, grads_per_step, lrs, wd=WD, eps=EPS, clip_norm=None):
    """Google's AdamWeightDecayOptimizer in float64 numpy; returns flat params."""
    params = _flat(params)
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for step_grads, lr in zip(grads_per_step, lrs):
        grads = _flat(step_grads)
        if clip_norm is not None:
            norm = np.sqrt(sum(np.sum(g**2) for g in grads.values()))
            grads = {k: g * clip_norm / max(norm, clip_norm) for k, g in grads.items()}
        for name, g in grads.items():
            m[name] = B1 * m[name] + (1 - B1) * g
            v[name] = B2 * v[name] + (1 - B2) * g**2
            update = m[name] / (np.sqrt(v[name]) + eps)
            if _reference_decay(name):
                update = update + wd * params[name]
            params[name] = params[name] - lr * update
    return params


def _run(tx, params, grads_per_step):
    """Apply `tx` for each gradient under jit and return the final params."""
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_per_step:
        params, state = step(params, state, grads)
    return params


def _assert_flat_close(actual, expected, rtol=1e-6):
    """Compare a params tree with a flat reference dict leaf by leaf."""
    actual = _flat(actual)
    assert actual.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=1e-7, err_msg=name)


def _config(**overrides) -> optim.OptimizerConfig:
    """A full optimizer config with BERT defaults."""
    return optim.OptimizerConfig(
        **{
            **dict(
                name="bert_adam",
                peak_learning_rate=1e-2,
                warmup_steps=0,
                total_steps=1_000_000,
                weight_decay_rate=WD,
                b1=B1,
                b2=B2,
                eps=EPS,
                clip_global_norm=1.0,
            ),
            **overrides,
        }
    )


def test_bert_adam_matches_reference_three_steps():
    grads = [_grads(i) for i in range(3)]
    lr = 1e-2
    actual = _run(optimizers.bert_adam(lr, WD, B1, B2, EPS), _params(), grads)
    _assert_flat_close(actual, _reference_bert_adam(_params(), grads, [lr] * 3))


def test_decay_mask_excludes_layernorm_and_biases():
    mask = param_masks.decay_mask(_params())
    assert mask == {
        "layer": {
            "dense": {"kernel": True, "bias": False},
            "LayerNorm": {"scale": False, "bias": False},
        },
        "word_embeddings": {"embedding": True},
        "output_bias": False,
    }


def test_decay_mask_path_rules_and_frozendict():
    params = FrozenDict(
        {
            "bert": {
                "encoder": {
                    "layer_0": {
                        "attention": {
                            "output": {
                                "LayerNorm": {"scale": 1.0},
                                "dense": {"kernel": 1.0, "bias": 1.0},
                            }
                        }
                    }
                }
            },
            "final_layer_norm": {"scale": 1.0},
            "layernorm": {"scale": 1.0},  # case sensitive, as in the original
            "cls": {"predictions": {"output_bias": 1.0}},
        }
    )
    mask = param_masks.decay_mask(params)
    assert isinstance(mask, FrozenDict)
    output = mask["bert"]["encoder"]["layer_0"]["attention"]["output"]
    assert output["LayerNorm"]["scale"] is False
    assert output["dense"]["kernel"] is True
    assert output["dense"]["bias"] is False
    assert mask["final_layer_norm"]["scale"] is False
    assert mask["layernorm"]["scale"] is True
    assert mask["cls"]["predictions"]["output_bias"] is False


def test_weight_decay_moves_decayed_param_differently():
    value = np.ones(3, np.float32)
    params = {"dense": {"kernel": value, "bias": value}}
    grads = {"dense": {"kernel": value, "bias": value}}
    lr = 1e-2
    new = _run(optimizers.bert_adam(lr, weight_decay_rate=WD), params, [grads])
    # Same gradient and value, so the only difference is the decoupled lr * wd * param;
    # atol covers float32 rounding of params near 1.
    np.testing.assert_allclose(
        new["dense"]["bias"] - new["dense"]["kernel"], lr * WD * value, rtol=0, atol=1e-7
    )


def test_no_bias_correction_on_first_step():
    g = np.array([1e-3, -2e-3, 0.5], np.float32)
    params = {"dense": {"bias": np.zeros(3, np.float32)}}
    lr = 1e-2
    new = _run(optimizers.bert_adam(lr), params, [{"dense": {"bias": g}}])
    expected = -lr * g * (1 - B1) / (np.sqrt((1 - B2) * g**2) + EPS)
    np.testing.assert_allclose(new["dense"]["bias"], expected, rtol=1e-6)
    # With bias correction, Adam's first step would be about lr * sign(g).
    assert np.all(np.abs(new["dense"]["bias"]) > 3 * lr)


def test_moments_are_float32_with_param_structure():
    params = jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.bfloat16), _params())
    state = optimizers.scale_by_adam_no_bias_correction().init(params)
    structure = jax.tree_util.tree_structure(params)
    for moment in (state.mu, state.nu):
        assert jax.tree_util.tree_structure(moment) == structure
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(moment))
    _, state = optimizers.scale_by_adam_no_bias_correction().update(params, state)
    assert int(state.count) == 1


def test_global_norm_clipping_before_adam():
    # A large eps makes the result depend on gradient scale, so clipping shows.
    eps = 1.0
    params = _params()
    raw = _grads(0)
    norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in jax.tree_util.tree_leaves(raw)))
    big = jax.tree_util.tree_map(lambda g: (g * 10.0 / norm).astype(np.float32), raw)
    lr = 1e-2
    actual = _run(optim.make_optimizer(_config(eps=eps, peak_learning_rate=lr)), params, [big])
    expected = _reference_bert_adam(params, [big], [lr], eps=eps, clip_norm=1.0)
    _assert_flat_close(actual, expected, rtol=2e-6)
    unclipped = _reference_bert_adam(params, [big], [lr], eps=eps)
    assert not np.allclose(_flat(actual)["output_bias"], unclipped["output_bias"], rtol=1e-3)


def test_clipping_disabled():
    eps = 1.0
    big = jax.tree_util.tree_map(lambda g: g * 1e4, _grads(0))
    lr = 1e-2
    for off in (0, None):
        cfg = _config(eps=eps, peak_learning_rate=lr, clip_global_norm=off)
        actual = _run(optim.make_optimizer(cfg), _params(), [big])
        _assert_flat_close(actual, _reference_bert_adam(_params(), [big], [lr], eps=eps))


SCHEDULE_CASES = [
    (0, 0.0),
    (5_000, 5e-5),
    (9_999, 1e-4 * 9_999 / 10_000),
    (10_000, 1e-4 * (1 - 0.01)),
    (505_000, 1e-4 * (1 - 0.505)),
    (1_000_000, 0.0),
    (2_000_000, 0.0),
]


@pytest.mark.parametrize("step,expected", SCHEDULE_CASES)
def test_bert_schedule_values(step, expected):
    schedule = schedules.bert_schedule(1e-4, 10_000, 1_000_000)
    value = schedule(step)
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(float(value), expected, rtol=1e-6, atol=1e-12)


def test_bert_schedule_under_jit():
    schedule = jax.jit(schedules.bert_schedule(1e-4, 10_000, 1_000_000))
    steps = jnp.array([step for step, _ in SCHEDULE_CASES], jnp.int32)
    expected = [value for _, value in SCHEDULE_CASES]
    np.testing.assert_allclose(np.asarray(schedule(steps)), expected, rtol=1e-6, atol=1e-12)


def test_learning_rate_at_uses_schedule():
    cfg = _config(peak_learning_rate=1e-4, warmup_steps=10_000)
    assert isinstance(schedules.learning_rate_at(cfg, 5_000), float)
    np.testing.assert_allclose(schedules.learning_rate_at(cfg, 5_000), 5e-5, rtol=1e-6)


@pytest.mark.parametrize("name", optim.names())
def test_make_optimizer_runs_jitted_update(name):
    params = _params()
    new = _run(optim.make_optimizer(_config(name=name)), params, [_grads(0)])
    for before, after in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new)):
        assert np.all(np.isfinite(after))
        assert not np.allclose(before, after)


def test_make_optimizer_unknown_name():
    with pytest.raises(
        ConfigError,
        match=r"^optimizer\.name='sgd' is not one of 'bert_adam', 'adamw', 'lamb', "
        r"'stable_adamw': an optimizer must be registered",
    ):
        optim.make_optimizer(_config(name="sgd"))


def test_twenty_steps_with_warmup_decay_and_clipping_match_the_original():
    """make_optimizer over 20 steps of the schedule (4 warmup, decay over 20) with the clip
    active at every step equals AdamWeightDecayOptimizer in float64 within 1e-6."""
    grads = [jax.tree_util.tree_map(lambda g: g * 1e4, _grads(i)) for i in range(20)]
    cfg = _config(peak_learning_rate=1e-2, warmup_steps=4, total_steps=20)
    actual = _run(optim.make_optimizer(cfg), _params(), grads)
    lrs = [schedules.learning_rate_at(cfg, step) for step in range(20)]
    expected = _reference_bert_adam(_params(), grads, lrs, clip_norm=1.0)
    for name, value in _flat(actual).items():
        np.testing.assert_allclose(value, expected[name], rtol=0, atol=1e-6, err_msg=name)
    assert not np.allclose(
        _flat(actual)["output_bias"],
        _reference_bert_adam(_params(), grads, lrs)["output_bias"],
        atol=1e-4,
    )


@pytest.mark.parametrize("name", optim.names())
def test_every_integer_in_the_optimizer_state_counts_steps(name):
    """at_step sets every integer scalar of the state to the train step: that must be what
    each of them is (a count of updates), for every optimizer."""
    tx = optim.make_optimizer(_config(name=name))
    state = tx.init(_params())
    for _ in range(3):
        _, state = tx.update(_grads(0), state, _params())
    counts = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(x.ndim == 0 and int(x) == 3 for x in counts)
    synced = optim.at_step(state, jnp.int32(7))
    assert all(
        int(x) == 7
        for x in jax.tree_util.tree_leaves(synced)
        if jnp.issubdtype(x.dtype, jnp.integer)
    )


def test_global_norm_and_finiteness_by_shape_group_see_every_leaf():
    """The grouped reductions (one per distinct shape) equal a float64 norm over every leaf,
    and a single NaN or Inf in any leaf of a group (parameters or a moment) is found."""
    rng = np.random.default_rng(0)
    tree = {
        "layer_0": {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)},
        "layer_1": {"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)},
        "emb": rng.normal(size=(5, 3)).astype(np.float32),
        "count": np.int32(7),
    }
    tree = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32) if x.dtype != np.int32 else x, tree)
    expected = np.sqrt(
        sum(
            np.sum(np.square(np.asarray(x, np.float64)))
            for x in jax.tree.leaves(tree)
            if x.dtype == jnp.float32
        )
    )
    np.testing.assert_allclose(float(optim.global_norm(tree)), expected, rtol=1e-6)
    assert bool(nonfinite.all_finite(tree))
    for path in (("layer_0", "w"), ("layer_1", "b"), ("emb",)):
        for bad in (np.nan, np.inf):
            damaged = jax.tree.map(lambda x: x, tree)
            leaf = damaged
            for key in path[:-1]:
                leaf = leaf[key]
            leaf[path[-1]] = leaf[path[-1]].at[(0,) * leaf[path[-1]].ndim].set(bad)
            assert not bool(nonfinite.all_finite(damaged)), (path, bad)
            assert not np.isfinite(float(optim.global_norm(damaged)))


def test_clipping_is_the_originals_rule():
    """tf.clip_by_global_norm: g * c / max(norm, c); under the limit the gradients pass."""
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # norm 13
    clip = optim.clip_by_global_norm(1.0)
    clipped, _ = clip.update(grads, clip.init(grads))
    np.testing.assert_allclose(clipped["a"], [3 / 13, 4 / 13], rtol=1e-6)
    np.testing.assert_allclose(clipped["b"], [[12 / 13]], rtol=1e-6)
    kept, _ = optim.clip_by_global_norm(20.0).update(grads, clip.init(grads))
    jax.tree.map(np.testing.assert_array_equal, kept, grads)
