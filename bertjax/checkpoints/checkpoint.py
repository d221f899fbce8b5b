"""Checkpoints: the only module that uses Orbax.

A checkpoint step holds three items saved together and atomically: `state` (the sharded
TrainState), `data` (the data position: phase and next batch index) and `meta` (a small JSON
that a resume checks for compatibility: model config, tokenizer fingerprint, ...). Saves are
asynchronous; unfinished saves (a crash mid-write) are never restored and are cleaned up at
the next start (which must run under the workdir lock: `bertjax.runtime.locks`).

Integrity: once Orbax has committed a save, process 0 records every file's size and CRC32 in
`<step>/bertjax_checksums.json` (`seal`, bertjax.runtime.checksums); `verify` compares them before a
restore, so a truncated, deleted or bit-flipped file is found by name; `quarantine` moves a
damaged step out of the way (it is never deleted). A save also records in its `meta` an
exact digest of every array of the state, which a restore recomputes, and a restore checks
the model and tokenizer (both in bertjax.checkpoints.checkpoint_checks): a checkpoint that a kill
left unsealed, or that was damaged before its seal, is checked value by value too; a state
that any process fails to read fails the restore on every process alike. Pruning
(keep-latest-N) never removes the checkpoint a run resumed from until a newer one of that run
is sealed (`keep_until_newer_sealed`), nor a `pin`ned one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from bertjax.checkpoints.checkpoint_checks import (
    DIGEST,
    CheckpointMismatch,
    PyTree,
    StateUnreadable,
    check_compatible,
    check_digest,
    state_digest,
    unreadable_problem,
)
from bertjax.errors import UserError
from bertjax.runtime import agreement, console, failures, files as file_layer, stopping, storage
from bertjax.runtime.checksums import CHECKSUMS, seal, verify  # noqa: F401 (this module's API too)

storage.install_gcsfs()  # (before etils epath caches its gs:// file system)


def _absolute(directory: str) -> str:
    """Orbax needs absolute paths; remote ones (gs://...) already are. (Also sets the retries
    of the tensorstore contexts Orbax makes from now on.)"""
    storage.install_tensorstore()
    return file_layer.abspath(directory)


class CheckpointWriteError(UserError, RuntimeError):
    """Writing a checkpoint failed (possibly in the background writer of an earlier save)."""


class _Kept:
    """A preservation policy: keeps step `anchor` while no later step is in `sealed`, and
    step `pinned` always."""

    def __init__(self, sealed: set[int]) -> None:
        self.anchor: int | None = None
        self.pinned: int | None = None
        self.sealed = sealed

    def should_preserve(
        self,
        checkpoints: Sequence[policies.PolicyCheckpointInfo],
        *,
        context: policies.PreservationContext,
    ) -> list[bool]:
        del context
        anchor = self.anchor if not any(s > (self.anchor or 0) for s in self.sealed) else None
        return [c.step in (anchor, self.pinned) for c in checkpoints]


class Checkpointer:
    """Periodic async saves (plus preemption and forced saves), keep-latest-N + every-K."""

    def __init__(
        self,
        directory: str,
        save_every: int,
        keep_latest: int,
        keep_every: int = 0,
        async_save: bool = True,
        on_commit: Callable[[int], None] | None = None,
    ) -> None:
        """`on_commit(step)` is called once a save has finished and is sealed (announce it
        then: an async save can still fail until it has)."""
        self._on_commit = on_commit
        save_policies = [
            policies.FixedIntervalPolicy(save_every),
            policies.PreemptionCheckpointingPolicy(),
        ]
        self._sealed: set[int] = set()  # steps this run wrote and sealed
        self._kept = _Kept(self._sealed)
        keep_policies = [policies.LatestN(keep_latest), self._kept]
        if keep_every:
            keep_policies.append(policies.EveryNSteps(keep_every))
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=policies.AnySavePolicy(save_policies),
            preservation_policy=policies.AnyPreservationPolicy(keep_policies),
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.directory = _absolute(directory)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data", "meta")
        )
        # Orbax removes unfinished saves in a background thread (a private future in 0.12):
        # wait for it, so that it is over before anything reads the directory and an early
        # exit does not cut it off at interpreter shutdown.
        getattr(self._manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self._unsealed: list[int] = []  # finished or in-flight saves without checksums yet
        self._vanished: list[int] = []  # saves that ended without Orbax's commit
        self._failure: CheckpointWriteError | None = None  # the first failed save's error
        self._restores = 0  # (each restore's agreement between the processes is its own)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def keep_until_newer_sealed(self, step: int) -> None:
        """Keeps step `step` (the one this run resumed from, verified) until a later step
        that this run saves is sealed, whatever keep-latest-N says."""
        self._kept.anchor = step

    def pin(self, step: int | None) -> None:
        """Keeps step `step` (e.g. a fine-tuning run's best epoch) whatever keep-latest-N
        says, instead of the step pinned before (None: none)."""
        self._kept.pinned = step

    def delete(self, step: int) -> None:
        """Removes step `step` (after pending saves have finished)."""
        self.wait()
        self._manager.delete(step)

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def reached_preemption(self, step: int) -> bool:
        """Whether every process has reached JAX's preemption sync point at `step` (after a
        SIGTERM to any of them): save now, wait for the write and exit."""
        return self._manager.reached_preemption(step)

    def save(
        self, step: int, state: PyTree, data_position: dict, meta: dict, force: bool = False
    ) -> bool:
        """Starts an async save of step `step` if the policies (or `force`) say so; `meta`
        is saved with the state's digest added."""
        meta = {**meta, DIGEST: state_digest(state)}
        try:
            with stopping.doing("writing the previous checkpoint"):
                self._manager.wait_until_finished()  # (as Orbax would) so that the previous
            self.seal_finished()  # save is sealed before this one's pruning is decided
            started = self._manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave(data_position),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=force,
            )
        except Exception as e:  # an earlier async save's failure surfaces here too
            raise self._write_failure(e, self._vanished + self._unsealed or [step]) from e
        if started:
            self._unsealed.append(step)
        return started

    def seal_finished(self) -> None:
        """Records the checksums of saves that have finished (cheap when none has)."""
        if self._unsealed and not self._manager.is_saving_in_progress():
            while self._unsealed:  # (each step taken off first: a Ctrl-C in an announcement
                step = self._unsealed.pop(0)  # does not make the close announce it again)
                if not self._committed(step):  # failed (on GCS Orbax writes into the final
                    self._vanished.append(step)  # directory, so its commit marker decides):
                    continue  # Orbax raises its error at the next save or wait
                if jax.process_index() == 0:
                    seal(f"{self.directory}/{step}")
                self._sealed.add(step)
                if self._on_commit:
                    self._on_commit(step)

    def _committed(self, step: int) -> bool:
        """Whether Orbax finished step `step`: renamed from its temporary directory (local
        disks) or marked with `commit_success.txt` (GCS)."""
        return ocp.path.step.is_path_finalized(epath.Path(self.directory) / str(step))

    def _write_failure(self, error: Exception, steps: list[int]) -> CheckpointWriteError:
        """One line for a failed save of `steps`: the cause (a full disk: the file and "No
        space left on device", also when Orbax reports it as text) and what is kept. Later
        failures (Orbax's errors of the same save, met again at close) give the first one's."""
        if self._failure:
            return self._failure
        cause = error if isinstance(error, OSError) else failures.library_os_error(error)
        what = failures.os_error_line(cause) if cause else failures.first_line(error)
        failed = ", ".join(map(str, steps)) or "?"
        try:
            kept = sorted(
                int(p.name)
                for p in epath.Path(self.directory).iterdir()
                if p.name.isdigit() and self._committed(int(p.name))
            )
        except FileNotFoundError:
            kept = []
        except OSError:  # (the storage cannot say now)
            kept = None
        kept_line = (
            f"kept: the finished checkpoint(s) {', '.join(map(str, kept))}, a rerun "
            f"resumes from step {kept[-1]}"
            if kept
            else "no finished checkpoint is kept, a rerun starts from step 0"
            if kept == []
            else "a rerun resumes from the newest finished checkpoint "
            "there (the storage could not list them now)"
        )
        self._failure = CheckpointWriteError(
            f"saving checkpoint step {failed} in {self.directory} failed: {what}; {kept_line}"
        )
        return self._failure

    def verify(self, step: int) -> tuple[bool, str | None]:
        """`(sealed, problem)`: whether step `step` has recorded checksums, and what does not
        match them (None: intact or unsealed). Process 0 checks; every process gets its
        verdict."""
        sealed, problem = (
            verify(f"{self.directory}/{step}") if jax.process_index() == 0 else (True, None)
        )
        if jax.process_count() > 1:
            verdict = multihost_utils.broadcast_one_to_all(np.array([sealed, problem is None]))
            sealed = bool(verdict[0])
            problem = problem or (None if verdict[1] else "damaged (as found by process 0)")
        return sealed, problem

    def quarantine(self, step: int, destination: str) -> str:
        """Moves step `step` to `destination/<step>` (`.1`, `.2`, ... if taken); returns where."""
        target = epath.Path(destination) / str(step)
        suffix = 0
        while target.exists():
            suffix += 1
            target = epath.Path(destination) / f"{step}.{suffix}"
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            file_layer.rename(f"{self.directory}/{step}", str(target))
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"bertjax quarantine {step}")
        self._manager.reload()
        self._sealed.discard(step)  # (no longer a newer checkpoint that releases the anchor)
        return str(target)

    def metadata(self, step: int) -> tuple[dict, dict]:
        """The `(meta, data_position)` JSON items of step `step`, without the state."""
        items = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), data=ocp.args.JsonRestore())
        )
        return items["meta"], items["data"]

    def restore(
        self, step: int, abstract_state: PyTree, expected_meta: dict
    ) -> tuple[PyTree, dict, dict]:
        """Restores `(state, data_position, meta)` onto the shardings in `abstract_state`,
        after checking that the checkpoint's metadata matches this run; DamagedCheckpoint if
        the state differs from its recorded digest, StateUnreadable (on every process alike)
        if any process cannot read its part."""
        meta, position = self.metadata(step)
        check_compatible(meta, expected_meta, f"{self.directory}/{step}")
        state = self._restore_state(step, abstract_state)
        check_digest(state, meta, f"{self.directory}/{step}")
        return state, position, meta

    def _restore_state(self, step: int, abstract_state: PyTree) -> PyTree:
        """The `state` item of step `step`, read by its handler (no barrier: a process that
        fails to read its part does not leave the others waiting in Orbax's), then agreed:
        if any process failed, every process raises StateUnreadable alike (or
        StorageUnavailable, if the storage failed, which proves nothing)."""
        handler = ocp.StandardCheckpointHandler()
        state, failure = None, None
        try:
            state = handler.restore(
                epath.Path(self.directory) / str(step) / "state",
                args=ocp.args.StandardRestore(abstract_state),
            )
        except Exception as e:  # noqa: BLE001 (agreed on below)
            failure = {"storage": storage.unavailable(e), "problem": unreadable_problem(e)}
            console.log_only(f"restoring checkpoint step {step} failed: {e}")
        finally:
            handler.close()
        self._restores += 1
        agreed = agreement.first_failure(f"restore {step}.{self._restores}", failure)
        if agreed is not None:
            where, problem = f"{self.directory}/{step}", agreed["problem"]
            if jax.process_count() > 1:
                problem = f"process {agreed['process']} of {jax.process_count()}: {problem}"
            if agreed["storage"]:
                raise storage.StorageUnavailable(f"reading checkpoint {where}", problem, 0)
            raise StateUnreadable(where, problem)
        return state

    def wait(self) -> None:
        """Blocks until pending saves are written (and sealed); raises if the async writer
        failed."""
        try:
            with stopping.doing("writing checkpoint " + ", ".join(map(str, self._unsealed))):
                self._manager.wait_until_finished()
        except Exception as e:
            raise self._write_failure(e, self._vanished + self._unsealed) from e
        self.seal_finished()

    def close(self) -> None:
        """Waits for pending saves (raising a failed one's error), then closes Orbax's
        manager; a failure there is a failed save too (its first error is the one raised)."""
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            except Exception as e:
                raise self._write_failure(e, self._vanished + self._unsealed) from e


