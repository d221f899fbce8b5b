"""The ModernBERT family (bertjax.models.modernbert.model) without torch: shapes and parameters, the
sliding-window band mask, RoPE against a hand computation, locality of the local layers,
packed rows against the same instances run alone, and the transformers-format round trip
(bertjax.families.modernbert_hf). Parity with transformers itself: test_modernbert_parity.py."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec

from bertjax.families import modernbert_hf
from bertjax.interop import tree
from bertjax.models import attention
from bertjax.models.layers import losses as layer_losses
from bertjax.models.modernbert import model as MB
from bertjax.models.modernbert.config import ModernBertConfig
from bertjax.training import optim, sharding, steps
from bertjax.training.state import create_train_state

TINY = ModernBertConfig(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=2,
    local_attention=4,
    max_position_embeddings=64,
    pad_token_id=0,
)


def abstract(config: ModernBertConfig) -> dict:
    """The parameters' shapes and logical axes (boxed), computed without running anything."""
    return jax.eval_shape(
        lambda: MB.ModernBertForMaskedLM(config).init(jax.random.PRNGKey(0), *MB.example_inputs())[
            "params"
        ]
    )


def init(config: ModernBertConfig, seed: int = 0) -> dict:
    """Parameters with every tensor random (norms and biases too), unboxed numpy."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: (0.3 * rng.standard_normal(x.shape)).astype(np.float32),
        nn.meta.unbox(abstract(config)),
    )


@functools.lru_cache
def jitted_apply(config: ModernBertConfig):
    return jax.jit(MB.ModernBertForMaskedLM(config).apply)


def logits(config, params, ids, mask, **kwargs):
    return np.asarray(
        jitted_apply(config)({"params": params}, jnp.asarray(ids), jnp.asarray(mask), **kwargs)
    )


def test_shapes_parameters_and_switches():
    params = init(TINY)
    flat = tree.flatten(params)
    ids = np.arange(2 * 9).reshape(2, 9) % TINY.vocab_size
    assert logits(TINY, params, ids, np.ones_like(ids)).shape == (2, 9, 40)
    positions = np.array([[0, 3], [8, 1]])
    gathered = logits(TINY, params, ids, np.ones_like(ids), masked_lm_positions=positions)
    full = logits(TINY, params, ids, np.ones_like(ids))
    np.testing.assert_allclose(
        gathered, np.take_along_axis(full, positions[..., None], 1), rtol=1e-6, atol=1e-6
    )
    # Layer 0 has no attention norm; the others do; defaults have no biases but the decoder's.
    assert not any(p.startswith("model/layer_0/attn_norm") for p in flat)
    assert "model/layer_1/attn_norm/scale" in flat
    assert flat["model/layer_2/attn/Wqkv/kernel"].shape == (16, 3, 16)
    assert flat["model/layer_2/mlp/Wi/kernel"].shape == (16, 2, 24)
    assert [p for p in flat if p.endswith("bias")] == ["decoder/bias"]
    switched = dataclasses.replace(
        TINY,
        norm_bias=True,
        attention_bias=True,
        mlp_bias=True,
        classifier_bias=True,
        decoder_bias=False,
    )
    biases = {p for p in tree.flatten(init(switched)) if p.endswith("bias")}
    assert {
        "model/layer_1/attn/Wqkv/bias",
        "model/layer_1/attn/Wo/bias",
        "model/layer_1/mlp/Wi/bias",
        "model/layer_1/mlp/Wo/bias",
        "model/final_norm/bias",
        "head/dense/bias",
        "head/norm/bias",
    } <= biases
    assert "decoder/bias" not in biases


def test_every_parameter_has_logical_axes_the_sharding_rules_place():
    specs = nn.get_partition_spec(abstract(TINY))
    rules = dict(sharding.LOGICAL_AXIS_RULES)
    for path, spec in traverse_util.flatten_dict(specs, sep="/").items():
        assert spec is not None and all(name is None or name in rules for name in spec), path
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": -1})
    placed = sharding.logical_to_sharding(specs, mesh)
    assert placed["model"]["layer_1"]["attn"]["Wqkv"]["kernel"].spec == PartitionSpec(
        sharding.FSDP, None, sharding.TENSOR
    )


def test_band_mask_padding_and_packed():
    real = jnp.array([[1, 1, 1, 1, 1, 0]])
    bias = np.asarray(attention.mask_bias(attention.Mask(real, half_window=1)))[0, 0]
    rows = np.arange(6)
    expected = (np.abs(rows[:, None] - rows[None, :]) <= 1) & (np.asarray(real[0]) > 0)[None]
    np.testing.assert_array_equal(bias == 0, expected)
    assert set(np.unique(bias)) == {0.0, attention.ATTENTION_MASK_VALUE}
    packed = jnp.array([[1, 1, 1, 2, 2, 0]])
    bias = np.asarray(attention.mask_bias(attention.Mask(packed, 2, half_window=2)))[0, 0]
    same = np.asarray(packed[0])[:, None] == np.asarray(packed[0])[None, :]
    np.testing.assert_array_equal(bias == 0, same & (np.abs(rows[:, None] - rows[None, :]) <= 2))
    # Without a window the mask is BERT's, unchanged.
    assert attention.mask_bias(attention.Mask(real)).shape == (1, 1, 1, 6)


def test_cudnn_refuses_a_window():
    """JAX's cuDNN path has causal windows only: asked for a two-sided one, one line."""
    q = jnp.zeros((1, 128, 2, 8))
    with pytest.raises(ValueError, match="no two-sided sliding window"):
        attention.fused_attention(
            "cudnn", q, q, q, attention.Mask(jnp.ones((1, 128)), 0, 4), 0.0, 0
        )


