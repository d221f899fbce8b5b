"""Runs a command and reports its wall time, CPU seconds and peak memory of all its
processes: the peak of the summed RSS of the process tree, sampled every 0.1 s with psutil
(workers included), and the largest single process's peak RSS (getrusage).

    python benchmarks/data_prep/measure.py -- python -m bertjax.prepare ...
"""

from __future__ import annotations

import contextlib
import json
import resource
import subprocess
import sys
import time

import psutil


def tree_rss(process: psutil.Process) -> int:
    total = 0
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def main() -> None:
    command = sys.argv[sys.argv.index("--") + 1 :]
    start = time.time()
    child = subprocess.Popen(command)
    process, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        with contextlib.suppress(psutil.Error):
            peak = max(peak, tree_rss(process))
        time.sleep(0.1)
    wall = time.time() - start
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(
        json.dumps(
            {
                "returncode": child.returncode,
                "wall_s": round(wall, 1),
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                "peak_rss_all_processes_gb": round(peak / 1e9, 2),
                "peak_rss_largest_process_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
                "load_average": [round(x, 2) for x in psutil.getloadavg()],
            }
        )
    )


if __name__ == "__main__":
    main()
