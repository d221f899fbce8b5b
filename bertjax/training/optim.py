"""Optimizers and learning-rate schedules for BERT pretraining and fine-tuning.

`bert_adam` reproduces Google BERT's `AdamWeightDecayOptimizer`: Adam moments
without bias correction, decoupled weight decay added to the Adam ratio, and the
linear-warmup / linear-decay schedule of `optimization.py`. The modern recipe's
`stable_adamw` (per-tensor update clipping) and warmup-stable-decay schedule sit beside them.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

# Substrings that exclude a variable from weight decay, as in the original
# `exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"]`.
_NO_DECAY_ANYWHERE = ("LayerNorm", "layer_norm")
_NO_DECAY_LEAF = "bias"
# ModernBERT's LayerNorms (bertjax.models.modernbert.model, transformers' names), excluded as BERT's are.
_NO_DECAY_MODULES = ("norm", "attn_norm", "mlp_norm", "final_norm")

OPTIMIZER_NAMES = ("bert_adam", "adamw", "lamb", "stable_adamw")
SCHEDULE_NAMES = ("linear", "wsd")  # BERT's warmup + linear decay | warmup-stable-decay
DECAY_SHAPES = ("linear", "1-sqrt")  # how "wsd" decays to 0


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


# `bert_adam` has a parameter named `decay_mask`; this alias keeps the default reachable.
_default_decay_mask = decay_mask


def bert_adam(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay_rate: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    decay_mask: Any | None = None,
) -> optax.GradientTransformation:
    """Google BERT's AdamWeightDecayOptimizer; `decay_mask` (bool tree or fn) defaults to BERT's."""
    mask = _default_decay_mask if decay_mask is None else decay_mask
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
    mask = _default_decay_mask if decay_mask is None else decay_mask

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


def bert_schedule(peak_lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup to `peak_lr`, then linear decay of peak*(1 - step/total) to 0."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps}")

    def schedule(step: jax.typing.ArrayLike) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        # The original decays from step 0 and overrides with warmup while
        # step < warmup, so the decay is not shifted by the warmup length.
        decayed = peak_lr * (1.0 - jnp.minimum(step, total_steps) / total_steps)
        warmup = peak_lr * step / max(warmup_steps, 1)
        return jnp.where(step < warmup_steps, warmup, decayed).astype(jnp.float32)

    return schedule


def wsd_schedule(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    decay_fraction: float = 0.1,
    decay_shape: str = "1-sqrt",
) -> optax.Schedule:
    """Warmup-stable-decay (the "trapezoidal" schedule; Xing et al. 2018, Hu et al. 2024;
    ModernBERT's, with its 1-sqrt decay of Hägele et al. 2024): linear warmup to `peak_lr`,
    `peak_lr` until the last `decay_fraction` of `total_steps`, then down to 0 at
    `total_steps`, linearly or as `1 - sqrt(fraction of the decay done)`."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if decay_shape not in DECAY_SHAPES:
        raise ValueError(f"decay_shape {decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
    decay_steps = max(1, round(decay_fraction * total_steps))
    decay_start = total_steps - decay_steps

    def schedule(step: jax.typing.ArrayLike) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        done = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
        factor = 1.0 - (jnp.sqrt(done) if decay_shape == "1-sqrt" else done)
        warmup = peak_lr * step / max(warmup_steps, 1)
        return jnp.where(step < warmup_steps, warmup, peak_lr * factor).astype(jnp.float32)

    return schedule


def _schedule_from_config(cfg: "OptimizerConfig") -> optax.Schedule:
    """The schedule of `cfg` (`_run_schedule`), after those of the steps it extends
    (`cfg.earlier`: each holds for the steps before its end step)."""
    earlier = cfg.earlier
    current = _run_schedule(cfg)
    if not earlier:
        return current
    ends = [end for end, _ in earlier]
    before = [_run_schedule(config) for _, config in earlier]

    def schedule(step: jax.typing.ArrayLike) -> jax.Array:
        value = current(step)
        for end, rate in reversed(list(zip(ends, before))):
            value = jnp.where(step < end, rate(step), value)
        return value

    return schedule


def _run_schedule(cfg: "OptimizerConfig") -> optax.Schedule:
    """Build the BERT schedule from a config's lr fields: with a `restart_step`, one schedule
    to that step and a second one (its own warmup and peak) from it to `total_steps`."""
    restart = cfg.restart_step
    if cfg.schedule == "wsd":
        return wsd_schedule(
            cfg.peak_learning_rate,
            cfg.warmup_steps,
            cfg.total_steps,
            cfg.decay_fraction,
            cfg.decay_shape,
        )
    if not restart:
        return bert_schedule(cfg.peak_learning_rate, cfg.warmup_steps, cfg.total_steps)
    first = bert_schedule(cfg.peak_learning_rate, cfg.warmup_steps, restart)
    second = bert_schedule(
        cfg.restart_peak_learning_rate or cfg.peak_learning_rate,
        cfg.warmup_steps if cfg.restart_warmup_steps < 0 else cfg.restart_warmup_steps,
        cfg.total_steps - restart,
    )
    return lambda step: jnp.where(step < restart, first(step), second(step - restart))


def _base_optimizer(
    cfg: "OptimizerConfig", schedule: optax.Schedule
) -> optax.GradientTransformation:
    """Build the optimizer named by `cfg.name`, without gradient clipping."""
    name, weight_decay, b1, b2, eps = cfg.name, cfg.weight_decay_rate, cfg.b1, cfg.b2, cfg.eps
    if name == "bert_adam":
        return bert_adam(schedule, weight_decay, b1=b1, b2=b2, eps=eps)
    if name == "adamw":
        return optax.adamw(
            schedule,
            b1=b1,
            b2=b2,
            eps=eps,
            mu_dtype=jnp.float32,
            weight_decay=weight_decay,
            mask=decay_mask,
        )
    if name == "stable_adamw":
        return optax.chain(
            scale_by_stable_adam(b1, b2, eps, weight_decay), optax.scale_by_learning_rate(schedule)
        )
    if name == "lamb":
        return optax.lamb(
            schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
        )
    raise ValueError(f"Unknown optimizer {name!r}; valid names: {', '.join(OPTIMIZER_NAMES)}")


def float_leaves_by_shape(tree: optax.Params) -> list[list[jax.Array]]:
    """The float leaves of `tree`, grouped by shape and dtype (e.g. one group for the 24
    layers' query kernels), so that a reduction over the tree is one kernel per group."""
    groups: dict[tuple, list[jax.Array]] = {}
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            groups.setdefault((x.shape, x.dtype), []).append(x)
    return list(groups.values())


def global_norm(tree: optax.Updates) -> jax.Array:
    """The L2 norm of every float in `tree` (float32): one sum of squares per distinct shape,
    over its leaves added elementwise, not one per leaf."""
    sums = [
        jnp.sum(sum(jnp.square(x.astype(jnp.float32)) for x in group))
        for group in float_leaves_by_shape(tree)
    ]
    return jnp.sqrt(sum(sums)) if sums else jnp.float32(0.0)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """tf.clip_by_global_norm, as the original: `g * max_norm / max(norm, max_norm)`, with
    the norm of `global_norm` (state as optax's clip_by_global_norm: empty)."""

    def update(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        scale = max_norm / jnp.maximum(global_norm(updates), max_norm)
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: "OptimizerConfig") -> optax.GradientTransformation:
    """Build global-norm clipping followed by the configured optimizer and schedule."""
    optimizer = _base_optimizer(cfg, _schedule_from_config(cfg))
    clip_norm = cfg.clip_global_norm
    if not clip_norm:
        return optimizer
    return optax.chain(clip_by_global_norm(clip_norm), optimizer)


def learning_rate_at(cfg: "OptimizerConfig", step: int) -> float:
    """Host-side learning rate at `step`, for logging."""
    return float(_schedule_from_config(cfg)(step))


def at_step(opt_state: optax.OptState, step: jax.Array) -> optax.OptState:
    """`opt_state` with every step counter (optax's integer `count`s) set to the train
    state's `step`: the learning rate applied is then schedule(step), the one the log and
    the phase switch use, also after skipped non-finite steps (which advance `step` only)."""
    return jax.tree.map(
        lambda x: (
            jnp.asarray(step, x.dtype)
            if jnp.issubdtype(x.dtype, jnp.integer) and x.ndim == 0
            else x
        ),
        opt_state,
    )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """What `make_optimizer` reads: a config's `optimizer` section plus the run's step counts."""

    peak_learning_rate: float
    warmup_steps: int
    total_steps: int
    name: str = "bert_adam"
    weight_decay_rate: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    clip_global_norm: float = 1.0
    schedule: str = "linear"  # one of SCHEDULE_NAMES
    decay_fraction: float = 0.1  # "wsd": the last fraction of the steps, decaying to 0
    decay_shape: str = "1-sqrt"  # "wsd": one of DECAY_SHAPES
    # Restart (long_phase.restart_optimizer): from this step on, the schedule starts again;
    # 0 = never. Warmup -1 and peak 0 mean the first schedule's.
    restart_step: int = 0
    restart_warmup_steps: int = -1
    restart_peak_learning_rate: float = 0.0
    # An extended run (train.extend): the schedules of the steps it had been planned for,
    # oldest first, each as (end step, its config): it holds for the steps before its end
    # not covered by an older one; this config's own schedule for the steps after.
    earlier: tuple[tuple[int, "OptimizerConfig"], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """This config as JSON values (a checkpoint's `meta`); `from_json` reads it back."""
        return {
            **dataclasses.asdict(self),
            "earlier": [[end, config.to_json()] for end, config in self.earlier],
        }

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> "OptimizerConfig":
        return cls(
            **{
                **values,
                "earlier": tuple(
                    (end, cls.from_json(config)) for end, config in values.get("earlier", [])
                ),
            }
        )


def optimizer_config(
    optimizer: Mapping[str, Any], total_steps: int, **overrides: float
) -> OptimizerConfig:
    """The one way pretraining and fine-tuning complete their `optimizer` config section:
    with the run's `total_steps`, and `overrides` (fine-tuning's learning rate and warmup,
    which its config holds outside the section)."""
    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    values = {k: v for k, v in optimizer.items() if k in names}
    return OptimizerConfig(**{**values, "total_steps": total_steps, **overrides})


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
