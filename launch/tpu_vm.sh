#!/usr/bin/env bash
# Cloud TPU VM launcher for bertjax: create a slice, install, train on every worker, follow,
# supervise (recreate a preempted spot slice and relaunch; training resumes from the
# checkpoints in the gs:// workdir by itself), delete.
#
#   launch/tpu_vm.sh SUBCOMMAND --name NAME --zone ZONE [options] [-- TRAIN_ARGS...]
#
# Subcommands:
#   create     create the slice: on demand, --spot, or --queued (queued resources; waits
#              until ACTIVE)
#   setup      copy this checkout (git archive of HEAD) to every worker, install jax[tpu],
#              gcsfs, google-cloud-storage and bertjax
#   train      on every worker: stop stale training processes, remove /tmp/libtpu_lockfile,
#              start `python3 -m bertjax.train --workdir=WORKDIR TRAIN_ARGS` detached
#              (setsid nohup; output in ~/bertjax_train.log)
#   logs       follow worker 0's training log
#   status     print the slice's state (READY, PREEMPTED, ...; nothing if it does not exist)
#   delete     delete the slice (and its queued resource with --queued)
#   supervise  loop: while WORKDIR/final_metrics.json is absent, recreate the slice if it is
#              preempted or gone (create, setup, train), and relaunch training if a worker
#              has no training process
#
# Options:
#   --name NAME            TPU VM name ($TPU_NAME)
#   --zone ZONE            zone, e.g. us-central2-b ($TPU_ZONE)
#   --project PROJECT      GCP project (default: gcloud's configured project)
#   --accelerator TYPE     accelerator type (default v4-32)
#   --version RUNTIME      TPU software version (default: from the accelerator family:
#                          v4 tpu-ubuntu2204-base, v5e v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5,
#                          v6e v2-alpha-tpuv6e)
#   --spot | --queued      spot capacity; queued resources (both may be given)
#   --workdir gs://...     run directory (train, supervise)
#   --jax-version V        jax[tpu] version to install (default 0.10.2)
#   --interval SECONDS     supervise: seconds between checks (default 300)
#   --max-checks N         supervise: stop after N checks (default 0 = until training ends)
#   --dry-run              print the gcloud commands instead of running them
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Expanded on the workers, not here.
# shellcheck disable=SC2016
LOG_FILE='$HOME/bertjax_train.log'
TRAIN_COMMAND='python3 -m bertjax.train'
# Matches the training processes but not a shell whose command line holds this pattern.
TRAIN_PATTERN='[p]ython3 -m bertjax[.]train'

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT=""
ACCELERATOR="v4-32"
VERSION=""
SPOT=0
QUEUED=0
WORKDIR=""
JAX_VERSION="0.10.2"
INTERVAL=300
MAX_CHECKS=0
DRY_RUN=0
TRAIN_ARGS=()

