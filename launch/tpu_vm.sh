#!/usr/bin/env bash
# Cloud TPU VM launcher for bertjax: create a slice, install, run a job on every worker,
# follow, supervise (recreate a preempted slice as it was created and relaunch: every
# relaunch is the first launch again, and the job resumes from its gs:// workdir), delete.
#
#   launch/tpu_vm.sh SUBCOMMAND --name NAME --zone ZONE [options] [-- JOB_ARGS...]
#
# Subcommands:
#   create     create the slice: on demand, --spot, or --queued (queued resources; waits
#              until ACTIVE); records its kind (accelerator, version, spot, queued) in
#              $BERTJAX_LAUNCH_STATE/NAME (default ~/.bertjax/launch) for recreations
#   setup      copy this checkout (git archive of HEAD; refused with uncommitted changes
#              unless --allow-dirty) to every worker, install bertjax with its `tpu`
#              extra (the jax[tpu] release setup.py pins), gcsfs and google-cloud-storage,
#              and copy each --stage gs:// path into
#              ~/bertjax/staged/ on every worker
#   run        on every worker: stop stale processes of the job, remove /tmp/libtpu_lockfile,
#              start `python3 -m bertjax.JOB [--workdir=WORKDIR] JOB_ARGS` detached
#              (setsid nohup; output in ~/bertjax_JOB.log)
#   train      run --job train
#   logs       follow worker 0's log of the job
#   status     print the slice's state (READY, PREEMPTED, ...; nothing if it does not exist)
#   delete     delete the slice (and its queued resource with --queued)
#   supervise  loop (train and finetune): while the job's end marker is absent
#              (WORKDIR/final_metrics.json, WORKDIR/summary.json), recreate the slice if it is
#              preempted or gone (create as recorded, setup with its data, run), and
#              relaunch the job if a worker has no process of it
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
#   --job JOB              bertjax module to run: train (default), finetune, probe,
#                          extract_features, tools.bench, tools.aot, ...
#   --workdir gs://...     run directory (train, finetune, probe, supervise)
#   --stage gs://...       setup: copy this object or prefix into ~/bertjax/staged/ on every
#                          worker (repeatable); or name gs:// inputs in JOB_ARGS directly
#   --allow-dirty          setup: ship uncommitted changes to tracked files too
#   --interval SECONDS     supervise: seconds between checks (default 300)
#   --max-checks N         supervise: stop after N checks (default 0 = until training ends)
#   --dry-run              print the gcloud commands instead of running them
#
# Launcher options go before `--`; one after it (e.g. `-- --dry-run`) is refused, since the
# job would get it. run, train and supervise parse the job's flags here first, as the job
# parses them (a config typo, an unknown flag: the job's own `error:` line), before any gcloud
# call; with a python ($BERTJAX_PYTHON, default python3) that lacks bertjax's dependencies
# they say so and leave the check to the slice.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Expanded on the workers, not here.
# shellcheck disable=SC2016
LOG_DIR='$HOME'
# Staged data lives in the code directory, where jobs run: they name it staged/...
# shellcheck disable=SC2016
STAGE_DIR='$HOME/bertjax/staged'
STATE_DIR="${BERTJAX_LAUNCH_STATE:-${HOME}/.bertjax/launch}"

NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT=""
ACCELERATOR="v4-32"
VERSION=""
SPOT=0
QUEUED=0
WORKDIR=""
JOB="train"
STAGE=()
ALLOW_DIRTY=0
INTERVAL=300
MAX_CHECKS=0
DRY_RUN=0
TRAIN_ARGS=()
JOB_ARGV=()

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

# The job's log on a worker, and a pattern that matches its processes but not a shell whose
# command line holds the pattern.
job_log() { echo "${LOG_DIR}/bertjax_${JOB}.log"; }
job_pattern() {
  local module="bertjax.${JOB}"
  printf '[p]ython3 -m %s' "${module//./[.]}"
}

takes_workdir() {
  case "${JOB}" in
    train | finetune | probe) return 0 ;;
    *) return 1 ;;
  esac
}

