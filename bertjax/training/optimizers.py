"""The built-in optimizers, each registered by name (`optim.register`): "bert_adam" reproduces
Google BERT's `AdamWeightDecayOptimizer` (Adam moments without bias correction, decoupled
weight decay added to the Adam ratio); "adamw" and "lamb" are optax's; "stable_adamw" is the
modern recipe's (per-tensor update clipping). Each takes BERT's weight-decay exclusions
(`param_masks.decay_mask`)."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bertjax.training import optim, param_masks


class ScaleByAdamNoBiasCorrectionState(NamedTuple):
    """Adam moments without bias correction; `count` is kept for bookkeeping."""

    count: jax.Array  # type: ignore[assignment]  # (the checkpointed name; shadows tuple.count)
    mu: optax.Updates
    nu: optax.Updates


def scale_by_adam_no_bias_correction(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6
) -> optax.GradientTransformation:
    """Rescale updates to m / (sqrt(v) + eps) with un-corrected Adam moments."""

    def init_fn(params: optax.Params) -> ScaleByAdamNoBiasCorrectionState:
        # float32 moments with the params' tree structure, so they shard like params.
        return ScaleByAdamNoBiasCorrectionState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree_utils.tree_zeros_like(params, dtype=jnp.float32),
            nu=optax.tree_utils.tree_zeros_like(params, dtype=jnp.float32),
        )

    def update_fn(
        updates: optax.Updates,
        state: ScaleByAdamNoBiasCorrectionState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, ScaleByAdamNoBiasCorrectionState]:
        del params
        grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), updates)
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
        nu = jax.tree_util.tree_map(
            lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, grads
        )
        ratio = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        count = optax.safe_increment(state.count)
        return ratio, ScaleByAdamNoBiasCorrectionState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def bert_adam(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay_rate: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    decay_mask: Any | None = None,
) -> optax.GradientTransformation:
    """Google BERT's AdamWeightDecayOptimizer; `decay_mask` (bool tree or fn) defaults to BERT's."""
    mask = param_masks.decay_mask if decay_mask is None else decay_mask
    return optax.chain(
        scale_by_adam_no_bias_correction(b1=b1, b2=b2, eps=eps),
        # Added after the Adam ratio, so the decay is scaled by lr (decoupled).
        optax.add_decayed_weights(weight_decay_rate, mask=mask),
        optax.scale_by_learning_rate(learning_rate),
    )


class ScaleByStableAdamState(NamedTuple):
    """Bias-corrected Adam moments (float32) and the step count."""

    count: jax.Array  # type: ignore[assignment]  # (the checkpointed name; shadows tuple.count)
    mu: optax.Updates
    nu: optax.Updates


def scale_by_stable_adam(
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-6,
    weight_decay_rate: float = 0.0,
    decay_mask: Any | None = None,
) -> optax.GradientTransformation:
    """StableAdamW's direction before the learning rate (Wortsman et al. 2023, "Stable and
    low-precision training for large-scale vision-language models", Algorithm 2; ModernBERT's
    optimizer): AdamW's bias-corrected `m / (sqrt(v) + eps) + weight_decay * param`, each
    tensor's scaled by `1 / max(1, RMS)` with `RMS = sqrt(mean(g^2 / max(v, eps^2)))`: a
    tensor whose gradient jumps far above its running second moment takes a smaller step
    (update clipping, in place of global-norm gradient clipping)."""
    mask = param_masks.decay_mask if decay_mask is None else decay_mask

    def init_fn(params: optax.Params) -> ScaleByStableAdamState:
        zeros = optax.tree_utils.tree_zeros_like(params, dtype=jnp.float32)
        return ScaleByStableAdamState(jnp.zeros([], jnp.int32), zeros, zeros)

    def update_fn(
        updates: optax.Updates, state: ScaleByStableAdamState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByStableAdamState]:
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), updates)
        mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * jnp.square(g), state.nu, grads)
        count = optax.safe_increment(state.count)
        step = count.astype(jnp.float32)
        mu_scale, nu_scale = 1.0 / (1.0 - b1**step), 1.0 / (1.0 - b2**step)
        decayed = mask(params) if callable(mask) else mask

        def direction(
            g: jax.Array, m: jax.Array, v: jax.Array, p: jax.Array, decay: bool
        ) -> jax.Array:
            v_hat = v * nu_scale
            rms = jnp.sqrt(jnp.mean(jnp.square(g) / jnp.maximum(v_hat, eps * eps)))
            update = m * mu_scale / (jnp.sqrt(v_hat) + eps)
            if decay and weight_decay_rate:
                update = update + weight_decay_rate * p.astype(jnp.float32)
            return update / jnp.maximum(1.0, rms)

        out = jax.tree.map(direction, grads, mu, nu, params, decayed)
        return out, ScaleByStableAdamState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def _bert_adam(
    cfg: optim.OptimizerConfig, schedule: optax.Schedule
) -> optax.GradientTransformation:
    return bert_adam(schedule, cfg.weight_decay_rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def _adamw(cfg: optim.OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(
        schedule,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        mu_dtype=jnp.float32,
        weight_decay=cfg.weight_decay_rate,
        mask=param_masks.decay_mask,
    )


def _lamb(cfg: optim.OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.lamb(
        schedule,
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay_rate,
        mask=param_masks.decay_mask,
    )


def _stable_adamw(
    cfg: optim.OptimizerConfig, schedule: optax.Schedule
) -> optax.GradientTransformation:
    return optax.chain(
        scale_by_stable_adam(cfg.b1, cfg.b2, cfg.eps, cfg.weight_decay_rate),
        optax.scale_by_learning_rate(schedule),
    )


optim.register("bert_adam", _bert_adam)
optim.register("adamw", _adamw)
optim.register("lamb", _lamb)
optim.register("stable_adamw", _stable_adamw)
