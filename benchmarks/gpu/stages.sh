# Shared by the GPU scripts here: `say` logs with the seconds since START, `stage NAME CAP
# COMMAND...` runs COMMAND under min(CAP, what is left of BUDGET) and logs its exit status.
# The caller sets START, BUDGET and LOG.
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
