#!/bin/sh
# CPU BERT-base train step at 512 tokens (batch 2, fp32), unpacked vs packed, at the padding
# fractions measured on the shared Gutenberg books (gutenberg_padding.json): text_format=auto
# 3.3% unpacked -> 0.4% packed (K=4), text_format=lines 85.8% -> 3.6% (K=16). Each pair runs
# twice (the CPU is shared). Usage: sh benchmarks/packing/bench_cpu_base_512.sh
set -e
COMMON="--config=configs/base.py --config.model.dtype=float32 --config.train.global_batch_size=2 \
 --config.data.max_seq_length=512 --config.data.max_predictions_per_seq=80 --steps=2 --rounds=2"
for run in 1 2; do
  for case in "auto_unpacked --padding=0.033" "auto_packed --padding=0.004 --packed=4" \
              "lines_unpacked --padding=0.858" "lines_packed --padding=0.036 --packed=16"; do
    set -- $case
    name=$1; shift
    nice -n 19 python -m bertjax.tools.bench $COMMON "$@" \
      --out=benchmarks/packing/cpu_base_l512_${name}_run${run}.json
  done
done
