#!/bin/sh
# CPU BERT-base train step at 512 tokens (batch 2, fp32): packed rows against unpacked rows,
# alternating rounds in one process (the CPU is shared), at the padding fractions measured on
# the shared Gutenberg books (gutenberg_padding.json): data.text_format=auto 3.3% unpacked ->
# 0.4% packed (K=4), text_format=lines 85.8% -> 3.6% (K=16). Each case runs twice.
# Usage: sh benchmarks/packing/bench_cpu_base_512.sh (RUNS="2" for one repeat)
set -e
COMMON="--config=configs/base.py --config.model.dtype=float32 --config.train.global_batch_size=2 \
 --config.data.max_seq_length=512 --config.data.max_predictions_per_seq=80 --steps=2 --rounds=3 \
 --compare=unpacked"
for run in ${RUNS:-1 2}; do
  nice -n 19 python -m bertjax.tools.bench $COMMON --packed=4 --padding=0.004 \
    --unpacked_padding=0.033 --out=benchmarks/packing/cpu_base_l512_auto_run${run}.json
  nice -n 19 python -m bertjax.tools.bench $COMMON --packed=16 --padding=0.036 \
    --unpacked_padding=0.858 --out=benchmarks/packing/cpu_base_l512_lines_run${run}.json
done
