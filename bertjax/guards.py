"""Checks that keep a long pretraining run safe to interrupt and resume.

* `data_identity` / `check_data_compatible`: a resume in the same workdir must keep the
  data settings of the phase it continues (corpus, sequence length, global batch); moving on
  to the next phase of the schedule (an intended phase switch) may change them.
* `check_finite`: no checkpoint is written from a state holding NaN or Inf.
* `poison_batch`: the test-only NaN injection behind `train.debug_nan_steps`.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bertjax import checkpoint
from bertjax.data import pipeline
from bertjax.schedule import Phase

# Per-phase settings that a resume within the same phase must keep.
PHASE_FIELDS = ("max_seq_length", "global_batch_size")


class IncompatibleResume(checkpoint.CheckpointMismatch):
    """The workdir's checkpoint was written with data settings this run changes."""


class NonFiniteState(RuntimeError):
    """The train state holds NaN or Inf; it must not be checkpointed."""


def data_identity(data_cfg: Any, phases: Sequence[Phase]) -> dict[str, Any]:
    """What a checkpoint records about its data: the corpus, each phase's shape and, when on,
    packing (as it reads back from JSON, so that it compares equal after a restore)."""
    identity = {"source": pipeline.source_identity(data_cfg),
                "phases": {p.name: {f: getattr(p, f) for f in PHASE_FIELDS} for p in phases}}
    if data_cfg.get("packing"):  # absent when off: older checkpoints compare equal
        identity["packing"] = {"max_instances": data_cfg.packing_max_instances}
    return json.loads(json.dumps(identity))


def check_data_compatible(found: dict[str, Any] | None, expected: dict[str, Any],
                          position: dict[str, Any], run_phase: str, where: str) -> None:
    """Raises IncompatibleResume if this run continues a phase the checkpoint is in the
    middle of (its data `position` is past the first batch of `run_phase`, this run's phase
    at that step) with another corpus, sequence length or global batch. A checkpoint at
    the start of a phase, or followed by another phase in this run's schedule, passes."""
    resume_phase = position["phase"]
    if not found or resume_phase != run_phase or position["batch_index"] == 0:
        return
    old, new = found["phases"].get(resume_phase, {}), expected["phases"][resume_phase]
    changes = [f"{field}: {old.get(field)} -> {new[field]}" for field in PHASE_FIELDS
               if old.get(field) != new[field]]
    if found["source"] != expected["source"]:
        changes.append(f"data source: {found['source']} -> {expected['source']}")
    if found.get("packing") != expected.get("packing"):
        changes.append(f"data.packing: {found.get('packing')} -> {expected.get('packing')}")
    if changes:
        raise IncompatibleResume(
            f"checkpoint {where} is in the middle of phase {resume_phase!r}, which this run "
            f"continues with different data settings ({'; '.join(changes)}). Use a new "
            "--workdir, or the settings of the run that wrote it (a new phase may change them "
            "once the previous one has finished).")


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def check_finite(state: Any, step: int) -> None:
    """Raises NonFiniteState unless every float in params and optimizer state is finite."""
    for name in ("params", "opt_state"):
        if not bool(jax.device_get(_all_finite(getattr(state, name)))):
            raise NonFiniteState(f"step {step}: the {name} hold NaN or Inf; refusing to write a "
                                 "checkpoint (the last finished checkpoint is intact)")


def poison_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A copy of `batch` whose masked-LM weights are NaN, so loss and gradients are NaN."""
    weights = np.full_like(batch["masked_lm_weights"], np.nan)
    return {**batch, "masked_lm_weights": weights}