def restore_params(directory: str, abstract_params: PyTree) -> PyTree:
    """Loads only the parameters of the latest checkpoint in `directory` (for
    `train.init_checkpoint`), placed on the shardings of `abstract_params`."""
    with ocp.CheckpointManager(
        _absolute(directory), item_names=("state", "data", "meta")
    ) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in init_checkpoint={directory!r}")
        logging.info("Initialising parameters from %s step %d", directory, step)
        where = f"{manager.directory}/{step}"
        sealed, problem = verify(where)
        if problem:
            raise CheckpointMismatch(f"checkpoint {where} is damaged: {problem}")
        try:
            _check_param_shapes(f"{where}/state", abstract_params)
            item = ocp.PyTreeCheckpointer().restore(
                f"{where}/state",
                args=ocp.args.PyTreeRestore(
                    item={"params": abstract_params},
                    restore_args=jax.tree.map(
                        lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding),
                        {"params": abstract_params},
                    ),
                    partial_restore=True,
                ),
            )
        except CheckpointMismatch:
            raise
        except Exception as e:  # (half written, or unreadable)
            if storage.unavailable(e):
                raise
            raise CheckpointMismatch(
                f"init_checkpoint {directory}: its latest checkpoint {where} cannot be read ("
                f"{failures.first_line(e, 160)})"
                + (
                    ""
                    if sealed
                    else "; it has no checksums, so its save may never have finished: move it out of "
                    "the way to start from the step before it, or finish that run"
                )
            ) from e
        return item["params"]


