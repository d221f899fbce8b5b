"""A prepared phase's files: their records in meta.json (bytes, SHA-256, rows), checked on
load, and the last step of every preparation, local or Beam: meta.json written beside the
shards, then the unfinished directory renamed into place."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np

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
