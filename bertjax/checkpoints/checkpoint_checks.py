"""Whether a checkpoint fits the run that restores it: written by the same model and
tokenizer (`check_compatible`, else CheckpointMismatch, the base of every refusal to resume),
and holding the values it was saved with (`state_digest`, recorded in its `meta` at the save
and recomputed at the restore by `check_digest`, else DamagedCheckpoint); a state that cannot
be read is StateUnreadable, said in one line (`unreadable_problem`). No Orbax here: the
Checkpointer (bertjax.checkpoints.checkpoint) calls these around its saves and restores.
"""

from __future__ import annotations

import re
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from bertjax.errors import UserError

# A tree of arrays (a training state, or a dict of parameters), as a checkpoint holds it.
PyTree: TypeAlias = Any

META_KEYS_MUST_MATCH = ("model", "tokenizer")
DIGEST = "state_digest"  # the meta field with state_digest(state)


class CheckpointMismatch(UserError, ValueError):
    """A checkpoint in the workdir was written by an incompatible configuration."""


class DamagedCheckpoint(UserError, RuntimeError):
    """A restored state differs from the digest its checkpoint recorded when it was saved;
    `problem` says which arrays."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"checkpoint {where} is damaged: {problem}")
        self.problem = problem


class StateUnreadable(UserError, RuntimeError):
    """A checkpoint's state failed to restore (on every process alike: `problem` names the
    process that failed first when there are several)."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"checkpoint {where} cannot be restored: {problem}")
        self.problem = problem


# TensorStore's errors end with the repr of the array's TensorStore (its spec, on many lines),
# whose last `path` is the array's name in the checkpoint.
_TENSORSTORE_DETAILS = re.compile(r"\s*See full TensorStore details:.*", re.DOTALL)
_SPEC_PATH = re.compile(r"'path': '([^']+)'")


def unreadable_problem(error: BaseException) -> str:
    """What a failed read of a checkpoint's state says, in one line: the array that cannot
    be read, if TensorStore names it, and its error without TensorStore's repr."""
    text = str(error)
    details = _TENSORSTORE_DETAILS.search(text)
    line = _TENSORSTORE_DETAILS.sub("", text).strip().split("\n", 1)[0] or type(error).__name__
    line = line if len(line) <= 200 else line[:200] + "..."
    arrays = _SPEC_PATH.findall(details.group(0)) if details else []
    return f"its array {arrays[-1].rstrip('/')}: {line}" if arrays else line


def check_compatible(found: dict, expected: dict, where: str) -> None:
    """Refuses to resume from a checkpoint of another model or tokenizer."""
    for key in META_KEYS_MUST_MATCH:
        if key not in expected:
            continue
        wanted = expected[key]
        if isinstance(wanted, dict) and isinstance(found.get(key), dict):
            # Older checkpoints record fewer model fields; compare the ones they record.
            wanted = {name: value for name, value in wanted.items() if name in found[key]}
        if found.get(key) != wanted:
            raise CheckpointMismatch(
                f"checkpoint {where} was written with a different {key}:\n  checkpoint: "
                f"{found.get(key)}\n  this run:   {expected[key]}\nUse a new --workdir, or the "
                "settings of the run that wrote it."
            )


def _leaf_digest(x: jax.Array) -> jax.Array:
    """The uint32 sum (mod 2**32) of the bits of every element: exact, and independent of
    the order of the summation (so of the sharding); any single changed bit changes it."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    elif x.dtype.itemsize == 8:
        bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
    return jnp.sum(bits.astype(jnp.uint32), dtype=jnp.uint32)


_digests = jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))


def state_digest(state: PyTree) -> dict[str, int]:
    """`{leaf path: digest}` of every array in `state` (see `_leaf_digest`), as JSON ints."""
    digests = jax.device_get(_digests(state))
    return {
        jax.tree_util.keystr(path): int(value)
        for path, value in jax.tree_util.tree_leaves_with_path(digests)
    }


def check_digest(state: PyTree, meta: dict, where: str) -> None:
    """Raises DamagedCheckpoint naming the arrays of the restored `state` whose digest
    differs from the one `meta` recorded (no-op for checkpoints that recorded none)."""
    recorded = meta.get(DIGEST)
    if not recorded:
        return
    found = state_digest(state)
    differ = sorted(name for name, value in found.items() if recorded.get(name) != value)
    if differ:
        raise DamagedCheckpoint(
            where,
            (
                f"{len(differ)} restored array(s) differ from the digest recorded at the save: "
                f"{', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''}"
            ),
        )