# The file a finished run leaves in its workdir (jobs that resume from their workdir only).
end_marker() {
  case "${JOB}" in
    train) echo final_metrics.json ;;
    finetune) echo summary.json ;;
    *) return 1 ;;
  esac
}

# The slice's kind as created, for recreating it the same (not under --dry-run).
save_kind() {
  ((DRY_RUN)) && return
  mkdir -p "${STATE_DIR}"
  printf 'ACCELERATOR=%s\nVERSION=%s\nSPOT=%s\nQUEUED=%s\n' "${ACCELERATOR}" \
    "$(runtime_version)" "${SPOT}" "${QUEUED}" > "${STATE_DIR}/${NAME}"
}

load_kind() {
  local key value
  if [[ ! -f "${STATE_DIR}/${NAME}" ]]; then
    echo "supervise: no record of how ${NAME} was created (${STATE_DIR}/${NAME}); recreating" \
      "it from this command's options" >&2
    return
  fi
  while IFS='=' read -r key value; do
    case "${key}" in
      ACCELERATOR) ACCELERATOR="${value}" ;;
      VERSION) VERSION="${value}" ;;
      SPOT) SPOT="${value}" ;;
      QUEUED) QUEUED="${value}" ;;
    esac
  done < "${STATE_DIR}/${NAME}"
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
  save_kind
}

# HEAD, or with --allow-dirty a commit of the working tree's tracked files; refuses a
# checkout with uncommitted changes otherwise (printed, not checked, under --dry-run).
shipped_tree() {
  if ((DRY_RUN)); then
    run git -C "${REPO_ROOT}" status --porcelain
    echo HEAD
  elif [[ -z "$(git -C "${REPO_ROOT}" status --porcelain)" ]]; then
    echo HEAD
  elif ((ALLOW_DIRTY)); then
    echo "setup: shipping uncommitted changes to tracked files (--allow-dirty); untracked" \
      "files stay behind" >&2
    git -C "${REPO_ROOT}" stash create
  else
    die "${REPO_ROOT} has uncommitted changes, which setup (git archive of HEAD) would leave" \
      "behind: commit them, or pass --allow-dirty to ship changes to tracked files"
  fi
}

cmd_setup() {
  local archive="/tmp/bertjax-${NAME}.tar.gz" tree
  tree="$(shipped_tree)"
  run git -C "${REPO_ROOT}" archive --format=tar.gz "--output=${archive}" "${tree:-HEAD}"
  tpu scp "${archive}" "${NAME}:~/bertjax.tar.gz" --worker=all
  ssh_workers all "set -e; rm -rf ~/bertjax && mkdir -p ~/bertjax && tar xzf ~/bertjax.tar.gz -C ~/bertjax \
&& python3 -m pip install -q -e ~/bertjax'[tpu]' gcsfs google-cloud-storage"
  stage_data
}

