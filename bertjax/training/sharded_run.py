"""Build the sharded run once: the mesh, the model and optimizer, the abstract train state and
its shardings, the shardability check, the start-up memory report and the compiled steps.
Pretraining (`train`), fine-tuning (`finetune_loop`), `tools.aot` and `tools.bench` share it;
nothing here reads data or touches a checkpoint."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh

from bertjax.errors import ConfigError
from bertjax.models import families
from bertjax.models.families import ModelConfig
from bertjax.runtime import console
from bertjax.training import autofit, memory, objectives, optim, phase_schedule, sharding, steps
from bertjax.training.phase_schedule import Phase
from bertjax.training.settings import LongPhaseSettings
from bertjax.training.state import TrainState, create_train_state


@dataclasses.dataclass
class ShardedRun:
    """A model and optimizer placed on a mesh: abstract state (the restore target), its
    shardings and the jitted steps. `init_state` materialises a fresh state in place."""

    mesh: Mesh
    model: nn.Module
    tx: optax.GradientTransformation
    abstract_state: TrainState
    state_shardings: TrainState
    train_step: jax.stages.Wrapped  # (state, batch) -> (state, metrics); donates the state
    eval_step: jax.stages.Wrapped  # (params, batch) -> metrics or outputs
    grad_accum: dict[str, int] = dataclasses.field(default_factory=dict)  # by phase name

    def init_state(self, rng: jax.Array) -> TrainState:
        state, _, _ = create_train_state(
            self.model, self.tx, rng, families.example_inputs(self.model), self.mesh
        )
        assert state is not None  # (materialized)
        return state

    def restart_optimizer(self, state: TrainState) -> TrainState:
        """`state` with the optimizer state of a new run from its parameters (zero moments)."""
        return jax.jit(
            lambda s: s.replace(opt_state=self.tx.init(s.params)),
            out_shardings=self.state_shardings,
            donate_argnums=0,
        )(state)


def make_mesh(mesh: sharding.MeshSettings, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of `config.mesh` over `devices` (default: all); ConfigError if it cannot be."""
    try:
        return sharding.make_mesh(dataclasses.asdict(mesh), devices)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def build(
    model: nn.Module,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    train_step: Callable,
    eval_step: Callable,
) -> ShardedRun:
    """Abstract state and shardings of `model` + `tx` on `mesh`, and the steps compiled for
    them (`train_step(state, batch)`, `eval_step(params, batch)`, not yet jitted)."""
    _, abstract_state, shardings = create_train_state(
        model, tx, jax.random.PRNGKey(0), families.example_inputs(model), mesh, materialize=False
    )
    return ShardedRun(
        mesh,
        model,
        tx,
        abstract_state,
        shardings,
        steps.jit_train_step(train_step, shardings, mesh),
        steps.jit_eval_step(eval_step, shardings.params, mesh),
    )


def pretraining_optimizer(
    optimizer_cfg: Mapping, total_steps: int, long_phase: LongPhaseSettings, phases: Sequence[Phase]
) -> optim.OptimizerConfig:
    """`optimizer_cfg` over `total_steps`; with long_phase.restart_optimizer, its schedule
    starts again where the long phase does (the original's second run)."""
    optimizer = optim.optimizer_config(optimizer_cfg, total_steps)
    if not long_phase.restart_optimizer:
        return optimizer
    if len(phases) < 2:
        raise ConfigError(
            "long_phase.restart_optimizer=True restarts the optimizer between "
            "the two phases, but this run has one: set long_phase.fraction "
            "between 0 and 1, or restart_optimizer=False"
        )
    if optimizer.name != "bert_adam":
        raise ConfigError(
            f"long_phase.restart_optimizer=True needs optimizer.name='bert_adam' "
            f"(the original's, without bias correction), not {optimizer.name!r}, "
            "whose bias correction counts the steps of both phases"
        )
    return dataclasses.replace(
        optimizer,
        restart_step=phases[-1].start_step,
        restart_warmup_steps=long_phase.restart_warmup_steps,
        restart_peak_learning_rate=long_phase.restart_peak_learning_rate,
    )


def nearest_divisors(number: int, target: int) -> list[int]:
    """The divisors of `number` nearest `target`: the largest below it and the smallest above
    (one of them where the other does not exist)."""
    divisors = [d for d in range(1, number + 1) if number % d == 0]
    below = [d for d in divisors if d < target][-1:]
    above = [d for d in divisors if d > target][:1]
    return below + above


