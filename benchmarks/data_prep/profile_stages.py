"""CPU seconds per stage of `python -m bertjax.prepare` with one worker (in this process):

    python benchmarks/data_prep/profile_stages.py -- --config=configs/base.py --output=DIR ...

wraps the stages' functions with a CPU timer (`time.process_time`, exclusive of the stages
they call) and prints each stage's seconds and share of the whole run's CPU time.
"""

from __future__ import annotations

import collections
import contextlib
import runpy
import sys
import time

from bertjax.data import instances, masking, shard_format, token_cache, tokenize_corpus

SECONDS: collections.Counter = collections.Counter()
_stack: list[str] = []


def timed(owner, name: str, stage: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        if _stack:  # an enclosing stage pauses
            SECONDS[_stack[-1]] += start - _resume[-1]
        _stack.append(stage)
        _resume.append(start)
        try:
            return inner(*args, **kwargs)
        finally:
            now = time.process_time()
            SECONDS[_stack.pop()] += now - _resume.pop()
            if _stack:
                _resume[-1] = now

    setattr(owner, name, wrapper)


_resume: list[float] = []
STAGES = [
    (tokenize_corpus, "tokenize_documents", "tokenizing"),
    (token_cache, "_store", "token ids stored, read back"),
    (token_cache, "_load", "token ids stored, read back"),
    (instances, "create_instances", "instance creation"),
    (masking.MaskingRule, "apply", "masking"),
    (shard_format, "unmasked_rows", "rows (filling the buffer)"),
    (shard_format.ShardWriter, "write", "writing"),
]


def main() -> None:
    for owner, name, stage in STAGES:
        if hasattr(owner, name):
            timed(owner, name, stage)
    sys.argv = [
        "bertjax.prepare",
        *sys.argv[sys.argv.index("--") + 1 :],
        "--config.data.num_workers=1",
    ]
    start = time.process_time()
    with contextlib.suppress(SystemExit):
        runpy.run_module("bertjax.prepare", run_name="__main__")
    total = time.process_time() - start
    rest = total - sum(SECONDS.values())
    print(f"total CPU s (this process): {total:.1f}")
    for stage, seconds in [
        *SECONDS.most_common(),
        ("the rest (start-up, reading, cutting, hashing)", rest),
    ]:
        print(f"  {stage:45s} {seconds:7.1f} s  {100 * seconds / total:5.1f}%")


if __name__ == "__main__":
    main()
