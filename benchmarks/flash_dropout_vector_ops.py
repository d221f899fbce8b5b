"""The TPU dropout kernel's vector instructions per score, counted in Mosaic's final LLO.

    JAX_PLATFORMS=cpu python benchmarks/flash_dropout_vector_ops.py --target=tpu-v5p-8 \
        --out=benchmarks/aot/flash_dropout_vector_ops.json
    # another version of the kernel: its tree (a directory BEFORE) on PYTHONPATH, named in the record
    git archive eaea010 bertjax | tar -x -C BEFORE
    PYTHONPATH=BEFORE python benchmarks/flash_dropout_vector_ops.py \
        --source="eaea010 (before the vector-work cut)" --out=...

Compiles `flash_dropout` forward and backward deviceless (BERT-large's 16 heads of 64, batch
4, at 128 and 512 tokens) with Mosaic's dumps on, and counts the vector operations (`llo.v*`,
loads and stores included, matmul pushes and pops too) in each kernel's final LLO, per 8 x 128
vector register of scores (one head's `[L, L]` is L * L / 1024 of them). libtpu's cost model
charges none of these; this is how many the kernel issues, not how long they take.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile

BATCH, HEADS, HEAD_SIZE = 4, 16, 64


def _compile(target: str, length: int) -> None:
    """Runs in a child process, so that libtpu reads the dump flag at its start."""
    import jax
    import jax.numpy as jnp

    from bertjax.models import flash_dropout
    from bertjax.runtime import targets

    placed = jax.sharding.SingleDeviceSharding(targets.devices(targets.TARGETS[target])[0])
    shapes = [
        jax.ShapeDtypeStruct((3, BATCH, length, HEADS * HEAD_SIZE), jnp.bfloat16, sharding=placed),
        jax.ShapeDtypeStruct((BATCH, length), jnp.int32, sharding=placed),
        jax.ShapeDtypeStruct((BATCH, HEADS), jnp.int32, sharding=placed),
    ]

    def loss(qkv, ids, seeds):
        return jnp.sum(flash_dropout.flash_dropout(qkv, ids, seeds, 0.1).astype(jnp.float32))

    jax.jit(jax.value_and_grad(loss)).lower(*shapes).compile()


def count(target: str, length: int) -> dict[str, dict]:
    """Vector ops per score register of each kernel at `length` tokens."""
    with tempfile.TemporaryDirectory() as dump:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "LIBTPU_INIT_ARGS": f"--xla_mosaic_dump_to={dump}",
        }
        subprocess.run(
            [sys.executable, __file__, f"--target={target}", f"--compile={length}"],
            env=env,
            check=True,
            capture_output=True,
        )
        kernels = {}
        for final in sorted(pathlib.Path(dump).glob("*finalize-llo.txt")):
            text = final.read_text()
            name = re.search(r"func\.func @(\w+)", text)[1]  # type: ignore[index]
            steps = re.search(r"iteration_bounds = array<i64: (\d+), (\d+)>", text)
            heads_per_step = BATCH * HEADS // (int(steps[1]) * int(steps[2]))  # type: ignore[index]
            ops = collections.Counter(re.findall(r"= (llo\.v\w+)", text))
            registers = heads_per_step * length * length / 1024
            kernels[name] = {
                "heads_per_step": heads_per_step,
                "vector_ops_per_score_register": round(sum(ops.values()) / registers, 1),
                "by_op": {op: round(n / registers, 2) for op, n in ops.most_common()},
            }
        return kernels


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="tpu-v5p-8")
    parser.add_argument("--compile", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out")
    parser.add_argument("--source", help="the kernel's version, if not this checkout's HEAD")
    args = parser.parse_args()
    if args.compile:
        _compile(args.target, args.compile)
        return
    record = {
        "command": f"benchmarks/flash_dropout_vector_ops.py --target={args.target}",
        "source": args.source
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "lengths": {str(length): count(args.target, length) for length in (128, 512)},
    }
    for length, kernels in record["lengths"].items():
        for name, counted in kernels.items():
            print(f"L={length} {name}: {counted['vector_ops_per_score_register']} per register")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
