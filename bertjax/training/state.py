"""The train state, its abstract shape and shardings, and sharded initialisation.

The full state is never materialised on one device: `jax.eval_shape` gives the abstract
state, the model's logical axis names give its shardings, and a jitted init with those
`out_shardings` creates every array directly in place. The same abstract state (with
shardings) is the restore target for checkpoints, on any mesh.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from bertjax.training import sharding


class TrainState(flax.struct.PyTreeNode):
    """Everything a step needs and a checkpoint keeps (besides the data position)."""

    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any
    opt_state: Any
    rng: jax.Array  # uint32[2] raw key; dropout keys are folded from it with the step


def _init_fn(
    model: nn.Module, tx: optax.GradientTransformation, example_inputs: tuple[jax.Array, ...]
) -> Callable[[jax.Array], tuple[TrainState, Mapping[str, Any]]]:
    """Returns `rng -> (state, boxed_params)`; the boxed params carry logical axis names."""

    def init(rng: jax.Array) -> tuple[TrainState, Mapping[str, Any]]:
        params_rng, state_rng = jax.random.split(rng)
        boxed_params = model.init(params_rng, *example_inputs)["params"]
        params = nn.meta.unbox(boxed_params)
        state = TrainState(
            step=jnp.zeros([], jnp.int32), params=params, opt_state=tx.init(params), rng=state_rng
        )
        return state, boxed_params

    return init


def state_shardings(
    abstract_state: TrainState,
    boxed_params: Mapping[str, Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
) -> TrainState:
    """NamedShardings for every leaf: params by their logical axes, optimizer moments like
    their params, everything else (counters, rng) replicated."""
    param_shardings = sharding.logical_to_sharding(nn.get_partition_spec(boxed_params), mesh)
    replicated = sharding.replicated(mesh)

    def masked(x: object) -> bool:
        return isinstance(x, optax.MaskedNode)  # no state for a frozen parameter

    opt_shardings = optax.tree_map_params(
        tx,
        lambda p, s: p if masked(p) else s,
        abstract_state.opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=masked,
    )
    # (a TrainState-shaped tree of shardings, one per leaf, as jax.jit's shardings take)
    return TrainState(
        step=replicated,  # type: ignore[arg-type]
        rng=replicated,  # type: ignore[arg-type]
        params=param_shardings,
        opt_state=opt_shardings,
    )


def create_train_state(
    model: nn.Module,
    tx: optax.GradientTransformation,
    rng: jax.Array,
    example_inputs: tuple[jax.Array, ...],
    mesh: Mesh,
    materialize: bool = True,
) -> tuple[TrainState | None, TrainState, TrainState]:
    """Returns `(state or None, abstract_state, shardings)`.

    With `materialize=False` only the abstract state and shardings are computed (for a
    restore, which then needs no initialisation at all).
    """
    init = _init_fn(model, tx, example_inputs)
    abstract_state, abstract_boxed = jax.eval_shape(init, rng)
    shardings = state_shardings(abstract_state, abstract_boxed, tx, mesh)
    with sharding.activate(mesh):
        abstract_state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state,
            shardings,
        )
        if not materialize:
            return None, abstract_state, shardings
        state = jax.jit(lambda r: init(r)[0], out_shardings=shardings)(rng)
    return state, abstract_state, shardings


def count_params(params: optax.Params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
