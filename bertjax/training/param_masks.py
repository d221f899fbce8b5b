"""Which parameters an optimizer updates and decays: the original's weight-decay exclusions
(`decay_mask`: not LayerNorm, not bias; not ModernBERT's norms) and a frozen encoder
(`train_only_outside`: no update, no optimizer state)."""

from typing import Any

import jax
import optax

# Substrings that exclude a variable from weight decay, as in the original
# `exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]`.
_NO_DECAY_ANYWHERE = ("LayerNorm", "layer_norm")
_NO_DECAY_LEAF = "bias"
# ModernBERT's LayerNorms (bertjax.models.modernbert.model, transformers' names), excluded as BERT's are.
_NO_DECAY_MODULES = ("norm", "attn_norm", "mlp_norm", "final_norm")


def _key_name(entry: jax.tree_util.KeyEntry) -> str:
    """Return the string name of one pytree path entry (dict key, attribute or index)."""
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _is_decayed(path: tuple) -> bool:
    """Apply the original exclusion rule to one parameter path."""
    names = [_key_name(entry) for entry in path]
    if any(word in name for name in names for word in _NO_DECAY_ANYWHERE) or any(
        name in _NO_DECAY_MODULES for name in names
    ):
        return False
    return not (names and _NO_DECAY_LEAF in names[-1])


def decay_mask(params: optax.Params) -> Any:
    """Return a bool pytree: True where weight decay applies (not LayerNorm, not bias; not
    ModernBERT's norms)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _is_decayed(path), params)


def train_only_outside(
    tx: optax.GradientTransformation, params: optax.Params, frozen: str
) -> optax.GradientTransformation:
    """`tx` for every top-level entry of `params` but `frozen` (e.g. "bert" for a
    feature-based tagger), which gets no update and no optimizer state (no Adam moments)."""
    labels = {
        name: jax.tree.map(lambda _, name=name: "frozen" if name == frozen else "tagger", tree)
        for name, tree in params.items()
    }
    return optax.multi_transform({"tagger": tx, "frozen": optax.set_to_zero()}, labels)
