"""A prepared phase's files: their records in meta.json (bytes, SHA-256, rows), checked on
load, and the last step of every preparation, local or Beam: meta.json written beside the
shards, then the unfinished directory renamed into place. On object storage (`gs://...`), a
phase is uploaded with its meta.json last and read from a local copy (memory-mapped)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

from bertjax import files, locks
from bertjax.data import shard_format


def file_record(path: str) -> dict[str, Any]:
    """Size and SHA-256 of a prepared file, as recorded in meta.json and checked on load."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return {"bytes": os.path.getsize(path), "sha256": digest.hexdigest()}


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


def upload(local: str, remote: str) -> None:
    """Uploads the prepared phase `local` to the URL `remote`: every shard file, then meta.json,
    so that a reader (which starts from meta.json) never sees a phase half uploaded."""
    with open(os.path.join(local, "meta.json")) as f:
        relatives = list(json.load(f)["files"])
    for relative in [*relatives, "meta.json"]:
        files.copy(os.path.join(local, relative), f"{remote}/{relative}")


def local_copy(remote: str, records: dict[str, dict[str, Any]], cache_dir: str) -> str:
    """A local copy of the prepared phase at the URL `remote` whose meta.json lists `records`,
    downloaded once into `cache_dir` under a name from the records (every file's SHA-256, so
    prepared data replaced at the same URL is downloaded again); returns its directory."""
    key = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16]
    directory = os.path.join(cache_dir, f"prepared_{remote.rstrip('/').rsplit('/', 1)[-1]}_{key}")

    def download() -> None:
        tmp = f"{directory}.tmp{os.getpid()}"
        try:
            for relative in [*records, "meta.json"]:
                files.copy(f"{remote}/{relative}", os.path.join(tmp, relative))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    locks.build_once(directory, os.path.join(directory, "meta.json"), download)
    return directory
