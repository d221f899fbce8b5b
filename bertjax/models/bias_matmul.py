"""`x @ kernel + bias` whose gradient takes the bias's share from the kernel's own matmul.

Autodiff gives a bias's gradient as a reduce of the output's gradient over every row
(`[B, L]`), a pass of its own over that gradient. libtpu's cost model puts those reduces at
4.6 of BERT-large's 63.9 ms on tpu-v5p-8 at L=128 (the attention projections' and the two
output denses'), against 0.4 at memory speed. Here the backward pass multiplies the gradient
by `[x, 1]` instead of `x`: the last row of that product is the bias's gradient, and the
matmul that computes the kernel's gradient computes it too. On TPU only (`fused`): other
backends keep autodiff's ops, so their numbers are unchanged.

`project_stacked` is the GPU's form (where the layer feeds bertjax's Triton attention kernel):
one GEMM `[B * L, I] x [I, K * O]` whose output is `[B, L, K, O]`, without the bias: the
kernel adds it as it loads each block and sums its gradient as it writes the projections'
(`flash_dropout_gpu.flash_dropout_biased`; XLA left the bias add out of the GEMM's epilogue
there). The backward pass's dX and dW are then plain GEMMs of the gradient as the kernel
writes it, with no transposes and no bias reduce.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def project(
    x_BxLxI: jax.Array, kernel_KxIxO: jax.Array, bias_KxO: jax.Array, fused: bool
) -> jax.Array:
    """`[K, B, L, O]`: x through each of K stacked kernels plus its bias, all in x's dtype;
    `fused`: the bias's gradient from the kernel's matmul (module docstring)."""
    if fused:
        return _fused_project(
            x_BxLxI, kernel_KxIxO.astype(x_BxLxI.dtype), bias_KxO.astype(x_BxLxI.dtype)
        )
    return jnp.einsum("bli,kio->kblo", x_BxLxI, kernel_KxIxO) + bias_KxO[:, None, None].astype(
        x_BxLxI.dtype
    )


def project_stacked(x_BxLxI: jax.Array, kernel_KxIxO: jax.Array) -> jax.Array:
    """`[B, L, K, O]`: x through each of K stacked kernels, in x's dtype, as one GEMM with the
    K kernels side by side (`[I, K * O]`: the small weight transposed); no bias (above)."""
    batch, length, inputs = x_BxLxI.shape
    stacks, _, outputs = kernel_KxIxO.shape
    kernel_IxKO = jnp.moveaxis(kernel_KxIxO.astype(x_BxLxI.dtype), 0, 1).reshape(inputs, -1)
    y_BLxKO = x_BxLxI.reshape(-1, inputs) @ kernel_IxKO
    return y_BLxKO.reshape(batch, length, stacks, outputs)


@jax.custom_vjp
def _fused_project(x_BxLxI: jax.Array, kernel_KxIxO: jax.Array, bias_KxO: jax.Array) -> jax.Array:
    return project(x_BxLxI, kernel_KxIxO, bias_KxO, False)


def _forward(
    x_BxLxI: jax.Array, kernel_KxIxO: jax.Array, bias_KxO: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return project(x_BxLxI, kernel_KxIxO, bias_KxO, False), (x_BxLxI, kernel_KxIxO)


def _backward(
    saved: tuple[jax.Array, jax.Array], g_KxBxLxO: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    x_BxLxI, kernel_KxIxO = saved
    inputs = x_BxLxI.shape[-1]
    ones_BxLx1 = jnp.ones((*x_BxLxI.shape[:-1], 1), x_BxLxI.dtype)
    kernel_and_bias = jnp.einsum(
        "bli,kblo->kio", jnp.concatenate([x_BxLxI, ones_BxLx1], -1), g_KxBxLxO
    )
    return (
        jnp.einsum("kblo,kio->bli", g_KxBxLxO, kernel_KxIxO),
        kernel_and_bias[:, :inputs],
        kernel_and_bias[:, inputs],
    )


_fused_project.defvjp(_forward, _backward)
