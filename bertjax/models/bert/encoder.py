"""BERT's encoder: the post-LN transformer layer (self-attention, its output, the FFN) and the
stack of them, unrolled or scanned, rematerialised by the config's policy.

Shape legend: B batch, L sequence length, H hidden size, N heads, D head size, F FFN size.
"""

from __future__ import annotations

import functools
import zlib

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.models import (
    add_norm_gpu,
    attention,
    bias_matmul,
    compile_target,
    feed_forward_gpu,
)
from bertjax.models.axes import (
    ACT_EMBED,
    ACT_MLP,
    ACT_QKV,
    BATCH,
    EMBED,
    LAYERS,
    LENGTH,
    MLP,
    NORM,
    QKV,
    constrain,
    ones,
    zeros,
)
from bertjax.models.bert.blocks import activated_dense, dense, layer_norm, truncated_normal
from bertjax.models.bert.config import REMAT_POLICIES, BertConfig
from bertjax.models.dropout import Dropout


class _DenseParams(nn.Module):
    """The kernel and bias of `dense` (same names, initializers and axes), unapplied."""

    config: BertConfig
    features: int
    axes: tuple[str, str]

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        kernel = self.param(
            "kernel",
            truncated_normal(cfg, self.axes),
            (in_features, self.features),
            cfg.param_dtype,
        )
        return kernel, self.param("bias", zeros(self.axes[1:]), (self.features,), cfg.param_dtype)


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
        dropout_rate = 0.0 if deterministic else cfg.attention_probs_dropout_prob
        spec = nn.logical_to_mesh_axes((BATCH, ACT_QKV))
        if cfg.dtype != "float32" and attention.runs_triton(
            cfg.attention_impl, cfg.dtype, cfg.head_size, length, mask, dropout_rate
        ):
            # On a GPU the Triton kernel reads q, k, v from one GEMM's `[B, L, 3, H]`, adds
            # their biases, and writes their gradients so: no layout copies, bias add or bias
            # reduce around it in either pass (bias_matmul.project_stacked).
            kernels, biases = zip(*params)
            heads = (cfg.num_attention_heads, cfg.head_size)
            qkv_BxLx3xH = bias_matmul.project_stacked(x_BxLxH.astype(cfg.dtype), jnp.stack(kernels))
            qkv_BxLx3xNxD = constrain(qkv_BxLx3xH, (BATCH, LENGTH, None, ACT_QKV)).reshape(
                batch, length, 3, *heads
            )
            bias_3xNxD = jnp.stack(biases).reshape(3, *heads)
            context_BxLxNxD = attention.attend_stacked(
                qkv_BxLx3xNxD, bias_3xNxD, mask, dropout_rate, spec
            )
            return context_BxLxNxD.reshape(batch, length, cfg.hidden_size)
        groups = [params] if cfg.dtype != "float32" else [[p] for p in params]
        projected_KxBxLxH = [
            bias_matmul.project(
                x_BxLxH.astype(cfg.dtype),
                jnp.stack(kernels).astype(cfg.dtype),
                jnp.stack(biases),
                compile_target.target_platform() == "tpu",
            )
            for kernels, biases in (zip(*group) for group in groups)
        ]
        if len(groups) == 1 and attention.runs_flash_dropout(
            cfg.attention_impl, cfg.dtype, cfg.head_size, length, mask, dropout_rate
        ):
            # On TPU the kernel reads the projection's `[3, B, L, H]` and writes its gradient
            # so: no slices of q, k, v to restack in the backward pass.
            return attention.attend_projected(
                constrain(projected_KxBxLxH[0], (None, BATCH, LENGTH, ACT_QKV)),
                cfg.num_attention_heads,
                mask,
                dropout_rate,
                spec,
            )
        projected = [
            constrain(y_BxLxH, (BATCH, LENGTH, ACT_QKV)).reshape(
                batch, length, cfg.num_attention_heads, cfg.head_size
            )
            for y_KxBxLxH in projected_KxBxLxH
            for y_BxLxH in y_KxBxLxH
        ]
        q_BxLxNxD, k_BxLxNxD, v_BxLxNxD = projected
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
            spec,
        )
        return context_BxLxNxD.reshape(batch, length, cfg.hidden_size)