def test_rope_against_a_hand_computation():
    cos, sin = MB.rope_tables(jnp.array([[0, 2]]), head_size=4, theta=100.0)
    x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4).repeat(2, axis=1)
    out = np.asarray(MB.apply_rope(x, cos, sin))[0, :, 0]
    # Frequencies 100^(-0/4) = 1 and 100^(-2/4) = 0.1; units (0, 2) and (1, 3) rotate together.
    a, b = 2.0, 0.2
    np.testing.assert_allclose(out[0], [1, 2, 3, 4], rtol=1e-6)
    np.testing.assert_allclose(
        out[1],
        [
            1 * np.cos(a) - 3 * np.sin(a),
            2 * np.cos(b) - 4 * np.sin(b),
            3 * np.cos(a) + 1 * np.sin(a),
            4 * np.cos(b) + 2 * np.sin(b),
        ],
        rtol=1e-5,
    )


@pytest.mark.parametrize("is_global", [False, True])
def test_a_local_layer_sees_only_its_window(is_global):
    module = MB.ModernBertAttention(TINY, is_global, True)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 12, 16))
    mask = attention.Mask(jnp.ones((1, 12), jnp.int32), 0, 0 if is_global else 2)
    positions = jnp.arange(12)[None]
    shapes = jax.eval_shape(module.init, jax.random.PRNGKey(1), x, mask, positions)
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda a: rng.standard_normal(a.shape).astype(np.float32), nn.meta.unbox(shapes)
    )
    apply = jax.jit(module.apply)
    before = apply(params, x, mask, positions)
    after = apply(params, x.at[0, 11].add(1.0), mask, positions)
    changed = np.abs(np.asarray(after - before))[0].max(-1) > 1e-6
    # Query 5 is 6 rows from the changed key: outside a +-2 window.
    assert changed[5] == is_global and changed[9] and changed[11]


