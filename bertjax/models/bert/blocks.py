"""What every BERT module is built from: TF's initialisers with logical axis names
(`bertjax.models.axes`), Dense and LayerNorm so made, the activation after a Dense."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from bertjax.models import compile_target
from bertjax.models.axes import NORM, ones, zeros
from bertjax.models.bert.config import ACTIVATIONS, BertConfig


def truncated_normal(config: BertConfig, axes: tuple[str, ...]) -> nn.initializers.Initializer:
    """Truncated normal (2 stddev), as TF's truncated_normal_initializer, with logical axes."""
    return nn.with_logical_partitioning(
        nn.initializers.truncated_normal(config.initializer_range), axes
    )


def dense(
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
        kernel_init=truncated_normal(config, axes),
        bias_init=zeros(axes[1:]),
        name=name,
        **fields,
    )


def activated_dense(
    config: BertConfig, features: int, axes: tuple[str, str], x: jax.Array
) -> jax.Array:
    """`activation(Dense(x))` with the Dense named "dense" (call from a compact method). On a
    GPU the bias add and the activation are rematerialised in the backward pass from the
    matmul's output (`RematActivatedDense`): it lowers the H100 compiler's peak memory and
    step time, and raises libtpu's peak, hence GPU only (measured in benchmarks/aot/levers.md).
    Same ops either way: identical values."""
    activation = ACTIVATIONS[config.hidden_act]
    if compile_target.target_platform() in ("gpu", "cuda"):
        return dense(config, features, axes, "dense", RematActivatedDense, activation=activation)(x)
    return activation(dense(config, features, axes, "dense")(x))


class RematActivatedDense(nn.Dense):
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


def layer_norm(config: BertConfig, name: str = "LayerNorm") -> nn.LayerNorm:
    # Statistics are computed in float32 whatever the compute dtype.
    return nn.LayerNorm(
        epsilon=config.layer_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        scale_init=ones((NORM,)),
        bias_init=zeros((NORM,)),
        name=name,
    )
