#!/usr/bin/env bash
# Compiles the paper's recipe (configs/base.py and configs/large.py as they are: batch 256,
# L=128 then L=512) for every target with the real compilers, one compile at a time
# (BERT-large takes 2-6 minutes and up to 16 GB of memory on a 2-core host).
#   pip install -e '.[aot]' && bash benchmarks/aot/run.sh [MODEL ...]
# Writes benchmarks/aot/MODEL_TARGET.json (every figure) and .txt (the console's summary).
set -euo pipefail
cd "$(dirname "$0")/../.."
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(large base)
for model in "${models[@]}"; do
  for target in tpu-v4-8 tpu-v5e-8 tpu-v5p-8 tpu-v6e-8 h100 h200; do
    out="benchmarks/aot/${model}_${target}.json"
    JAX_PLATFORMS=cpu python -m bertjax.tools.aot --config="configs/${model}.py" \
      --target="${target}" --out="${out}" | tee "${out%.json}.txt"
    rm -f "${out%.json}.log"  # the compilers' own log lines: large, and nothing to keep
  done
done
