"""Hosts agree or stop: the processes of a multi-process run (every host of a TPU pod slice
running the same command) compare what must be the same everywhere, and any difference stops
every process with one line naming the field or file and the processes that differ.

They compare, through the key-value store of JAX's coordination service (no device, no
collective): at the start, the config (less `PER_HOST_FIELDS`) and `--workdir`; before any
data work, the corpus (its files and their sampled content: `guards.data_identity`); once the
tokenizer is loaded or trained, its fingerprint; and they meet once more when the data is
prepared. A process that stops with an error announces its line
(`peers.announce_failure`), and the others, waiting at a comparison or anywhere else, stop
with it (`peers.watch`) instead of waiting for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

import jax

from bertjax.errors import UserError
from bertjax.runtime import peers

# Fields that may differ between hosts: where a host keeps its copy of the prepared data
# (its local disk); the data itself is compared as the corpus and the tokenizer.
PER_HOST_FIELDS = ("data.cache_dir",)
RERUN = "run the same command on every host"
SAME_FILES = "give every host the same files (the same corpus, vocab_file and config)"
_PREFIX = "bertjax/agree"
_SHOWN = 80  # a longer value is shown by a hash of it
_POLL_S = 0.2


class HostsDisagree(UserError, ValueError):
    """The processes of a run differ in a setting, a file or the tokenizer."""


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_fields(settings: dict[str, Any], workdir: str) -> dict[str, str]:
    """The run's settings as compared between hosts: every config field (`settings`: the
    config as a dict) but `PER_HOST_FIELDS`, and `--workdir`."""
    fields = {
        name: repr(value) for name, value in _flat(settings).items() if name not in PER_HOST_FIELDS
    }
    return {**fields, "--workdir": repr(workdir)}


def data_fields(identity: Mapping[str, Any]) -> dict[str, str]:
    """The corpus as compared between hosts (`identity`: guards.data_identity): how many
    files it names and each file's size and sampled content, by its name (not its directory,
    which may differ with the working directory, nor its time, which copies may change)."""
    source = dict(identity["source"])
    paths = [path for path, _ in source.pop("files", [])]
    fields = {"data source": json.dumps(source, sort_keys=True)}
    if paths:
        fields["the number of corpus files"] = str(len(paths))
    names = [os.path.basename(p) for p in paths]
    for index, (name, sample) in enumerate(zip(names, identity.get("corpus") or [])):
        shown = name if names.count(name) == 1 else f"#{index + 1} ({name})"
        fields[f"the corpus file {shown}"] = (
            f"{sample['bytes']} bytes, sampled sha256 {sample['sampled_sha256'][:12]}"
        )
    return fields


def _shown(value: str) -> str:
    if len(value) <= _SHOWN:
        return value
    return f"{value[: _SHOWN - 25]}... (sha256 {hashlib.sha256(value.encode()).hexdigest()[:12]})"


# Named first when they differ: the family, then the other model fields (another family
# changes many fields' defaults, the data's among them).
_FIRST = ("model.family", "model.")


def _first_named(name: str) -> int:
    return next((i for i, prefix in enumerate(_FIRST) if name.startswith(prefix)), len(_FIRST))


def disagreement(per_process: list[dict[str, str]], hint: str = RERUN) -> str | None:
    """The line naming the first field in which a process differs from process 0 and which
    processes have which value; None if all agree."""
    names = list(per_process[0]) + sorted(
        {n for p in per_process[1:] for n in p} - set(per_process[0])
    )
    absent = "(nothing)"
    differing = sorted(
        (n for n in names if len({p.get(n, absent) for p in per_process}) > 1), key=_first_named
    )
    if not differing:
        return None
    name = differing[0]
    groups: dict[str, list[int]] = {}
    for index, fields in enumerate(per_process[1:], start=1):
        value = fields.get(name, absent)
        if value != per_process[0].get(name, absent):
            groups.setdefault(value, []).append(index)
    others = "; ".join(
        f"process{'es' if len(ids) > 1 else ''} "
        f"{', '.join(map(str, ids))} {'have' if len(ids) > 1 else 'has'} "
        f"{_shown(value)}"
        for value, ids in groups.items()
    )
    more = f" (and {len(differing) - 1} more)" if len(differing) > 1 else ""
    return (
        f"the hosts disagree on {name}{more}: {others}, process 0 "
        f"{_shown(per_process[0].get(name, absent))}; {hint}"
    )


def _gather(stage: str, payload: str) -> list[str]:
    """Every process's `payload` for `stage`, in process order. (Another process's error,
    or its loss, ends this one meanwhile: `peers.watch`.)"""
    client, count = peers.client(), jax.process_count()
    directory = f"{_PREFIX}/{stage}/"
    client.key_value_set(f"{directory}{jax.process_index()}", payload)
    while True:
        found = {
            key.rsplit("/", 1)[-1]: value for key, value in client.key_value_dir_get(directory)
        }
        if len(found) == count:
            return [found[str(i)] for i in range(count)]
        time.sleep(_POLL_S)


def check(stage: str, fields: dict[str, str], hint: str = RERUN) -> None:
    """Compares `fields` between all processes (a no-op in a one-process run); HostsDisagree
    with one line if any differ. Every process calls it at the same point of the run."""
    if jax.process_count() == 1:
        return
    per_process = [json.loads(p) for p in _gather(stage, json.dumps(fields))]
    line = disagreement(per_process, hint)
    if line:
        raise HostsDisagree(line)


class Fingerprinted(Protocol):
    """What hosts compare of a tokenizer (`bertjax.data.tokenization.Tokenizer`)."""

    vocab_size: int

    def fingerprint(self) -> str: ...


def tokenizer_fields(tokenizer: Fingerprinted) -> dict[str, str]:
    """The tokenizer as compared between hosts: its size and fingerprint."""
    return {
        "the tokenizer": f"{tokenizer.vocab_size} tokens, fingerprint "
        f"{tokenizer.fingerprint()[:12]}"
    }


def first_failure(stage: str, failure: dict[str, Any] | None) -> dict[str, Any] | None:
    """Every process's `failure` at `stage` (None: it succeeded; JSON values), agreed: the
    failure of the first process that failed, with its `process` index added, the same on
    every process; None if none failed. Every process calls it at the same point, with a
    `stage` of its own."""
    if jax.process_count() == 1:
        return failure and {**failure, "process": 0}
    for index, report in enumerate(_gather(stage, json.dumps(failure))):
        found = json.loads(report)
        if found is not None:
            return {**found, "process": index}
    return None
