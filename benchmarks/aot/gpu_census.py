"""Markdown tables of a GPU phase's kernel census from a `tools.aot` record: roofline time by
family (matmul, attention, Pallas kernels, elementwise kernels by the model part they
belong to, the optimizer), then the costliest groups of kernels.

    python benchmarks/aot/gpu_census.py benchmarks/aot/gpu_census_large_h100_short.json short
"""

import json
import sys
from pathlib import Path


def table(census: dict) -> str:
    total_s = census["roofline_seconds"]
    lines = [
        f"roofline {total_s * 1e3:.1f} ms, {census['kernels']:,} kernels, "
        f"{census['bytes'] / 1e9:.1f} GB, {census['flops'] / 1e12:.2f} TFLOP; "
        f"a skipped step {census.get('skipped_step_seconds', 0.0) * 1e3:.2f} ms more",
        "",
        "| family | ms | share | kernels | GB | TFLOP |",
        "|---|---|---|---|---|---|",
    ]
    for row in census["families"]:
        lines.append(
            f"| {row['group']} | {row['seconds'] * 1e3:.2f} | {row['seconds'] / total_s:.1%} | "
            f"{row['count']:,} | {row['bytes'] / 1e9:.2f} | {row['flops'] / 1e12:.2f} |"
        )
    lines += ["", "| ms | kernels | GB | family: pass, module [what it fuses], result |"]
    lines.append("|---|---|---|---|")
    for row in census["groups"]:
        family, what = row["group"].split(" | ", 1)
        lines.append(
            f"| {row['seconds'] * 1e3:.2f} | {row['count']} | {row['bytes'] / 1e9:.2f} | "
            f"{family}: `{what}` |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    record = json.loads(Path(sys.argv[1]).read_text())
    phase = sys.argv[2] if len(sys.argv) > 2 else "short"
    print(table(record["phases"][phase]["gpu"]))
