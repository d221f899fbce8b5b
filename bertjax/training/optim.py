"""The configured optimizer: `OptimizerConfig` (a config's `optimizer` section completed for a
run), the registry of optimizers by name (`register`, `get`, `names`: the built-in ones in
`optimizers.py`; a new one is a function registered here), and `make_optimizer`: the original's
global-norm clipping, then the named optimizer on the configured schedule (`schedules.py`)."""

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bertjax.errors import ConfigError
from bertjax.training import schedules

# (config, its schedule) -> the optimizer, without gradient clipping (make_optimizer adds it)
Builder = Callable[["OptimizerConfig", optax.Schedule], optax.GradientTransformation]
_BUILTIN = "bertjax.training.optimizers"
_OPTIMIZERS: dict[str, Builder] = {}


def register(name: str, build: Builder) -> Builder:
    """Makes `build` known as `optimizer.name=name` (again: replaced)."""
    _OPTIMIZERS[name] = build
    return build


def names() -> tuple[str, ...]:
    """The registered optimizers' names, the built-in ones first."""
    importlib.import_module(_BUILTIN)
    return tuple(_OPTIMIZERS)


def get(name: str) -> Builder:
    """The optimizer registered as `name`; ConfigError (one line) if none is (a config or a
    checkpoint's record naming an optimizer this process does not know)."""
    if name not in names():
        raise ConfigError(
            f"optimizer.name={name!r} is not one of {', '.join(map(repr, _OPTIMIZERS))}: an "
            "optimizer must be registered (bertjax.training.optim.register) before its "
            "configs or checkpoints are read"
        )
    return _OPTIMIZERS[name]


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
    """Global-norm clipping, then the optimizer registered as `cfg.name` on its schedule."""
    optimizer = get(cfg.name)(cfg, schedules.of_config(cfg))
    clip_norm = cfg.clip_global_norm
    if not clip_norm:
        return optimizer
    return optax.chain(clip_by_global_norm(clip_norm), optimizer)


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
    name: str = "bert_adam"  # one of names() (registered optimizers)
    weight_decay_rate: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-6
    clip_global_norm: float = 1.0
    schedule: str = "linear"  # one of schedules.SCHEDULE_NAMES
    decay_fraction: float = 0.1  # "wsd": the last fraction of the steps, decaying to 0
    decay_shape: str = "1-sqrt"  # "wsd": one of schedules.DECAY_SHAPES
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
