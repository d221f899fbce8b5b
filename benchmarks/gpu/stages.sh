# shellcheck shell=bash
# Shared by the GPU scripts here: `begin OUT_DIR SECONDS` starts the clock, the log
# (OUT_DIR/log.txt) and the environment; `say` logs with the seconds since then; `stage NAME
# CAP COMMAND...` runs COMMAND under min(CAP, what is left of SECONDS) and logs its exit status.
begin() {
    OUT=$1 BUDGET=$2 START=$(date +%s)
    mkdir -p "$OUT"
    LOG="$OUT/log.txt"
    export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}" TF_CPP_MIN_LOG_LEVEL=1
    export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}  # no silent CPU
}

say() { echo "[$(($(date +%s) - START))s] $*" | tee -a "$LOG"; }

stage() {
    local name=$1 cap=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    local limit=$((cap < left ? cap : left))
    if [ "$limit" -lt 20 ]; then say "SKIP $name: ${left}s left"; return 1; fi
    say "START $name (limit ${limit}s): $*"
    timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    say "END $name rc=$rc"
    return $rc
}
