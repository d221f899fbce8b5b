"""What a pretraining checkpoint records about its run, typed: `RunRecord`, read from and
written as the checkpoint's `meta` JSON item with the keys it has always had (`of`,
`as_json`), so that checkpoints written before this type resume exactly."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax

GLOBAL = "global"  # `data_order` of a run whose global batches do not depend on its shape


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run's record: its `model` (families.recorded_fields) and `tokenizer` (fingerprint)
    must match to resume; its `data` (guards.data_identity) and its `config`'s data fields
    must match within a phase; its shape, `processes` and `devices` (all of them), and its
    `data_order` (GLOBAL: global batch k is the same on any shape; older multi-process runs
    read per-process shares: resume.check_shape); the `schedule` it follows
    (run_schedule.Plan.record). Older checkpoints lack some fields (None); `others` keeps the keys this type does not name
    (e.g. the state's digest, checkpoint_checks.DIGEST) as read."""

    model: Mapping[str, Any] | None = None
    config: str | None = None  # the whole config as JSON
    data: Mapping[str, Any] | None = None
    processes: int | None = None
    devices: int | None = None
    data_order: str | None = None
    schedule: Mapping[str, Any] | None = None
    tokenizer: str | None = None
    others: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> RunRecord:
        """The record of a checkpoint's `meta`."""
        named = {f.name for f in dataclasses.fields(cls)} - {"others"}
        return cls(
            **{key: value for key, value in meta.items() if key in named},
            others={key: value for key, value in meta.items() if key not in named},
        )

    @classmethod
    def new(
        cls,
        model: Mapping[str, Any],
        config_json: str,
        data: Mapping[str, Any],
        schedule: Mapping[str, Any],
        devices: int,
    ) -> RunRecord:
        """A new run's record on `devices` (its mesh's, in all processes; the tokenizer's
        fingerprint is added once it is loaded)."""
        return cls(
            dict(model),
            config_json,
            dict(data),
            jax.process_count(),
            devices,
            GLOBAL,
            dict(schedule),
        )

    def as_json(self) -> dict[str, Any]:
        """The `meta` JSON item: the fields this record holds, under their names."""
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "others" and getattr(self, f.name) is not None
        }
        return {**values, **self.others}

    @property
    def config_values(self) -> dict[str, Any]:
        """The recorded config, as JSON values."""
        return json.loads(self.config or "{}")