die() {
  echo "error: $*" >&2
  exit 1
}

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# Single-quotes an argument unless it is made of characters the shell leaves alone.
shell_quote() {
  if [[ "$1" =~ ^[][A-Za-z0-9_./:=@%+,~-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# Prints a command (copy-pasteable) under --dry-run, runs it otherwise. Printed commands go
# to file descriptor 3, the script's standard output, even from inside $(...).
run() {
  if ((DRY_RUN)); then
    local arg line=""
    for arg in "$@"; do line+="${line:+ }$(shell_quote "${arg}")"; done
    echo "${line}" >&3
  else
    "$@"
  fi
}

# A query whose answer decides what to do next: under --dry-run it is printed and fails
# (answers nothing).
query() {
  if ((DRY_RUN)); then
    run "$@"
    return 1
  fi
  "$@"
}

scope_flags() {
  printf '%s\n' "--zone=${ZONE}"
  if [[ -n "${PROJECT}" ]]; then printf '%s\n' "--project=${PROJECT}"; fi
}

runtime_version() {
  if [[ -n "${VERSION}" ]]; then
    echo "${VERSION}"
    return
  fi
  case "${ACCELERATOR}" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-* | v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "no default --version for accelerator ${ACCELERATOR}; pass --version RUNTIME" ;;
  esac
}

tpu() {
  local action="$1"
  shift
  local scope
  mapfile -t scope < <(scope_flags)
  run gcloud compute tpus tpu-vm "${action}" "$@" "${scope[@]}"
}

ssh_workers() {
  local workers="$1" command="$2"
  tpu ssh "${NAME}" "--worker=${workers}" "--command=${command}"
}

cmd_create() {
  local version spot=() scope
  version="$(runtime_version)"
  if ((SPOT)); then spot=(--spot); fi
  mapfile -t scope < <(scope_flags)
  if ((QUEUED)); then
    run gcloud compute tpus queued-resources create "${NAME}-qr" "--node-id=${NAME}" \
      "--accelerator-type=${ACCELERATOR}" "--runtime-version=${version}" "${spot[@]}" "${scope[@]}"
    local state=""
    until [[ "${state}" == "ACTIVE" ]]; do
      state="$(query gcloud compute tpus queued-resources describe "${NAME}-qr" \
        '--format=value(state.state)' "${scope[@]}")" || { ((DRY_RUN)) && return; }
      case "${state}" in
        FAILED | SUSPENDED) die "queued resource ${NAME}-qr is ${state}" ;;
        ACTIVE) ;;
        *) sleep 30 ;;
      esac
    done
  else
    tpu create "${NAME}" "--accelerator-type=${ACCELERATOR}" "--version=${version}" "${spot[@]}"
  fi
}

cmd_setup() {
  local archive="/tmp/bertjax-${NAME}.tar.gz"
  run git -C "${REPO_ROOT}" archive --format=tar.gz "--output=${archive}" HEAD
  tpu scp "${archive}" "${NAME}:~/bertjax.tar.gz" --worker=all
  ssh_workers all "set -e; rm -rf ~/bertjax && mkdir -p ~/bertjax && tar xzf ~/bertjax.tar.gz -C ~/bertjax \
&& python3 -m pip install -q 'jax[tpu]==${JAX_VERSION}' gcsfs google-cloud-storage \
&& python3 -m pip install -q -e ~/bertjax"
}

cmd_train() {
  [[ "${WORKDIR}" == gs://* ]] || die "train needs --workdir gs://BUCKET/PATH (every worker must see it)"
  local args
  args="$(printf ' %q' "--workdir=${WORKDIR}" "${TRAIN_ARGS[@]}")"
  ssh_workers all "pkill -f '${TRAIN_PATTERN}' || true; sleep 2; sudo rm -f /tmp/libtpu_lockfile; \
cd ~/bertjax && setsid nohup ${TRAIN_COMMAND}${args} > ${LOG_FILE} 2>&1 < /dev/null &"
}

cmd_logs() {
  ssh_workers 0 "tail -n 100 -F ${LOG_FILE}"
}

slice_state() {
  local scope
  mapfile -t scope < <(scope_flags)
  query gcloud compute tpus tpu-vm describe "${NAME}" '--format=value(state)' "${scope[@]}" \
    2> /dev/null || true
}

cmd_status() {
  slice_state
}

cmd_delete() {
  local scope
  mapfile -t scope < <(scope_flags)
  if ((QUEUED)); then
    run gcloud compute tpus queued-resources delete "${NAME}-qr" --force --quiet "${scope[@]}"
  else
    tpu delete "${NAME}" --quiet
  fi
}

training_finished() {
  query gcloud storage ls "${WORKDIR}/final_metrics.json" > /dev/null
}

# True when every worker runs a training process.
training_running() {
  local check="pgrep -f '${TRAIN_PATTERN}' > /dev/null"
  if ((DRY_RUN)); then ssh_workers all "${check}"; return; fi
  ssh_workers all "${check}" > /dev/null 2>&1
}

recreate() {
  SPOT=1
  cmd_create
  cmd_setup
  cmd_train
}

cmd_supervise() {
  [[ "${WORKDIR}" == gs://* ]] || die "supervise needs --workdir gs://BUCKET/PATH"
  if ((DRY_RUN)); then  # one check and the recovery round after a preemption
    training_finished || true
    slice_state
    cmd_delete
    recreate
    training_running || true
    return
  fi
  local checks=0 state
  while ((MAX_CHECKS == 0 || checks < MAX_CHECKS)); do
    checks=$((checks + 1))
    if training_finished; then
      echo "supervise: ${WORKDIR}/final_metrics.json exists; training is done"
      return 0
    fi
    state="$(slice_state)"
    case "${state}" in
      READY)
        if ! training_running; then
          echo "supervise: a worker has no training process; relaunching"
          cmd_train
        fi
        ;;
      "" | PREEMPTED | TERMINATED | STOPPED)
        echo "supervise: slice ${NAME} is ${state:-gone}; recreating"
        if [[ -n "${state}" ]]; then cmd_delete; fi
        recreate
        ;;
      *) echo "supervise: slice ${NAME} is ${state}; waiting" ;;
    esac
    sleep "${INTERVAL}"
  done
}

main() {
  (($# > 0)) || { usage; exit 1; }
  local subcommand="$1"
  shift
  while (($# > 0)); do
    case "$1" in
      --name) NAME="$2"; shift 2 ;;
      --zone) ZONE="$2"; shift 2 ;;
      --project) PROJECT="$2"; shift 2 ;;
      --accelerator) ACCELERATOR="$2"; shift 2 ;;
      --version) VERSION="$2"; shift 2 ;;
      --workdir) WORKDIR="$2"; shift 2 ;;
      --jax-version) JAX_VERSION="$2"; shift 2 ;;
      --interval) INTERVAL="$2"; shift 2 ;;
      --max-checks) MAX_CHECKS="$2"; shift 2 ;;
      --spot) SPOT=1; shift ;;
      --queued) QUEUED=1; shift ;;
      --dry-run) DRY_RUN=1; shift ;;
      --) shift; TRAIN_ARGS=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      *) die "unknown option $1 (see launch/tpu_vm.sh --help)" ;;
    esac
  done
  case "${subcommand}" in
    create | setup | train | logs | status | delete | supervise) ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown subcommand ${subcommand}; one of create setup train logs status delete supervise" ;;
  esac
  [[ -n "${NAME}" ]] || die "--name NAME (or \$TPU_NAME) is required"
  [[ -n "${ZONE}" ]] || die "--zone ZONE (or \$TPU_ZONE) is required"
  "cmd_${subcommand}"
}

exec 3>&1
main "$@"