def stored_params(directory: str) -> Any:
    """ShapeDtypeStructs (on the first device) of every parameter that the latest finished
    checkpoint in `directory` holds, whatever model wrote it: a `restore_params` target."""
    with ocp.CheckpointManager(
        _absolute(directory), item_names=("state", "data", "meta")
    ) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {directory!r}")
        stored = _stored_tree(f"{manager.directory}/{step}/state")["params"]
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype, sharding=one_device),
        stored,
    )


def read_meta(directory: str) -> dict:
    """The `meta` item of the latest finished checkpoint in `directory` (what a run recorded
    about its model, tokenizer and config)."""
    items = ("state", "data", "meta")
    with ocp.CheckpointManager(_absolute(directory), item_names=items) as manager:
        step = manager.latest_step()
        if step is None:
            raise FileNotFoundError(f"no finished checkpoint in {directory!r}")
        return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


def save_params(directory: str, params: PyTree, meta: dict) -> None:
    """Writes a parameters-only checkpoint (step 0) that `restore_params` reads, e.g. a
    converted pretrained model for `train.init_checkpoint`."""
    checkpointer = Checkpointer(directory, save_every=1, keep_latest=1, async_save=False)
    try:
        checkpointer.save(0, {"params": params}, {}, meta, force=True)
    finally:
        checkpointer.close()


def _stored_tree(state_path: str) -> Any:
    """The array metadata (shapes, dtypes) of a checkpoint's `state` item, read by the item's
    handler (the checkpointer would first look for a step metadata file that an item folder
    never has, and log a warning that it does not exist)."""
    return ocp.PyTreeCheckpointHandler().metadata(epath.Path(state_path)).tree


def _check_param_shapes(state_path: str, abstract_params: PyTree) -> None:
    """Raises CheckpointMismatch naming every wanted parameter that the checkpoint lacks or
    stores with another shape."""
    stored = _stored_tree(state_path)["params"]
    stored_shapes = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(stored)
    }
    problems = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params):
        name = jax.tree_util.keystr(path)
        if name not in stored_shapes:
            problems.append(f"{name}: missing")
        elif stored_shapes[name] != tuple(leaf.shape):
            problems.append(f"{name}: checkpoint {stored_shapes[name]}, model {tuple(leaf.shape)}")
    if problems:
        raise CheckpointMismatch(
            f"checkpoint {state_path} does not fit the model ({len(problems)} parameters): "
            + "; ".join(problems[:10])
            + ("; ..." if len(problems) > 10 else "")
            + ". Use the architecture and vocabulary of the run that wrote it."
        )