def test_packed_rows_equal_their_instances_alone():
    config = dataclasses.replace(TINY, local_attention=6)
    params = init(config)
    rng = np.random.default_rng(0)
    first, second = rng.integers(1, 40, 7), rng.integers(1, 40, 5)
    row = np.concatenate([first, second, [0, 0]])[None]
    instances = np.array([[1] * 7 + [2] * 5 + [0, 0]])
    positions = np.array([list(range(7)) + list(range(5)) + [0, 0]])
    packed = logits(
        config,
        params,
        row,
        instances > 0,
        position_ids=jnp.asarray(positions),
        instance_ids=jnp.asarray(instances),
    )[0]
    alone = logits(
        config,
        params,
        np.stack([first, np.pad(second, (0, 2))]),
        np.array([[1] * 7, [1] * 5 + [0] * 2]),
    )
    np.testing.assert_allclose(packed[:7], alone[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(packed[7:12], alone[1, :5], rtol=2e-5, atol=2e-5)


def test_remat_and_padding_keep_the_values():
    params = init(TINY)
    ids = np.random.default_rng(1).integers(1, 40, (2, 10))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    plain = logits(TINY, params, ids, mask)
    remat = logits(dataclasses.replace(TINY, remat_policy="full"), params, ids, mask)
    np.testing.assert_allclose(remat, plain, rtol=1e-6, atol=1e-6)
    short = logits(TINY, params, ids[1:, :6], np.ones((1, 6)))
    np.testing.assert_allclose(plain[1, :6], short[0], rtol=2e-5, atol=2e-5)


def test_config_errors_are_one_line():
    for field, value, words in (
        ("local_attention", 0, "integer >= 1"),
        ("num_attention_heads", 3, "not divisible"),
        ("hidden_activation", "swish", "is not one of"),
        ("norm_bias", 1, "True or False"),
        ("mlp_dropout", 1.0, r"\[0, 1\)"),
    ):
        with pytest.raises(ValueError, match=words) as error:
            dataclasses.replace(TINY, **{field: value})
        assert "\n" not in str(error.value) and field in str(error.value)
    with pytest.raises(ValueError, match="must be even"):
        dataclasses.replace(TINY, hidden_size=6, num_attention_heads=2)


def test_transformers_format_round_trip_without_torch(tmp_path):
    config = dataclasses.replace(
        TINY,
        num_hidden_layers=3,
        attention_bias=True,
        mlp_bias=True,
        norm_bias=True,
        global_attn_every_n_layers=2,
        hidden_activation="gelu_tanh",
    )
    params = init(config)
    count = modernbert_hf.save_hf(config, params, str(tmp_path))
    assert count == sum(x.size for x in jax.tree.leaves(params))
    found, loaded = modernbert_hf.load_hf(str(tmp_path))
    assert found == config
    for path, value in tree.flatten(params).items():
        np.testing.assert_array_equal(tree.flatten(loaded)[path], value, err_msg=path)
    assert modernbert_hf.path_to_hf("model/layer_2/attn/Wqkv/kernel") == (
        "model.layers.2.attn.Wqkv.weight",
        "split",
    )


def test_layer_types_other_than_every_n_are_refused():
    assert modernbert_hf.global_every(["full_attention", "sliding_attention"] * 2, "x") == 2
    with pytest.raises(tree.ConversionError, match="only pattern"):
        modernbert_hf.global_every(["sliding_attention", "full_attention"], "x")


@pytest.mark.slow  # 20 s of CPU: compiles the sharded init and train step
def test_trains_on_the_sharded_machinery():
    """ModernBERT through BERT's machinery as it is: the sharded train state (logical axes
    -> data x fsdp x tensor mesh), the jitted step with its non-finite guard, AdamW. The
    first step's loss is the one-device forward's; a fixed batch is learnt."""
    model = MB.ModernBertForMaskedLM(dataclasses.replace(TINY, num_hidden_layers=2))
    tx = optim.make_optimizer(
        optim.OptimizerConfig(
            peak_learning_rate=1e-2, warmup_steps=0, total_steps=100, name="adamw"
        )
    )
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    state, _, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(0), MB.example_inputs(), mesh
    )
    assert state.params["model"]["layer_1"]["attn"]["Wqkv"][
        "kernel"
    ].sharding.spec == PartitionSpec(sharding.FSDP, None, sharding.TENSOR)
    rng = np.random.default_rng(0)
    batch = {
        "input_ids": rng.integers(1, 40, (8, 12)),
        "input_mask": np.ones((8, 12), np.int32),
        "masked_lm_positions": rng.integers(0, 12, (8, 3)),
        "masked_lm_ids": rng.integers(1, 40, (8, 3)),
        "masked_lm_weights": np.ones((8, 3), np.float32),
    }
    batch["input_mask"][:4, 9:] = 0

    def loss_fn(params, batch, dropout_rng):
        logits = model.apply(
            {"params": params},
            batch["input_ids"],
            batch["input_mask"],
            batch["masked_lm_positions"],
            deterministic=False,
            rngs={"dropout": dropout_rng},
        )
        return layer_losses.tagging_loss(logits, batch["masked_lm_ids"], batch["masked_lm_weights"])

    one_device = jax.jit(loss_fn)(jax.device_get(state.params), batch, jax.random.PRNGKey(0))[0]
    train_step = steps.jit_train_step(steps.make_loss_train_step(loss_fn, tx), shardings, mesh)
    losses = []
    with sharding.activate(mesh):
        placed = sharding.global_batch_from_host(batch, mesh)
        for _ in range(8):
            state, metrics = train_step(state, placed)
            assert float(metrics["nonfinite"]) == 0
            losses.append(float(metrics["loss_sum"] / metrics["count"]))
    np.testing.assert_allclose(losses[0], float(one_device), rtol=1e-5)
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_xla_path_runs_every_layer_with_the_all_einsum_model_s_logits():
    """attention_impl='xla' (JAX's fused path, which runs on CPU) runs the global layers and
    the sliding windows (test_attention_impl: the windows of each kernel), and the model's
    logits equal the all-einsum model's."""
    params = init(TINY)
    ids = np.arange(2 * 12).reshape(2, 12) % TINY.vocab_size
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    fused = dataclasses.replace(TINY, attention_impl="xla")
    real = mask[..., None] > 0
    np.testing.assert_allclose(
        np.where(real, logits(fused, params, ids, mask), 0),
        np.where(real, logits(TINY, params, ids, mask), 0),
        rtol=1e-5,
        atol=1e-5,
    )
