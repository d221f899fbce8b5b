"""Markdown table of a TPU phase's census from a `tools.aot` record: the costliest groups of
instructions by libtpu's estimated time, with their bytes and, where they run matmuls, the
share of the chip's peak those matmuls get in that time (records from before 2026-12-07
have no such share: blank).

    python benchmarks/aot/tpu_census.py benchmarks/aot/large_tpu-v5p-8.json short
"""

import json
import sys
from pathlib import Path


def table(estimate: dict) -> str:
    total_s, total_b = estimate["optimal_seconds"], estimate["bytes_accessed"]
    lines = [
        f"step {total_s * 1e3:.1f} ms, {total_b / 1e9:.1f} GB accessed "
        f"(libtpu's figures), MFU {estimate['estimated_mfu']:.1%}",
        "",
        "| ms | share | GB | count | matmul % of peak | instruction: source op |",
        "|---|---|---|---|---|---|",
    ]
    for group in estimate["census"]:
        matmul = group.get("matmul_share_of_peak")
        lines.append(
            f"| {group['seconds'] * 1e3:.2f} | {group['seconds'] / total_s:.1%} | "
            f"{group['bytes'] / 1e9:.2f} | {group['count']} | "
            f"{f'{matmul:.0%}' if matmul else ''} | `{group['op']}` |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    record = json.loads(Path(sys.argv[1]).read_text())
    phase = sys.argv[2] if len(sys.argv) > 2 else "short"
    print(table(record["phases"][phase]["tpu"] if "phases" in record else record["tpu"]))
