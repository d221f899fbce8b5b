"""Whether a pretraining run may resume with its data: `data_identity` is what a checkpoint
records about its data, and `check_resume` refuses a resume in the middle of a phase that
changes any setting that changes its batches or masks, or the corpus content (a cheap
fingerprint). Moving on to the next phase of the schedule (an intended phase switch) may
change them, and `train.allow_changed_data` accepts a change explicitly. Checked before any
data is prepared (by bertjax.training.resume). (Finiteness: bertjax.training.nonfinite.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging

from bertjax.checkpoints import checkpoint_checks
from bertjax.checkpoints.run_record import RunRecord
from bertjax.data import corpus, corpus_source
from bertjax.data.settings import DataSettings
from bertjax.training.phase_schedule import Phase

# Per-phase settings that a resume within the same phase must keep.
PHASE_FIELDS = ("max_seq_length", "max_predictions_per_seq", "global_batch_size")
# config.data fields that do not change the data (input_files: compared as the corpus;
# vocab_file: as the tokenizer's fingerprint; the per-phase fields: as PHASE_FIELDS).
DATA_FIELDS_NOT_COMPARED = (
    "cache_dir",
    "num_workers",
    "prepared_dir",
    "input_files",
    "vocab_file",
    "max_seq_length",
    "max_predictions_per_seq",
)

# Bytes of the corpus read for its fingerprint (at least 64 KiB per file); files no larger
# than their share are hashed whole.
CORPUS_SAMPLE_BYTES = 256 << 20


class IncompatibleResume(checkpoint_checks.CheckpointMismatch):
    """The workdir's checkpoint was written with data settings this run changes."""


def data_identity(data_cfg: DataSettings, phases: Sequence[Phase]) -> dict[str, Any]:
    """What a checkpoint records about its data: the corpus (with a content fingerprint of
    each text file) and each phase's shape, as it reads back from JSON (so that it compares
    equal after a restore)."""
    source = corpus_source.source_identity(data_cfg)
    files = [path for path, _ in source.get("files", [])]
    sample_bytes = max(1 << 16, CORPUS_SAMPLE_BYTES // max(len(files), 1))
    return json.loads(
        json.dumps(
            {
                "source": source,
                "corpus": [corpus.content_fingerprint(path, sample_bytes) for path in files],
                "phases": {p.name: {f: getattr(p, f) for f in PHASE_FIELDS} for p in phases},
            }
        )
    )


def _corpus_changes(found: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """What differs between two corpora: files, sizes, content samples. A file with another
    mtime but the same size and samples (e.g. copied to a new machine) only gets a warning."""
    if (
        found["source"].get("files") is None
        or expected["source"].get("files") is None
        or [f for f, _ in found["source"]["files"]] != [f for f, _ in expected["source"]["files"]]
    ):
        return (
            []
            if found["source"] == expected["source"]
            else [f"data source: {found['source']} -> {expected['source']}"]
        )
    changes = []
    files = [f for f, _ in expected["source"]["files"]]
    for path, old, new in zip(files, found.get("corpus") or [], expected["corpus"]):
        if old["bytes"] != new["bytes"]:
            changes.append(f"corpus file {path}: {old['bytes']} -> {new['bytes']} bytes")
        elif old["sampled_sha256"] != new["sampled_sha256"]:
            changes.append(f"corpus file {path}: content changed (same size)")
        elif old["mtime"] != new["mtime"]:
            logging.warning(
                "corpus file %s has a new modification time but the same size and "
                "sampled content; resuming with it",
                path,
            )
    if not found.get("corpus") and found["source"] != expected["source"]:  # older checkpoints
        changes.append(f"data source: {found['source']} -> {expected['source']}")
    return changes


def _json(value: object) -> Any:
    return json.loads(json.dumps(value))


def resume_changes(
    found_record: RunRecord, expected: Mapping[str, Any], data_cfg: DataSettings, phase: str
) -> list[str]:
    """Every difference between the checkpoint's data (its record) and this run's
    (`expected`: data_identity, `data_cfg`: config.data) that changes phase `phase`'s
    batches: `field: old -> new` lines. Fields the checkpoint did not record are skipped."""
    found = found_record.data or {}
    old_phase, new_phase = found.get("phases", {}).get(phase, {}), expected["phases"][phase]
    changes = [
        f"{field}: {old_phase[field]} -> {new_phase[field]}"
        for field in PHASE_FIELDS
        if field in old_phase and old_phase[field] != new_phase[field]
    ]
    old_data = found_record.config_values.get("data", {})
    changes += [
        f"data.{field}: {old_data[field]!r} -> {_json(value)!r}"
        for field, value in data_cfg.items()
        if field not in DATA_FIELDS_NOT_COMPARED
        and field in old_data
        and old_data[field] != _json(value)
    ]
    return changes + (_corpus_changes(found, expected) if found.get("source") else [])


def check_resume(
    found_record: RunRecord,
    expected: Mapping[str, Any],
    data_cfg: DataSettings,
    position: Mapping[str, Any],
    run_phase: str,
    where: str,
    allow_changes: bool,
) -> None:
    """Raises IncompatibleResume if this run continues a phase the checkpoint is in the
    middle of (its data `position` is past the first batch of `run_phase`, this run's phase
    at that step) with other data (see resume_changes); with `allow_changes`, warns instead.
    A checkpoint at the start of a phase, or followed by another phase in this run's
    schedule, passes."""
    resume_phase = position["phase"]
    if resume_phase != run_phase or position["batch_index"] == 0:
        return
    changes = resume_changes(found_record, expected, data_cfg, resume_phase)
    if not changes:
        return
    if allow_changes:
        logging.warning(
            "continuing phase %r of checkpoint %s with changed data (train.allow_changed_data): %s",
            resume_phase,
            where,
            "; ".join(changes),
        )
        return
    raise IncompatibleResume(
        f"checkpoint {where} is in the middle of phase {resume_phase!r}, which this run "
        f"continues with other data: {'; '.join(changes)}. Use the settings and corpus of the "
        "run that wrote it; or start a new run with another --workdir; or accept the change "
        "with --config.train.allow_changed_data=True (later batches then differ from an "
        "uninterrupted run's). A new phase may change its settings once the previous one "
        "has finished."
    )
