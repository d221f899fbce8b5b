#!/usr/bin/env bash
# The measured figures of benchmarks/README.md "Accelerators", in one call on a lent GPU.
#
#   bash benchmarks/gpu/run.sh OUT_DIR [SECONDS]
#
# Stages in order of what matters most, each under its own time cap and all under SECONDS
# (default 540); a stage that fails or runs out of time is logged and the next one runs.
# A failed smoke run (bertjax's step on the GPU at all) stops the script at once. Records
# land in OUT_DIR (JSON of bertjax.tools.bench and benchmarks/step_levers.py, log.txt).
# The machine's own JAX is used (it needs Python >= 3.12; the versions are logged): the
# lent image holds jax, flax, optax, torch and transformers; ml_collections travels as a
# wheel in .whl/ (the device tool's README says how), trace_summary.py in .gpu/.
set -u
. benchmarks/gpu/stages.sh
begin "${1:?OUT_DIR}" "${2:-540}"
export TRACE_SUMMARY=.gpu/trace_summary.py

say "machine: $(nvidia-smi -L 2>&1 | head -1); $(nproc) cores"
python3 -m pip show jax jaxlib jax-cuda13-plugin flax optax torch transformers 2>/dev/null \
    | grep -E "^(Name|Version)" | paste - - | tee -a "$LOG"

SMOKE=(python3 -m bertjax.tools.bench --config=configs/tiny.py --config.model.dtype=bfloat16
       --steps=3 --rounds=1)
# cuDNN's fused attention ("auto" on a GPU) first; where it fails, the einsum reference.
if stage smoke_cudnn 90 "${SMOKE[@]}"; then ATTN=auto LEVERS=1,3; else
    ATTN=einsum LEVERS=0,1
    stage smoke_einsum 90 "${SMOKE[@]}" --config.model.attention_impl=einsum \
        || { say "smoke failed: stopping"; exit 1; }
fi

LARGE=(python3 -m bertjax.tools.bench --config=configs/large.py --steps=5 --rounds=3
       --compare=hf "--config.model.attention_impl=$ATTN")
# JAX and PyTorch share the GPU in the --compare runs: JAX takes under half of it.
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 stage large_l128_vs_hf 200 "${LARGE[@]}" \
    --config.train.global_batch_size=128 --out="$OUT/gpu_large_l128.json"
stage levers_l128 150 python3 benchmarks/step_levers.py --lengths=128 --variants=$LEVERS \
    --profile=${LEVERS#*,} --steps=10 --out="$OUT/levers"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 stage large_l512_vs_hf 200 "${LARGE[@]}" \
    --config.train.global_batch_size=32 --config.data.max_seq_length=512 \
    --config.data.max_predictions_per_seq=80 --out="$OUT/gpu_large_l512.json"
stage modernbert_base_l1024 90 python3 -m bertjax.tools.bench \
    --config=configs/modernbert_base.py --config.train.global_batch_size=32 --packed=4 \
    --config.model.attention_impl=$ATTN --steps=5 --rounds=2 \
    --out="$OUT/gpu_modernbert_base_l1024.json"
# What fails in cuDNN's attention: outputs and gradients without dropout, then dropout.
stage cudnn_check 60 python3 benchmarks/step_levers.py --check --lengths=128 --variants=1 \
    --layers=2 --steps=2 --out="$OUT/cudnn_check"
rm -rf "$OUT"/levers*/trace_*  # traces are summarised in the log; only the JSON comes back
say "done"
grep -E "^\[|MFU|throughput|cudnn check|^L=" "$LOG" | tail -60
