"""BERT in Flax linen: the original architecture, with logical axis names on every parameter.

Parameter paths follow Google's TF checkpoint names (`bert/embeddings/word_embeddings`,
`bert/encoder/layer_3/attention/self/query/kernel`, `cls/predictions/output_bias`, ...), so
conversion is a rename plus a transpose-free copy. No mesh axis name appears here: the rules
table in `bertjax.training.sharding` maps the logical names below to mesh axes.

Shape legend: B batch, L sequence length, H hidden size, N heads, D head size, F FFN size,
V vocab size, P gathered (masked) positions, K instances per packed row (`data.packing`).
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import attention, bias_matmul
from bertjax.models.bert.config import ACTIVATIONS, REMAT_POLICIES, BertConfig
from bertjax.models.dropout import Dropout

# Logical axis names: parameters.
VOCAB = "vocab"
EMBED = "embed"
EMBED_OUT = "embed_out"  # output side of the square H->H kernels (pooler, MLM transform)
QKV = "qkv"  # the H outputs of query/key/value, i.e. N heads x D
MLP = "mlp"
POSITION = "position"
TOKEN_TYPE = "token_type"
NORM = "norm"
NSP_CLASSES = "nsp_classes"
LABELS = "labels"  # fine-tuning head outputs (classes, tags, span start/end)
LAYERS = "layers"
# Logical axis names: activations.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_QKV = "act_qkv"
ACT_MLP = "act_mlp"


def _init(config: BertConfig, axes: tuple[str, ...]) -> nn.initializers.Initializer:
    """Truncated normal (2 stddev), as TF's truncated_normal_initializer, with logical axes."""
    return nn.with_logical_partitioning(
        nn.initializers.truncated_normal(config.initializer_range), axes
    )


def _zeros(axes: tuple[str, ...]) -> nn.initializers.Initializer:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def _dense(
    config: BertConfig,
    features: int,
    axes: tuple[str, str],
    name: str,
    cls: type[nn.Dense] = nn.Dense,
    **fields: Any,
) -> nn.Dense:
    return cls(
        features,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        kernel_init=_init(config, axes),
        bias_init=_zeros(axes[1:]),
        name=name,
        **fields,
    )


def _activated_dense(
    config: BertConfig, features: int, axes: tuple[str, str], x: jax.Array
) -> jax.Array:
    """`activation(Dense(x))` with the Dense named "dense" (call from a compact method). On a
    GPU the bias add and the activation are rematerialised in the backward pass from the
    matmul's output (`_RematActivatedDense`): it lowers the H100 compiler's peak memory and
    step time, and raises libtpu's peak, hence GPU only (measured in benchmarks/aot/levers.md).
    Same ops either way: identical values."""
    activation = ACTIVATIONS[config.hidden_act]
    if attention.target_platform() in ("gpu", "cuda"):
        return _dense(config, features, axes, "dense", _RematActivatedDense, activation=activation)(
            x
        )
    return activation(_dense(config, features, axes, "dense")(x))


class _RematActivatedDense(nn.Dense):
    """`activation(x @ kernel + bias)` with nn.Dense's parameters, the bias add and the
    activation under `jax.checkpoint`: the backward pass keeps only the matmul's output
    (which exists anyway), so the forward fusion writes the activation alone, not the biased
    pre-activation beside it (benchmarks/aot/levers.md)."""

    activation: Callable[[jax.Array], jax.Array] = ACTIVATIONS["gelu"]

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", self.kernel_init, (inputs.shape[-1], self.features), self.param_dtype
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
        inputs, kernel, bias = self.promote_dtype(  # type: ignore[assignment]  # (none is None)
            inputs, kernel, bias, dtype=self.dtype
        )
        y = jax.lax.dot_general(
            inputs,
            kernel,  # type: ignore[arg-type]
            (((inputs.ndim - 1,), (0,)), ((), ())),
            precision=self.precision,
        )
        return jax.checkpoint(lambda y, b: self.activation(y + b))(y, bias)


def _layer_norm(config: BertConfig, name: str = "LayerNorm") -> nn.LayerNorm:
    # Statistics are computed in float32 whatever the compute dtype.
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (NORM,)),
        bias_init=_zeros((NORM,)),
        name=name,
    )


