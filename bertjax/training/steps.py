"""Pure, jittable pretraining steps: `train_step(state, batch)` and `eval_step(params, batch)`.

Batch features are those of the original TFRecords, unpacked or packed (`data.packing`);
`bertjax.data.batch` defines them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from bertjax.models import attention, families
from bertjax.models.layers import losses
from bertjax.training import objectives, optim, sharding
from bertjax.training.nonfinite import NonFinite
from bertjax.training.state import TrainState

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
# The name scope of what only a skipped step computes (the cause of its non-finite update).
SKIPPED_STEP_SCOPE = "skipped_step"


def forward(
    model: nn.Module,
    params: optax.Params,
    batch: Batch,
    deterministic: bool,
    dropout_rng: jax.Array | None = None,
    causal: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """`(mlm_logits, nsp_logits)` of the family's pretraining model (`nsp_logits` None
    without an NSP head: `families.Family.forward`); `causal`: each position attends to
    itself and the positions before it only (the left-to-right objective)."""
    rngs = None if deterministic else {"dropout": dropout_rng}
    mask = attention.causal_mask(batch["input_mask"]) if causal else batch["input_mask"]
    return families.of(model).forward(model, params, batch, mask, deterministic, rngs)


def _split_micro_batches(batch: Batch, accum_steps: int) -> Batch:
    """[B, ...] -> [A, B/A, ...], micro-batch a taking rows a, a+A, ... so every device
    contributes to every micro-batch (no resharding of the data-parallel axis)."""

    def split(x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0] // accum_steps, accum_steps, *x.shape[1:]))
        return jnp.moveaxis(x, 1, 0)

    return jax.tree.map(split, batch)


def make_train_step(
    model: nn.Module,
    tx: optax.GradientTransformation,
    accum_steps: int | Mapping[tuple[int, ...], int] = 1,
    objective: objectives.PretrainingObjective = objectives.PretrainingObjective(),
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Builds the pure train step: forward, loss, grads (accumulated over `accum_steps`
    micro-batches, or as many as it gives for the batch's `(rows, length)`: one per phase),
    clip + update (inside `tx`), and a skip of non-finite updates."""

    family = families.of(model)

    def loss_fn(
        params: optax.Params, micro: Batch, rng: jax.Array, denominators: Mapping[str, Any]
    ) -> losses.Loss:
        outputs = forward(model, params, micro, False, rng, objective.causal)
        return family.pretraining_loss(outputs, micro, denominators, objective.uses_nsp)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        micro_batches = (
            accum_steps
            if isinstance(accum_steps, int)
            else accum_steps.get(batch["input_ids"].shape, 1)
        )
        if objective.causal:
            batch = objectives.next_token_batch(batch)
        step_rng = jax.random.fold_in(state.rng, state.step)
        denominators = family.loss_denominators(batch)  # (the whole batch's, for each micro)
        if micro_batches == 1:
            (loss, metrics), grads = grad_fn(state.params, batch, step_rng, denominators)
        else:

            def accumulate(
                carry: tuple[jax.Array, Metrics, optax.Updates],
                micro_and_index: tuple[Batch, jax.Array],
            ) -> tuple[tuple[jax.Array, Metrics, optax.Updates], None]:
                micro, index = micro_and_index
                (loss, metrics), grads = grad_fn(
                    state.params, micro, jax.random.fold_in(step_rng, index), denominators
                )
                return jax.tree.map(jnp.add, carry, (loss, metrics, grads)), None

            split = _split_micro_batches(batch, micro_batches)
            zero = jax.eval_shape(
                lambda: grad_fn(
                    state.params, jax.tree.map(lambda x: x[0], split), step_rng, denominators
                )
            )
            (zero_loss, zero_metrics), zero_grads = jax.tree.map(
                lambda s: jnp.zeros(s.shape, jnp.float32), zero
            )
            (loss, metrics, grads), _ = jax.lax.scan(
                accumulate,
                (zero_loss, zero_metrics, zero_grads),
                (split, jnp.arange(micro_batches)),
            )
        return _apply_update(state, tx, loss, grads, metrics, batch)

    return train_step


def all_finite_grouped(tree: optax.Params) -> jax.Array:
    """`nonfinite.all_finite` as one reduction per distinct shape
    (`optim.float_leaves_by_shape`): the sum of `x * 0` over a group is 0, or NaN where any
    of its elements is not finite."""
    sums = [
        jnp.sum(sum(x.astype(jnp.float32) * 0 for x in group))
        for group in optim.float_leaves_by_shape(tree)
    ]
    return jnp.isfinite(sum(sums)) if sums else jnp.array(True)


