"""Learning-rate schedules: the original's linear warmup and linear decay
(`optimization.py`), with a restart (long_phase.restart_optimizer) and the schedules of an
extended run's earlier plans, and the modern recipe's warmup-stable-decay; each built from an
optimizer config (`of_config`: any object with `ScheduleFields`, such as
`optim.OptimizerConfig`)."""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
import optax

SCHEDULE_NAMES = ("linear", "wsd")  # BERT's warmup + linear decay | warmup-stable-decay
DECAY_SHAPES = ("linear", "1-sqrt")  # how "wsd" decays to 0


class ScheduleFields(Protocol):
    """What a schedule reads of an optimizer config (`optim.OptimizerConfig` has them; optim
    builds its optimizers on these schedules, so this module does not import it)."""

    @property
    def schedule(self) -> str: ...
    @property
    def peak_learning_rate(self) -> float: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def decay_fraction(self) -> float: ...
    @property
    def decay_shape(self) -> str: ...
    @property
    def restart_step(self) -> int: ...
    @property
    def restart_warmup_steps(self) -> int: ...
    @property
    def restart_peak_learning_rate(self) -> float: ...
    @property
    def earlier(self) -> tuple[tuple[int, ScheduleFields], ...]: ...


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


def of_config(cfg: ScheduleFields) -> optax.Schedule:
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


def _run_schedule(cfg: ScheduleFields) -> optax.Schedule:
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


def learning_rate_at(cfg: ScheduleFields, step: int) -> float:
    """Host-side learning rate at `step`, for logging."""
    return float(of_config(cfg)(step))