def _constrain(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return nn.with_logical_constraint(x, axes)


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, LayerNorm, dropout."""

    config: BertConfig

    def setup(self):
        cfg = self.config
        for name, axis, rows in (
            ("word_embeddings", VOCAB, cfg.vocab_size),
            ("position_embeddings", POSITION, cfg.max_position_embeddings),
            ("token_type_embeddings", TOKEN_TYPE, cfg.type_vocab_size),
        ):
            setattr(
                self,
                name,
                self.param(
                    name, _init(cfg, (axis, EMBED)), (rows, cfg.hidden_size), cfg.param_dtype
                ),
            )
        self.layer_norm = _layer_norm(cfg)
        self.dropout = Dropout(cfg.hidden_dropout_prob)

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        token_type_ids_BxL: jax.Array,
        deterministic: bool,
        position_ids_BxL: jax.Array | None = None,
    ) -> jax.Array:
        length = input_ids_BxL.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {length} exceeds max_position_embeddings="
                f"{self.config.max_position_embeddings}"
            )
        positions = (
            self.position_embeddings[None, :length]
            if position_ids_BxL is None
            else jnp.take(self.position_embeddings, position_ids_BxL, axis=0)
        )
        x_BxLxH = (
            jnp.take(self.word_embeddings, input_ids_BxL, axis=0)
            + positions
            + jnp.take(self.token_type_embeddings, token_type_ids_BxL, axis=0)
        )
        x_BxLxH = self.layer_norm(x_BxLxH)
        x_BxLxH = self.dropout(x_BxLxH, deterministic=deterministic)
        return _constrain(x_BxLxH.astype(self.config.dtype), (BATCH, LENGTH, ACT_EMBED))


class _DenseParams(nn.Module):
    """The kernel and bias of `_dense` (same names, initializers and axes), unapplied."""

    config: BertConfig
    features: int
    axes: tuple[str, str]

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        kernel = self.param(
            "kernel", _init(cfg, self.axes), (in_features, self.features), cfg.param_dtype
        )
        return kernel, self.param("bias", _zeros(self.axes[1:]), (self.features,), cfg.param_dtype)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention over an `attention.Mask` (padding, or packed instances);
    softmax and mask in float32."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array, mask: attention.Mask, deterministic: bool) -> jax.Array:
        cfg = self.config
        batch, length, _ = x_BxLxH.shape

        # In 16-bit compute one matmul [3, H, H] projects query, key and value (the parameters
        # stay three Dense layers); float32 keeps three, bit-identical to the original. The
        # projection index leads the output, so each of q, k, v is a contiguous block: with
        # it last ([B, L, 3, H]), libtpu copied each slice and each gradient to another layout
        # (BERT-large on tpu-v5p-8: 6.8 of 85.4 ms at L=128, benchmarks/aot/tpu_census.md).
        params = [
            _DenseParams(cfg, cfg.hidden_size, (EMBED, QKV), name=name)(x_BxLxH.shape[-1])
            for name in ("query", "key", "value")
        ]
        groups = [params] if cfg.dtype != "float32" else [[p] for p in params]
        projected = []
        for group in groups:
            kernels, biases = zip(*group)
            y_KxBxLxH = bias_matmul.project(
                x_BxLxH.astype(cfg.dtype),
                jnp.stack(kernels).astype(cfg.dtype),
                jnp.stack(biases),
                attention.target_platform() == "tpu",
            )
            projected += [
                _constrain(y_KxBxLxH[i], (BATCH, LENGTH, ACT_QKV)).reshape(
                    batch, length, cfg.num_attention_heads, cfg.head_size
                )
                for i in range(len(group))
            ]
        q_BxLxNxD, k_BxLxNxD, v_BxLxNxD = projected
        dropout_rate = 0.0 if deterministic else cfg.attention_probs_dropout_prob
        # cuDNN's dropout seed is static: one per layer, from the module's path.
        seed = zlib.crc32("/".join(self.scope.path).encode()) % 2**31  # type: ignore[union-attr]
        context_BxLxNxD = attention.attend(
            cfg.attention_impl,
            cfg.dtype,
            q_BxLxNxD,
            k_BxLxNxD,
            v_BxLxNxD,
            mask,
            functools.partial(Dropout(dropout_rate), deterministic=deterministic),
            dropout_rate,
            seed,
            nn.logical_to_mesh_axes((BATCH, ACT_QKV)),
        )
        return context_BxLxNxD.reshape(batch, length, cfg.hidden_size)


class BertDenseOutput(nn.Module):
    """Dense back to H, dropout, residual add, post-LayerNorm (attention/output and output)."""

    config: BertConfig
    input_axis: str

    @nn.compact
    def __call__(self, y: jax.Array, residual_BxLxH: jax.Array, deterministic: bool) -> jax.Array:
        cfg = self.config
        if self.input_axis == QKV and attention.target_platform() == "tpu":  # (bias_matmul)
            kernel, bias = _DenseParams(cfg, cfg.hidden_size, (QKV, EMBED), name="dense")(
                y.shape[-1]
            )
            y_BxLxH = bias_matmul.project(
                y.astype(cfg.dtype), kernel[None].astype(cfg.dtype), bias[None], True
            )[0]
        else:
            y_BxLxH = _dense(cfg, cfg.hidden_size, (self.input_axis, EMBED), "dense")(y)
        y_BxLxH = Dropout(cfg.hidden_dropout_prob)(y_BxLxH, deterministic=deterministic)
        out_BxLxH = _layer_norm(cfg)(y_BxLxH + residual_BxLxH)
        return _constrain(out_BxLxH.astype(cfg.dtype), (BATCH, LENGTH, ACT_EMBED))


class BertAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH, mask: attention.Mask, deterministic: bool) -> jax.Array:
        context = BertSelfAttention(self.config, name="self")(x_BxLxH, mask, deterministic)
        return BertDenseOutput(self.config, QKV, name="output")(context, x_BxLxH, deterministic)


class BertLayer(nn.Module):
    """One post-LN transformer layer. Returns `(x, x if emit_output else None)` so it can be
    scanned (the second output is stacked over layers)."""

    config: BertConfig
    deterministic: bool = True
    emit_output: bool = False

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array, mask: attention.Mask):
        cfg = self.config
        attended_BxLxH = BertAttention(cfg, name="attention")(x_BxLxH, mask, self.deterministic)
        intermediate_BxLxF = BertIntermediate(cfg, name="intermediate")(attended_BxLxH)
        out_BxLxH = BertDenseOutput(cfg, MLP, name="output")(
            intermediate_BxLxF, attended_BxLxH, self.deterministic
        )
        self.sow("intermediates", "hidden_states", out_BxLxH)  # no-op unless made mutable
        return out_BxLxH, (out_BxLxH if self.emit_output else None)


class BertIntermediate(nn.Module):
    """The FFN's first half: Dense H->F and the activation."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array) -> jax.Array:
        cfg = self.config
        y_BxLxF = _activated_dense(cfg, cfg.intermediate_size, (EMBED, MLP), x_BxLxH)
        return _constrain(y_BxLxF, (BATCH, LENGTH, ACT_MLP))


class BertEncoder(nn.Module):
    """The layer stack, unrolled (`layer_0`, `layer_1`, ...) or scanned (`layers`, stacked).

    Returns the last layer's output, or with `all_layers=True` every layer's output stacked
    `[num_layers, B, L, H]` (the original's `all_encoder_layers`). With
    `mutable=["intermediates"]` in `apply`, the embedding output and each layer's output are
    also recorded (`embedding_output`, `hidden_states`), as HF's `output_hidden_states`.
    """

    config: BertConfig

    @nn.compact
    def __call__(
        self,
        x_BxLxH: jax.Array,
        mask: attention.Mask,
        deterministic: bool,
        all_layers: bool = False,
    ) -> jax.Array:
        cfg = self.config
        self.sow("intermediates", "embedding_output", x_BxLxH)  # no-op unless made mutable
        layer_cls = BertLayer
        if cfg.remat_policy != "none":
            layer_cls = nn.remat(
                layer_cls, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers
            )
        if cfg.scan_layers:
            stack = nn.scan(
                layer_cls,
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=nn.broadcast,
                length=cfg.num_hidden_layers,
                metadata_params={nn.PARTITION_NAME: LAYERS},
            )
            x_BxLxH, layers_NxBxLxH = stack(cfg, deterministic, all_layers, name="layers")(
                x_BxLxH, mask
            )
            return layers_NxBxLxH if all_layers else x_BxLxH
        outputs = []
        for i in range(cfg.num_hidden_layers):
            x_BxLxH, _ = layer_cls(cfg, deterministic, name=f"layer_{i}")(x_BxLxH, mask)
            outputs.append(x_BxLxH)
        return jnp.stack(outputs) if all_layers else x_BxLxH


class BertPooler(nn.Module):
    """`tanh(Dense(h[:, 0]))`: the [CLS] representation (each at `cls_positions_BxK`: packed)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array, cls_positions_BxK: jax.Array | None = None):
        cfg = self.config
        first = (
            x_BxLxH[:, 0]
            if cls_positions_BxK is None
            else gather_positions(x_BxLxH, cls_positions_BxK)
        )
        return jnp.tanh(_dense(cfg, cfg.hidden_size, (EMBED, EMBED_OUT), "dense")(first))


class BertModel(nn.Module):
    """Embeddings, encoder and pooler. Returns `(sequence_output [B,L,H], pooled [B,H])`; packed
    rows (`data.packing`: instance ids 1..K, 0 = padding) pool each instance's [CLS], `[B,K,H]`."""

    config: BertConfig

    def setup(self):
        self.embeddings, self.encoder, self.pooler = (
            module(self.config) for module in (BertEmbeddings, BertEncoder, BertPooler)
        )

    def __call__(
        self,
        input_ids_BxL: jax.Array,
        token_type_ids_BxL: jax.Array,
        attention_mask_BxL: jax.Array,
        deterministic: bool = True,
        all_layers: bool = False,
        *,
        position_ids: jax.Array | None = None,
        instance_ids: jax.Array | None = None,
        next_sentence_positions: jax.Array | None = None,
    ):
        """With `all_layers`, returns `(layers [num_layers, B, L, H], pooled)` instead."""
        mask = (
            attention.Mask(attention_mask_BxL)
            if instance_ids is None
            else attention.Mask(
                instance_ids,
                next_sentence_positions.shape[1],  # type: ignore[union-attr]
            )
        )
        x_BxLxH = self.embeddings(input_ids_BxL, token_type_ids_BxL, deterministic, position_ids)
        x = self.encoder(x_BxLxH, mask, deterministic, all_layers)
        return x, self.pooler(x[-1] if all_layers else x, next_sentence_positions)


class BertPredictionTransform(nn.Module):
    """Dense H->H, activation, LayerNorm: the MLM head's `transform` block."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxPxH: jax.Array) -> jax.Array:
        cfg = self.config
        return _layer_norm(cfg)(_activated_dense(cfg, cfg.hidden_size, (EMBED, EMBED_OUT), x_BxPxH))


class BertMaskedLMHead(nn.Module):
    """The transform block, then the tied word embeddings plus an output bias (fp32 logits)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x_BxPxH: jax.Array, word_embeddings_VxH: jax.Array) -> jax.Array:
        cfg = self.config
        h_BxPxH = BertPredictionTransform(cfg, name="transform")(x_BxPxH)
        output_bias_V = self.param(
            "output_bias", _zeros((VOCAB,)), (cfg.vocab_size,), cfg.param_dtype
        )
        embeddings_VxH = word_embeddings_VxH.astype(cfg.dtype)
        padding = -cfg.vocab_size % cfg.vocab_pad_multiple
        if padding:  # a matmul whose output rows are aligned; the padding's logits are cut off
            embeddings_VxH = jnp.pad(embeddings_VxH, ((0, padding), (0, 0)))
        logits_BxPxV = jnp.einsum(
            "bph,vh->bpv",
            h_BxPxH.astype(cfg.dtype),
            embeddings_VxH,
            preferred_element_type=jnp.float32,
        )[..., : cfg.vocab_size]
        return logits_BxPxV + output_bias_V.astype(jnp.float32)