def _apply_update(
    state: TrainState,
    tx: optax.GradientTransformation,
    loss: jax.Array,
    grads: optax.Updates,
    metrics: Metrics,
    batch: Batch,
) -> tuple[TrainState, Metrics]:
    """Clip + update (inside `tx`), applied only if the loss and the gradients' global norm
    are finite; adds grad_norm and `nonfinite` (0, or the `NonFinite` of a skipped step:
    INPUTS, LOSS_OR_GRADIENTS or STATE; after finite steps of the run, `nonfinite` names a
    STATE as UPDATE).

    The new state is not checked here (a check per leaf added kernels and step time to the
    H100 compile of BERT-large, as measured in benchmarks/aot/levers.md). It needs none: the
    state is finite at every restore (`nonfinite.check_finite`), and from a finite state, a
    finite norm (so every gradient's square is finite) gives finite Adam moments, convex
    combinations of finite values. Only an overflowing parameter update (an absurd learning
    rate or moment) can leave a non-finite state; the next step then finds it, and no
    checkpoint is written from it (`nonfinite.check_finite`)."""
    grad_norm = optim.global_norm(grads)
    gradients_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    updates, new_opt_state = tx.update(
        grads, optim.at_step(state.opt_state, state.step), state.params
    )
    new_params = optax.apply_updates(state.params, updates)

    def cause(_: None) -> jax.Array:
        # Named so that the GPU census leaves it out of a finite step's time (hlo_census).
        with jax.named_scope(SKIPPED_STEP_SCOPE):
            return jnp.select(
                [~all_finite_grouped(batch), ~all_finite_grouped((state.params, state.opt_state))],
                [float(NonFinite.INPUTS), float(NonFinite.STATE)],
                float(NonFinite.LOSS_OR_GRADIENTS),
            )

    # A non-finite step leaves params and optimizer state untouched (an elementwise select,
    # which XLA fuses into the update writing the donated buffers in place: a `lax.cond`
    # copied every float32 leaf first); the host stops the run after too many in a row, or
    # at once if the state itself is not finite (bertjax/training/nonfinite.py).
    params, opt_state = jax.tree.map(
        lambda new, old: jnp.where(gradients_finite, new, old),
        (new_params, new_opt_state),
        (state.params, state.opt_state),
    )
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    nonfinite = jax.lax.cond(gradients_finite, lambda _: jnp.float32(0.0), cause, None)
    return new_state, dict(metrics, grad_norm=grad_norm, nonfinite=nonfinite)


def make_loss_train_step(
    loss_fn: Callable[[optax.Params, Batch, jax.Array], tuple[jax.Array, Metrics]],
    tx: optax.GradientTransformation,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """A train step for any `loss_fn(params, batch, dropout_rng) -> (loss, metric sums)`
    (fine-tuning), with the same update and non-finite skip as pretraining."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        (loss, metrics), grads = grad_fn(
            state.params, batch, jax.random.fold_in(state.rng, state.step)
        )
        return _apply_update(state, tx, loss, grads, metrics, batch)

    return train_step


def make_eval_step(
    model: nn.Module, objective: objectives.PretrainingObjective = objectives.PretrainingObjective()
) -> Callable[[optax.Params, Batch], Metrics]:
    """Builds the deterministic evaluation step returning metric sums."""

    def eval_step(params: optax.Params, batch: Batch) -> Metrics:
        if objective.causal:
            batch = objectives.next_token_batch(batch)
        outputs = forward(model, params, batch, True, causal=objective.causal)
        return families.of(model).pretraining_loss(
            outputs, batch, next_sentence_prediction=objective.uses_nsp
        )[1]

    return eval_step


def jit_train_step(
    train_step: Callable, state_shardings: TrainState, mesh: Mesh
) -> jax.stages.Wrapped:
    """Compiles the train step with explicit shardings, donating the old state."""
    return jax.jit(
        train_step,
        in_shardings=(state_shardings, sharding.batch_sharding(mesh)),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnums=0,
    )


def jit_eval_step(eval_step: Callable, params_shardings: Any, mesh: Mesh) -> jax.stages.Wrapped:
    return jax.jit(
        eval_step,
        in_shardings=(params_shardings, sharding.batch_sharding(mesh)),
        out_shardings=sharding.replicated(mesh),
    )