# Copies every --stage path into STAGE_DIR on every worker (part of each recreation).
stage_data() {
  local source copies=""
  ((${#STAGE[@]})) || return 0
  for source in "${STAGE[@]}"; do
    copies+=" && gcloud storage cp -r $(printf '%q' "${source%/}") ${STAGE_DIR}/"
  done
  ssh_workers all "set -e; mkdir -p ${STAGE_DIR}${copies}"
}

# Sets JOB_ARGV, the job's command-line arguments: --workdir (for jobs that take one), then
# JOB_ARGS.
set_job_argv() {
  JOB_ARGV=()
  if takes_workdir; then
    [[ "${WORKDIR}" == gs://* ]] || die "${JOB} needs --workdir gs://BUCKET/PATH (every worker must see it)"
    JOB_ARGV=("--workdir=${WORKDIR}")
  fi
  JOB_ARGV+=("${TRAIN_ARGS[@]}")
}

# Refuses a launcher option after `--`, then parses the job's flags with this checkout's
# bertjax (absl's --only_check_args: the job stops before its work); exits on a mistake.
check_job_args() {
  local arg python="${BERTJAX_PYTHON:-python3}" status=0
  for arg in "${TRAIN_ARGS[@]}"; do
    case "${arg%%=*}" in
      --name | --zone | --project | --accelerator | --version | --spot | --queued | --job | \
        --workdir | --stage | --allow-dirty | --interval | --max-checks | --dry-run)
        die "${arg%%=*} comes after --, which hands it to the job (python -m bertjax.${JOB});" \
          "launcher options go before --" ;;
    esac
  done
  set_job_argv
  if ! command -v "${python}" > /dev/null; then
    echo "note: no ${python} here: the job flags are not checked before launch" >&2
    return
  fi
  (cd "${REPO_ROOT}" && PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}" "${python}" -c '
import sys
try:
    from bertjax import cli
except ImportError as e:
    print(f"note: the job flags are not checked before launch ({e})", file=sys.stderr)
    sys.exit(3)
sys.exit(cli.check_job_flags(sys.argv[1], sys.argv[2:]))' "${JOB}" "${JOB_ARGV[@]}" >&2) || status=$?
  if ((status != 0 && status != 3)); then
    echo "launch/tpu_vm.sh: nothing launched (python -m bertjax.${JOB} refuses its flags)" >&2
    exit 1
  fi
}

cmd_run() {
  local quoted=""
  set_job_argv
  if ((${#JOB_ARGV[@]})); then quoted="$(printf ' %q' "${JOB_ARGV[@]}")"; fi
  ssh_workers all "pkill -f '$(job_pattern)' || true; sleep 2; sudo rm -f /tmp/libtpu_lockfile; \
cd ~/bertjax && setsid nohup python3 -m bertjax.${JOB}${quoted} > $(job_log) 2>&1 < /dev/null &"
}

cmd_train() {
  JOB=train
  cmd_run
}

cmd_logs() {
  ssh_workers 0 "tail -n 100 -F $(job_log)"
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

job_finished() {
  query gcloud storage ls "${WORKDIR}/$(end_marker)" > /dev/null
}

# True when every worker runs a process of the job.
job_running() {
  local check
  check="pgrep -f '$(job_pattern)' > /dev/null"
  if ((DRY_RUN)); then ssh_workers all "${check}"; return; fi
  ssh_workers all "${check}" > /dev/null 2>&1
}

# The first launch again: the slice as it was created, the code, the data, the job.
recreate() {
  cmd_create
  cmd_setup
  cmd_run
}

cmd_supervise() {
  end_marker > /dev/null || die "supervise relaunches train or finetune (jobs that resume from" \
    "their workdir); start --job ${JOB} with run"
  [[ "${WORKDIR}" == gs://* ]] || die "supervise needs --workdir gs://BUCKET/PATH"
  load_kind
  if ((DRY_RUN)); then  # one check and the recovery round after a preemption
    job_finished || true
    slice_state
    cmd_delete
    recreate
    job_running || true
    return
  fi
  local checks=0 state
  while ((MAX_CHECKS == 0 || checks < MAX_CHECKS)); do
    checks=$((checks + 1))
    if job_finished; then
      echo "supervise: ${WORKDIR}/$(end_marker) exists; ${JOB} is done"
      return 0
    fi
    state="$(slice_state)"
    case "${state}" in
      READY)
        if ! job_running; then
          echo "supervise: a worker has no ${JOB} process; relaunching"
          cmd_run
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
      --job) JOB="$2"; shift 2 ;;
      --stage) STAGE+=("$2"); shift 2 ;;
      --allow-dirty) ALLOW_DIRTY=1; shift ;;
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
    create | setup | run | train | logs | status | delete | supervise) ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown subcommand ${subcommand}; one of create setup run train logs status delete supervise" ;;
  esac
  [[ "${JOB}" =~ ^[a-z_]+([.][a-z_]+)?$ ]] || die "--job ${JOB}: name a bertjax module, e.g. finetune or tools.bench"
  local source
  for source in "${STAGE[@]}"; do
    [[ "${source}" == gs://* ]] || die "--stage ${source}: name a gs:// object or prefix"
  done
  [[ -n "${NAME}" ]] || die "--name NAME (or \$TPU_NAME) is required"
  [[ -n "${ZONE}" ]] || die "--zone ZONE (or \$TPU_ZONE) is required"
  case "${subcommand}" in
    train) JOB=train; check_job_args ;;
    run | supervise) check_job_args ;;
  esac
  "cmd_${subcommand}"
}

exec 3>&1
main "$@"
