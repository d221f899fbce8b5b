#!/usr/bin/env bash
# Issue 51's GPU check in one call of at most 9 minutes (540 s), compiles included:
#   bash benchmarks/gpu/same_run.sh OUT_DIR [SECONDS]
# bertjax beside transformers (BertForPreTraining, SDPA, bf16 autocast, torch.compile,
# AdamW) at L=128 B=128 and L=512 B=32, then bertjax's resume bit-exactness, then (if time is
# left) bertjax's dense Triton kernels against XLA's ops. Wheels in .whl/
# (ml_collections: the lent image lacks it) are installed first where present.
set -u
. benchmarks/gpu/stages.sh
begin "${1:?OUT_DIR}" "${2:-540}"
if ls .whl/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
say "machine: $(nvidia-smi -L 2>&1 | head -1); $(nproc) cores"
python3 -m pip show jax jaxlib flax optax torch transformers 2>/dev/null \
    | grep -E "^(Name|Version)" | paste - - | tee -a "$LOG"
# JAX and PyTorch share the card: JAX takes under half of it.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.45
stage resume_check 120 python3 benchmarks/gpu/same_run.py --out="$OUT" --skip_compare
stage l128_b128 200 python3 benchmarks/gpu/same_run.py --out="$OUT" --shapes=128 --skip_resume
stage l512_b32 200 python3 benchmarks/gpu/same_run.py --out="$OUT" --shapes=512 --skip_resume
# bertjax's Triton GEMMs and LayerNorm kernels (model.dense_impl=auto) against XLA's ops for
# the same work, alternating rounds: 4 of BERT-large's layers at L=128 B=128 (if time is left).
stage dense_l128_4layers 90 python3 -m bertjax.tools.bench --config=configs/large.py \
    --config.model.num_hidden_layers=4 --config.train.global_batch_size=128 \
    --config.data.max_seq_length=128 --config.data.max_predictions_per_seq=20 \
    --compare=xla_dense --peak_tflops=989 --out="$OUT/dense_l128_4layers.json"
say "done"
grep -E "^\[|MFU|throughput|resume" "$LOG" | tail -40