def check_batches(
    mesh: Mesh,
    phases: Sequence[Phase],
    grad_accum: int | Mapping[str, int],
    max_position_embeddings: int,
) -> None:
    """Checks every phase's global batch against the mesh, accumulation (micro-batches, for
    all phases or by phase name; 0 = auto: checked once chosen) and process count, and its
    length against the model's positions."""
    dp = sharding.data_parallel_size(mesh)
    for phase in phases:
        size = phase.global_batch_size
        grad_accum_steps = (
            grad_accum.get(phase.name, 1) if isinstance(grad_accum, Mapping) else grad_accum
        ) or 1
        if size % jax.process_count() or size % grad_accum_steps or (size // grad_accum_steps) % dp:
            field = phase_schedule.BATCH_FIELDS.get(phase.name, "train.global_batch_size")
            multiple = math.lcm(jax.process_count(), grad_accum_steps * dp)
            below, above = size // multiple * multiple, (size // multiple + 1) * multiple
            keep = (
                ""
                if size % grad_accum_steps
                else (
                    "; to keep this batch (a run that continues on other hardware), use a "
                    f"data-parallel size that divides {size // grad_accum_steps} (the nearest: "
                    f"{' or '.join(map(str, nearest_divisors(size // grad_accum_steps, dp)))})"
                )
            )
            raise ConfigError(
                f"global batch {size} (phase {phase.name}) must be divisible by the process count "
                f"({jax.process_count()}), and batch / grad_accum_steps ({grad_accum_steps}) by "
                f"the data-parallel size data*fsdp={dp}: set --config.{field} to a multiple of "
                f"{multiple} (the nearest: {' or '.join(str(b) for b in (below, above) if b)}), "
                f"or change train.grad_accum_steps or config.mesh{keep}"
            )
        if phase.max_seq_length > max_position_embeddings:
            raise ConfigError(
                f"phase {phase.name}: max_seq_length {phase.max_seq_length} > "
                f"model.max_position_embeddings {max_position_embeddings}"
            )


def build_pretraining(
    model_config: ModelConfig,
    optimizer: optim.OptimizerConfig,
    mesh: Mesh,
    phases: Sequence[Phase],
    grad_accum_steps: int | Mapping[str, int],
    report: bool = True,
    objective: objectives.PretrainingObjective = objectives.PretrainingObjective(),
) -> ShardedRun:
    """The pretraining run: the family's model (`families.pretraining_model`) with the
    configured optimizer on `mesh`, checked
    against the phases' batches and the mesh's divisibility; the chief prints the memory
    report of `phases` when `report`. `grad_accum_steps`: micro-batches of every phase, or by
    phase name; 0 = per phase, the fewest that fit the mesh's devices (`autofit`), in
    `ShardedRun.grad_accum`."""
    check_batches(mesh, phases, grad_accum_steps, model_config.max_position_embeddings)
    model = families.pretraining_model(model_config)
    tx = optim.make_optimizer(optimizer)
    _, abstract_state, _ = create_train_state(
        model, tx, jax.random.PRNGKey(0), families.example_inputs(model), mesh, materialize=False
    )
    by_phase = (
        dict(grad_accum_steps)
        if isinstance(grad_accum_steps, Mapping)
        else autofit.accumulation(grad_accum_steps, model_config, abstract_state, mesh, phases)
    )
    check_batches(mesh, phases, by_phase, model_config.max_position_embeddings)
    if isinstance(grad_accum_steps, int) and grad_accum_steps:
        accum: int | dict = grad_accum_steps  # the same for every batch
    else:  # a phase's batch shape -> its micro-batches
        accum = {(p.global_batch_size, p.max_seq_length): by_phase[p.name] for p in phases} or 1
    run = build(
        model,
        tx,
        mesh,
        steps.make_train_step(model, tx, accum, objective),
        steps.make_eval_step(model, objective),
    )
    run.grad_accum = by_phase
    try:
        memory.check_shardable(model_config, run.abstract_state.params, mesh)
        memory.check_host_memory(run.abstract_state, mesh)
    except (memory.MeshMismatch, memory.WontFit) as e:
        raise ConfigError(str(e)) from e
    if report:
        console.chief_print(memory.report(model, run.abstract_state, mesh, phases))
    return run
