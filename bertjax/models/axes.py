"""The logical axis names of every family's parameters and activations: the models name their
axes with these, and the one rules table in `bertjax.training.sharding` maps them to mesh
axes (no mesh axis name appears in a model); `zeros` and `constrain` attach them."""

from __future__ import annotations

import flax.linen as nn
import jax

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


def zeros(axes: tuple[str | None, ...]) -> nn.initializers.Initializer:
    """Zeros (a bias's init) with logical axes."""
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), axes)


def ones(axes: tuple[str | None, ...]) -> nn.initializers.Initializer:
    """Ones (a LayerNorm scale's init) with logical axes."""
    return nn.with_logical_partitioning(nn.initializers.ones_init(), axes)


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
    """`x` laid out by its logical axes (as the rules table maps them)."""
    return nn.with_logical_constraint(x, axes)


def mesh_axes(logical: str) -> str | tuple[str, ...] | None:
    """The mesh axes the active rules map the logical axis `logical` to (None: none)."""
    spec = nn.logical_to_mesh_axes((logical,))
    return None if spec is None else spec[0]