def output_layer(
    module: nn.Module,
    config: BertConfig,
    num_labels: int,
    x_BxXxH: jax.Array,
    class_axis: str = LABELS,
) -> jax.Array:
    """Google's output layer (NSP, fine-tuning heads), created in `module`'s scope (call it from
    a compact method): `x @ output_weights.T + output_bias` with weights stored `[num_labels, in]`
    as the original names them; float32 logits."""
    weights_CxH = module.param(
        "output_weights",
        _init(config, (class_axis, EMBED)),
        (num_labels, x_BxXxH.shape[-1]),
        config.param_dtype,
    )
    bias_C = module.param("output_bias", _zeros((class_axis,)), (num_labels,), config.param_dtype)
    logits = jnp.einsum(
        "...h,ch->...c",
        x_BxXxH.astype(config.dtype),
        weights_CxH.astype(config.dtype),
        preferred_element_type=jnp.float32,
    )
    return logits + bias_C.astype(jnp.float32)


class BertNSPHead(nn.Module):
    """Next-sentence logits from the pooled output; weights stored `[2, H]` as the original."""

    config: BertConfig

    @nn.compact
    def __call__(self, pooled_BxH: jax.Array) -> jax.Array:
        return output_layer(self, self.config, 2, pooled_BxH, NSP_CLASSES)