class BertDenseOutput(nn.Module):
    """Dense back to H, dropout, residual add, post-LayerNorm (attention/output and output).
    With `first_dense` (the FFN's first kernel and bias), `y` is the FFN's input and the
    output's GEMMs apply the activation in their epilogues (`feed_forward_gpu`). Where
    `add_norm_gpu.runs`, the bias, dropout, residual and LayerNorm are one kernel's pass."""

    config: BertConfig
    input_axis: str

    @nn.compact
    def __call__(
        self,
        y: jax.Array,
        residual_BxLxH: jax.Array,
        deterministic: bool,
        first_dense: tuple[jax.Array, jax.Array] | None = None,
    ) -> jax.Array:
        cfg = self.config
        rate = 0.0 if deterministic else cfg.hidden_dropout_prob
        in_one_pass = add_norm_gpu.runs(
            cfg.dense_impl, cfg.dtype, y.shape[1], cfg.hidden_size, rate
        )
        bias: jax.Array | None = None  # the dense bias still to add (below, or in the kernel)
        if first_dense is not None:
            kernel, bias = _DenseParams(cfg, cfg.hidden_size, (MLP, EMBED), name="dense")(
                cfg.intermediate_size
            )
            first_kernel, first_bias = first_dense
            y_BxLxH = feed_forward_gpu.feed_forward_layer(
                y.astype(cfg.dtype),
                first_kernel.astype(cfg.dtype),
                first_bias.astype(cfg.dtype),
                kernel.astype(cfg.dtype),
                cfg.hidden_act,
            )
        elif self.input_axis == QKV and compile_target.target_platform() == "tpu":  # (bias_matmul)
            kernel, dense_bias = _DenseParams(cfg, cfg.hidden_size, (QKV, EMBED), name="dense")(
                y.shape[-1]
            )
            y_BxLxH = bias_matmul.project(
                y.astype(cfg.dtype), kernel[None].astype(cfg.dtype), dense_bias[None], True
            )[0]
        elif in_one_pass:
            kernel, bias = _DenseParams(
                cfg, cfg.hidden_size, (self.input_axis, EMBED), name="dense"
            )(y.shape[-1])
            y_BxLxH = y.astype(cfg.dtype) @ kernel.astype(cfg.dtype)
        else:
            y_BxLxH = dense(cfg, cfg.hidden_size, (self.input_axis, EMBED), "dense")(y)
        if in_one_pass:
            scale, offset = _LayerNormParams(cfg, name="LayerNorm")()
            out_BxLxH = add_norm_gpu.add_norm_layer(
                y_BxLxH,
                jnp.zeros_like(scale) if bias is None else bias,
                Dropout(rate).packed_mask(y_BxLxH.shape),
                residual_BxLxH.astype(cfg.dtype),
                scale,
                offset,
                rate,
                cfg.layer_norm_eps,
            )
        else:
            if bias is not None:
                y_BxLxH = y_BxLxH + bias.astype(cfg.dtype)
            y_BxLxH = Dropout(cfg.hidden_dropout_prob)(y_BxLxH, deterministic=deterministic)
            out_BxLxH = layer_norm(cfg)(y_BxLxH + residual_BxLxH)
        return constrain(out_BxLxH.astype(cfg.dtype), (BATCH, LENGTH, ACT_EMBED))


class _LayerNormParams(nn.Module):
    """`layer_norm`'s scale and bias (same names, initializers and axes), unapplied."""

    config: BertConfig

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        shape = (cfg.hidden_size,)
        scale = self.param("scale", ones((NORM,)), shape, cfg.param_dtype)
        return scale, self.param("bias", zeros((NORM,)), shape, cfg.param_dtype)


class BertAttention(nn.Module):
    config: BertConfig

    @nn.compact
    def __call__(self, x_BxLxH: jax.Array, mask: attention.Mask, deterministic: bool) -> jax.Array:
        context = BertSelfAttention(self.config, name="self")(x_BxLxH, mask, deterministic)
        return BertDenseOutput(self.config, QKV, name="output")(context, x_BxLxH, deterministic)


class BertLayer(nn.Module):
    """One post-LN transformer layer. Returns `(x, x if emit_output else None)` so it can be
    scanned (the second output is stacked over layers)."""

    config: BertConfig
    deterministic: bool = True
    emit_output: bool = False

    @nn.compact
    def __call__(
        self, x_BxLxH: jax.Array, mask: attention.Mask
    ) -> tuple[jax.Array, jax.Array | None]:
        cfg = self.config
        attended_BxLxH = BertAttention(cfg, name="attention")(x_BxLxH, mask, self.deterministic)
        if feed_forward_gpu.runs(
            cfg.dense_impl,
            cfg.dtype,
            x_BxLxH.shape[1],
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.hidden_act,
        ):
            out_BxLxH = BertDenseOutput(cfg, MLP, name="output")(
                attended_BxLxH,
                attended_BxLxH,
                self.deterministic,
                _IntermediateParams(cfg, name="intermediate")(),
            )
        else:
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
        y_BxLxF = activated_dense(cfg, cfg.intermediate_size, (EMBED, MLP), x_BxLxH)
        return constrain(y_BxLxF, (BATCH, LENGTH, ACT_MLP))


class _IntermediateParams(nn.Module):
    """`BertIntermediate`'s kernel and bias (same names), unapplied: the output's GEMMs apply
    them with the activation in their epilogues (`feed_forward_gpu`)."""

    config: BertConfig

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        cfg = self.config
        return _DenseParams(cfg, cfg.intermediate_size, (EMBED, MLP), name="dense")(cfg.hidden_size)


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
            return x_BxLxH if layers_NxBxLxH is None else layers_NxBxLxH  # (all_layers)
        outputs = []
        for i in range(cfg.num_hidden_layers):
            x_BxLxH, _ = layer_cls(cfg, deterministic, name=f"layer_{i}")(x_BxLxH, mask)
            outputs.append(x_BxLxH)
        return jnp.stack(outputs) if all_layers else x_BxLxH
