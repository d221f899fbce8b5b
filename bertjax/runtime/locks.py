"""Exclusive file locks: one run per workdir, one preparation per prepared-data cache entry.

A lock is an `fcntl.flock` on a small file that names its holder (host, pid, start time).
The kernel drops the lock when its process dies, even by kill -9, so a lock file left by a
dead process is simply taken over (and its old holder reported). Lock files are never
deleted (a process waiting on a deleted file would lock a file nobody else sees), except by a
run that fails in a workdir it made, under its workdir lock (`held_workdir`). Where the
file system has no `flock` (some network and FUSE mounts), the holder's pid is checked
instead (on the same host). A workdir on an object store (gs://) is not locked: object
stores have no lock that a killed process (a preempted spot VM) releases, so the run says
so in one line and one job at a time must use it (the TPU launcher deletes a slice before
it recreates one).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable, Iterator

from absl import logging

from bertjax.errors import UserError
from bertjax.runtime import files

NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class LockHeld(UserError, RuntimeError):
    """Another live process holds the lock."""


def pid_alive(pid: int | str) -> bool:
    """Whether process `pid` exists on this host (False for a `pid` that is not a number)."""
    if not str(pid).isdigit() or int(pid) <= 0:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def describe(holder: dict | None) -> str:
    """`pid 123 on host h (started 2024-05-01 10:00:00)`, or `an unknown process`."""
    if not holder:
        return "an unknown process"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"pid {holder.get('pid')} on host {holder.get('host')} (started {started})"


def _read_holder(fd: int) -> dict | None:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def _write_holder(fd: int) -> None:
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)


def _holder_alive(holder: dict | None) -> bool:
    """Without flock: a recorded holder counts as alive unless it ran on this host and its
    pid is gone (another host's process cannot be checked)."""
    if not holder or holder.get("pid") == os.getpid():
        return False
    return holder.get("host") != socket.gethostname() or pid_alive(int(holder["pid"]))


def _acquire(fd: int, path: str, what: str, wait: bool) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        holder = _read_holder(fd)
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise
        holder = _read_holder(fd)
        if not _holder_alive(holder):
            return
        if not wait:
            raise LockHeld(
                f"{what} is in use by {describe(holder)} (lock file {path}, no flock "
                "on this file system: delete it if that process is gone)"
            ) from None
        logging.warning("%s is in use by %s; waiting (lock file %s)", what, describe(holder), path)
        while _holder_alive(_read_holder(fd)):
            time.sleep(1.0)
        return
    if not wait:
        raise LockHeld(
            f"{what} is in use by {describe(holder)} (lock file {path}); wait for "
            "that run to end or stop it, or use another directory"
        )
    logging.warning(
        "%s is in use by %s; waiting for it (lock file %s)", what, describe(holder), path
    )
    fcntl.flock(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def exclusive(path: str, what: str, wait: bool = False) -> Iterator[dict | None]:
    """Holds an exclusive lock on `path` (created if needed) for the block; yields the
    previous holder's record if it died holding it (else None). Another live holder raises
    LockHeld naming it, or, with `wait`, is waited for. `what` names the locked thing in
    messages."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, path, what, wait)
        stale = _read_holder(fd)
        if stale:
            logging.warning(
                "Taking over the lock of %s on %s: %s is no longer running",
                what,
                path,
                describe(stale),
            )
        _write_holder(fd)
        try:
            yield stale
        finally:
            os.ftruncate(fd, 0)  # released cleanly: no holder to report as stale
    finally:
        os.close(fd)


def workdir_lock(workdir: str, process_index: int = 0) -> contextlib.AbstractContextManager:
    """The lock of a run's workdir (one per process of a job, so that the processes of one
    multi-process job on one host do not exclude each other)."""
    if files.is_remote(workdir):
        if process_index == 0:
            logging.warning(
                "workdir %s is on an object store: not locked; run one job at a time into it",
                workdir,
            )
        return contextlib.nullcontext()
    name = "run.lock" if process_index == 0 else f"run.lock.{process_index}"
    return exclusive(os.path.join(workdir, name), f"workdir {workdir}")


@contextlib.contextmanager
def held_workdir(workdir: str, process_index: int = 0) -> Iterator[None]:
    """Makes `workdir` (if missing) and holds its `workdir_lock` for the block; a block that
    fails in a directory it made (a refused run) leaves no lock file there, and no directory
    that only locks were in (`remove_own_locks`)."""
    created = not files.exists(workdir)
    files.makedirs(workdir)
    with workdir_lock(workdir, process_index):
        try:
            yield
        except BaseException:
            if created and not files.is_remote(workdir):
                remove_own_locks(workdir, process_index)  # (still holding the lock)
            raise


def remove_own_locks(workdir: str, process_index: int = 0) -> None:
    """In a `workdir` its failed run made: removes this process's `workdir_lock` file and the
    cache locks (`build_once`'s `.NAME.lock`) under it, then every directory left empty, the
    workdir included. Anything else (a trained tokenizer, prepared data, another process's
    lock) stays, and so does its directory."""
    own = "run.lock" if process_index == 0 else f"run.lock.{process_index}"
    for root, _, names in os.walk(workdir, topdown=False):
        for name in names:
            if (root == workdir and name == own) or (
                root != workdir and name.startswith(".") and name.endswith(".lock")
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(root, name))
        with contextlib.suppress(OSError):  # (not empty: something else is in it)
            os.rmdir(root)


def build_once(target: str, done_path: str, build: Callable[[], object]) -> bool:
    """Runs `build` (which makes `target`) unless `done_path` exists, holding the lock
    `.NAME.lock` beside `target`: a second process waits for the first's build, then finds
    `done_path` and reuses it. True where this call ran `build`."""
    if os.path.exists(done_path):
        return False
    parent, name = os.path.split(target)
    os.makedirs(parent or ".", exist_ok=True)
    with exclusive(os.path.join(parent, f".{name}.lock"), target, wait=True):
        if not os.path.exists(done_path):
            build()
            return True
    return False