def gather_positions(x_BxLxH: jax.Array, positions_BxP: jax.Array) -> jax.Array:
    """Picks the hidden states at the masked positions: `[B, L, H] -> [B, P, H]`.

    In 16-bit compute, a one-hot matmul (exact: one product by 1, the rest by 0): a gather's
    gradient is a scatter, and for the gather and scatter the H100 compiler laid the whole
    residual stream out batch-minor, with a transpose at every matmul (benchmarks/aot/
    levers.md). float32 keeps the gather (a float32 matmul may round through TF32)."""
    positions_BxP = positions_BxP.astype(jnp.int32)
    if x_BxLxH.dtype == jnp.float32:
        return jnp.take_along_axis(x_BxLxH, positions_BxP[:, :, None], axis=1)
    one_hot_BxPxL = positions_BxP[:, :, None] == jnp.arange(x_BxLxH.shape[1])
    return jnp.einsum("bpl,blh->bph", one_hot_BxPxL.astype(x_BxLxH.dtype), x_BxLxH)


class BertForPreTraining(nn.Module):
    """BERT with the masked-LM and next-sentence heads: `(mlm_logits [B, P, V], nsp_logits [B, 2]`
    (packed rows: `[B, K, 2]`)); the vocabulary projection runs only on the P gathered positions."""

    config: BertConfig

    def setup(self):
        self.bert = BertModel(self.config)
        self.predictions = BertMaskedLMHead(self.config)
        self.seq_relationship = BertNSPHead(self.config)

    def __call__(
        self,
        input_ids: jax.Array,
        token_type_ids: jax.Array,
        attention_mask: jax.Array,
        masked_lm_positions: jax.Array,
        deterministic: bool = True,
        **packed: jax.Array,
    ):
        sequence_BxLxH, pooled_BxH = self.bert(
            input_ids, token_type_ids, attention_mask, deterministic, **packed
        )
        masked_BxPxH = gather_positions(sequence_BxLxH, masked_lm_positions)
        mlm_logits = self.predictions(masked_BxPxH, self.bert.embeddings.word_embeddings)
        return mlm_logits, self.seq_relationship(pooled_BxH)


