#!/usr/bin/env bash
# Issue 44, item 5, in one call on a lent GPU (at most 10 minutes):
#
#   bash benchmarks/gpu/cudnn_and_step.sh OUT_DIR [SECONDS]
#
# 1. Where cuDNN's fused attention fails, if it does: each case of cudnn_probe.py in its own
#    process (a C++ abort ends only that case), from the bare kernel to the product's step.
# 2. The product's train step (step_levers.py variant 1: einsum attention, the recipe's
#    dropout, BERT-Adam, clipping, the nonfinite guard), BERT-large's layer sizes at 4 and
#    at 24 layers, L=128 B=128; cuDNN with dropout beside it (variant 3) where step_dropout
#    passed. Then L=512 B=32 at 24 layers if time is left.
# The machine's own JAX is used (the versions are logged); nothing needs to travel.
set -u
. benchmarks/gpu/stages.sh
begin "${1:?OUT_DIR}" "${2:-520}"

say "machine: $(nvidia-smi -L 2>&1 | head -1); $(nproc) cores"
python3 -m pip show jax jaxlib jax-cuda13-plugin flax optax 2>/dev/null \
    | grep -E "^(Name|Version)" | paste - - | tee -a "$LOG"

for case in raw model_nodrop model_dropout_fwd model_dropout_grad step_nodrop; do
    stage "probe_$case" 75 python3 benchmarks/gpu/cudnn_probe.py "$case"
done
VARIANTS=1
if stage probe_step_dropout 75 python3 benchmarks/gpu/cudnn_probe.py step_dropout; then
    VARIANTS=1,3
fi
for layers in 4 24; do
    stage "step_l128_${layers}layers" $((layers == 4 ? 100 : 220)) python3 benchmarks/step_levers.py \
        --lengths=128 --variants=$VARIANTS --layers=$layers --steps=10 \
        --out="$OUT/levers_l128_${layers}layers"
done
stage step_l512_24layers 200 python3 benchmarks/step_levers.py --lengths=512 --variants=1 \
    --layers=24 --steps=10 --out="$OUT/levers_l512_24layers"
say "done"
grep -E "^\[|^PROBE|^L=|Check failed|Error" "$LOG" | tail -60
