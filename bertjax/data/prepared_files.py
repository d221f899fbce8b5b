"""A prepared phase's files: their records in meta.json (bytes, SHA-256, rows), checked on
load (`read_meta`), and the last step of every preparation, local or Beam: meta.json written
beside the shards, then the unfinished directory renamed into place (`cache_key` names a cached
one). On object storage (`gs://...`), a phase is prepared in a local scratch directory under a
claim (one preparation per phase at a time), uploaded with its meta.json last, and read from a
local copy checked as downloaded."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from bertjax.data import shard_format
from bertjax.data.errors import DataError
from bertjax.runtime import files, locks

CLAIMS = "_claims"  # under a remote phase: one object per preparation writing it


def file_record(path: str) -> dict[str, Any]:
    """Size and SHA-256 of a prepared file, as recorded in meta.json and checked on load."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


def cache_key(obj: object) -> str:
    """The 16 hex digits that name a cache entry made from `obj` (JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_meta(directory: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A prepared phase's meta.json: (its fields, its files' records)."""
    try:
        with files.open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        return meta, meta.pop("files")
    except FileNotFoundError as e:
        raise DataError(
            f"no prepared data at {directory} (no meta.json); run python -m "
            "bertjax.prepare with this config and --output"
        ) from e
    except (ValueError, KeyError, AttributeError) as e:
        raise DataError(
            f"prepared data file {directory}/meta.json is damaged ({e!r}); delete "
            f"{directory} to prepare the data again"
        ) from e


def shard_records(directory: str) -> dict[str, dict[str, Any]]:
    """{"train/shard_00000/input_ids.npy": {rows, bytes, sha256}, ...} for every prepared file."""
    records = {}
    for split in ("train", "eval"):
        for shard in sorted(os.listdir(os.path.join(directory, split))):
            for name in shard_format.STORED:
                relative = f"{split}/{shard}/{name}.npy"
                path = os.path.join(directory, relative)
                rows = len(np.load(path, mmap_mode="r"))
                records[relative] = {"rows": rows, **file_record(path)}
    return records


def commit(tmp: str, directory: str, meta: dict[str, Any]) -> None:
    """Writes tmp/meta.json (`meta` and every shard file's record), then replaces `directory`
    with `tmp`."""
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({**meta, "files": shard_records(tmp)}, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)


def upload(local: str, remote: str, still_claimed: Callable[[str], None]) -> None:
    """Uploads the prepared phase `local` to the URL `remote`: every shard file, then meta.json
    (created only if absent: on GCS, `ifGenerationMatch=0`), so that a reader (which starts
    from meta.json) never sees a phase half uploaded; `still_claimed` (`claimed`'s check)
    runs before the upload and again before meta.json."""
    with open(os.path.join(local, "meta.json")) as f:
        relatives = list(json.load(f)["files"])
    still_claimed("before its upload")
    for relative in relatives:
        files.copy(os.path.join(local, relative), f"{remote}/{relative}")
    still_claimed("at the end of its upload")
    with (
        open(os.path.join(local, "meta.json"), "rb") as reader,
        files.open(f"{remote}/meta.json", "xb") as writer,
    ):
        shutil.copyfileobj(reader, writer)


@contextlib.contextmanager
def claimed(remote: str) -> Iterator[Callable[[str], None]]:
    """Claims the phase at the URL `remote` for this preparation for the block: a claim object
    under `remote`/_claims, deleted at the end. Yields a check (raising DataError) that this
    claim is still the oldest there and no meta.json has appeared, run now and by `upload`.
    Claims are ordered by their generation (the order GCS committed them), so of several
    preparations started at once exactly one goes on; a claim of a preparation no longer
    running on this host (killed) is removed, another host's named with what to do."""
    name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mine = f"{remote}/{CLAIMS}/{name}"
    files.write_text(mine, "")

    def check(when: str) -> None:
        claims = files.generations(f"{remote}/{CLAIMS}")
        if name not in claims:
            raise DataError(
                f"the claim {mine} of this preparation of {remote} was deleted "
                f"{when}: another preparation may be writing there; rerun it"
            )
        for other in sorted(n for n in claims if (claims[n], n) < (claims[name], name)):
            host, pid, _ = other.rsplit("-", 2)
            if host == socket.gethostname() and not locks.pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    files.remove(f"{remote}/{CLAIMS}/{other}")
                continue
            raise DataError(
                f"{remote} is being prepared by another preparation (pid {pid} on host {host}, "
                f"claim {remote}/{CLAIMS}/{other}): wait for it to finish and rerun (a phase "
                "prepared with this config is kept), or use another --output; if that "
                f"preparation is gone (killed), delete {remote}/{CLAIMS}/{other} and rerun"
            )
        if "meta.json" in files.generations(remote):
            raise DataError(
                f"{remote}/meta.json was written by another preparation {when}; "
                "rerun to keep it if its settings are this config's"
            )

    try:
        check("before this one started")
        yield check
    finally:
        with contextlib.suppress(FileNotFoundError):
            files.remove(mine)


def scratch() -> str:
    """A new local directory in which to prepare phases bound for object storage
    (TMP/bertjax_prepare/PID); those left by preparations no longer running (killed) go."""
    root = os.path.join(tempfile.gettempdir(), "bertjax_prepare")
    os.makedirs(root, exist_ok=True)
    for name in os.listdir(root):
        if name == str(os.getpid()) or not locks.pid_alive(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    path = os.path.join(root, str(os.getpid()))
    os.makedirs(path)
    return path


def local_copy(remote: str, records: dict[str, dict[str, Any]], cache_dir: str) -> str:
    """A local copy of the prepared phase at the URL `remote` whose meta.json lists `records`,
    downloaded once into `cache_dir` under a name from the records (every file's SHA-256, so
    prepared data replaced at the same URL is downloaded again), each file checked against its
    record as downloaded (DataError naming the object); returns its directory."""
    key = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]
    directory = os.path.join(cache_dir, f"prepared_{remote.rstrip('/').rsplit('/', 1)[-1]}_{key}")

    def download() -> None:
        tmp = f"{directory}.tmp{os.getpid()}"
        try:
            for relative in [*records, "meta.json"]:
                files.copy(f"{remote}/{relative}", os.path.join(tmp, relative))
                if relative in records and file_record(os.path.join(tmp, relative)) != {
                    k: records[relative][k] for k in ("bytes", "sha256")
                }:
                    raise DataError(
                        f"{remote}/{relative} does not match its record in {remote}/meta.json: "
                        "the prepared data there was changed or mixed (two preparations into "
                        "one --output?); prepare it again (python -m bertjax.prepare) into a new "
                        "--output, or delete it first"
                    )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)

    locks.build_once(directory, os.path.join(directory, "meta.json"), download)
    return directory