# ----------------------------------------------------------------------------- model-level helpers

# BertConfig fields that change what the weights compute: a checkpoint and a run must agree on
# them (converted checkpoints, init_checkpoint, fine-tuning, resuming).
ARCHITECTURE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
)
# BertConfig fields that change how the weights are stored (dtype, stacked layers), not what
# they compute: a resume must keep them; a conversion or a pretrained load may change them.
STORAGE_FIELDS = ("param_dtype", "scan_layers")


def architecture(config: BertConfig) -> dict[str, Any]:
    """`{field: value}` of the ARCHITECTURE_FIELDS."""
    return {name: getattr(config, name) for name in ARCHITECTURE_FIELDS}


def example_inputs(model: nn.Module) -> tuple[jax.Array, ...]:
    """Inputs for `model.init`: ids, segments, mask `[1, L]`, plus masked positions [1, 2] for
    BertForPreTraining (the parameters depend on neither batch size nor length). L is 128
    where the model allows it (TPU's Pallas kernel takes multiples of 128 only), else 8."""
    config = getattr(model, "config", None)
    length = 128 if getattr(config, "max_position_embeddings", 0) >= 128 else 8
    ids_1xL = (jnp.zeros((1, length), jnp.int32),) * 3
    return (
        ids_1xL + (jnp.zeros((1, 2), jnp.int32),)
        if isinstance(model, BertForPreTraining)
        else ids_1xL
    )


def abstract_params(model: nn.Module, boxed: bool = False) -> Any:
    """The model's parameters as ShapeDtypeStructs, computed without allocating them; `boxed`
    keeps flax's logical-axis boxes (for partition specs)."""
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), *example_inputs(model))["params"]
    )
    return params if boxed else nn.meta.unbox(params)
