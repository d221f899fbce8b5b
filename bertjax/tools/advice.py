"""The advice for a phase that does not fit (`tools.aot`): the verdict's candidate settings
compiled, cheapest first, within a time budget; only a setting the compiler confirms is advised."""

from __future__ import annotations

import time
from typing import Any

import jax
import ml_collections

from bertjax.errors import UserError
from bertjax.runtime import targets
from bertjax.tools import phase_compile


def with_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> Any:
    """A copy of `config` with `{"section.field": value}` set."""
    trial = config.copy_and_resolve_references()
    for key, value in overrides.items():
        *path, field = key.split(".")
        section = trial
        for name in path:
            section = section[name]
        section[field] = value
    return trial


def advise(
    config: ml_collections.ConfigDict,
    devices: list[jax.Device],
    phase_name: str,
    record: dict[str, Any],
    target: targets.Target | None,
    budget_seconds: float,
    memory_bytes: float | None = None,
) -> dict[str, Any]:
    """Compiles the phase with each of the verdict's candidate settings, cheapest first,
    until one fits or `budget_seconds` have passed (a compile under way is finished):
    `{"fits_with": flags | None, "tried": [...], "untried": [...]}`."""
    start, tried = time.time(), []
    pending = list(record["verdict"].get("candidates", []))
    while pending and time.time() - start < budget_seconds:
        candidate = pending.pop(0)
        try:
            trial_config = with_overrides(config, candidate["overrides"])
            sharded, (phase,) = phase_compile.build(trial_config, devices, [phase_name])
            trial = phase_compile.compile_phase(sharded, phase, trial_config, target, memory_bytes)
        except UserError as e:  # a setting this batch or mesh cannot take
            tried.append({"flags": candidate["flags"], "fits": False, "text": str(e)})
            continue
        verdict = trial["verdict"]
        tried.append(
            {
                "flags": candidate["flags"],
                "fits": verdict["fits"],
                "text": verdict["text"],
                "compile_seconds": trial["compile_seconds"],
            }
        )
        if verdict["fits"]:
            return {
                "fits_with": candidate["flags"],
                "tried": tried,
                "untried": [c["flags"] for c in pending],
            }
    return {"fits_with": None, "tried": tried, "untried": [c["flags"] for c in pending]}


def advice_lines(advice: dict[str, Any], budget_seconds: float) -> list[str]:
    """The console's lines for the advisor's outcome: only a setting the compiler confirmed."""
    lines = [f"  {t['flags']}: {t['text']}" for t in advice["tried"]]
    if advice["fits_with"]:
        lines.append(f"  advice, confirmed by the compiler: {advice['fits_with']}")
    else:
        lines.append(
            f"  no setting confirmed to fit within {budget_seconds:.0f} s"
            + (
                f"; not compiled: {', '.join(advice['untried'])}"
                if advice["untried"]
                else "; none of the candidates fits"
            )
        )
    return lines
