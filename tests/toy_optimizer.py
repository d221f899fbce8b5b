"""An optimizer defined here in tests/ only: "toy_sgd", SGD with momentum `b1` and decoupled
weight decay (BERT's exclusions). It plugs into bertjax through `optim.register` alone (the
test registers it), to show that shared code needs no edit for a new optimizer."""

import optax

from bertjax.training import optim, param_masks


def sgd_momentum(
    cfg: optim.OptimizerConfig, schedule: optax.Schedule
) -> optax.GradientTransformation:
    """The optimizer section's `b1` as the momentum, `weight_decay_rate` decoupled."""
    return optax.chain(
        optax.add_decayed_weights(cfg.weight_decay_rate, mask=param_masks.decay_mask),
        optax.sgd(schedule, momentum=cfg.b1),
    )
