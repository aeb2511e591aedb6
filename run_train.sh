#!/usr/bin/env bash
# Launch titanlab training on this machine with torchrun.
#
#   ./run_train.sh [CONFIG_FILE] [--section.key VALUE ...]
#
# NGPU          processes to start (default: the number of CUDA GPUs, or 2 CPU processes without one);
#               with --comm.mode fake_backend, the world size the one-process dry run simulates
# LOG_RANK      ranks whose output is shown (default 0; e.g. LOG_RANK=0,1)
# MAX_RESTARTS  times torchrun restarts the whole group after a rank fails (default 0); a restarted
#               group resumes from the newest complete checkpoint
# PYTHON        interpreter (default: .venv/bin/python when present, else python3)
#
# Preemption: SIGTERM or SIGUSR1 to this script makes every rank finish its step, save a
# checkpoint and stop; the script then exits with 75 (requeue) instead of torchrun's status.
set -uo pipefail
cd "$(dirname "$0")"

CONFIG_FILE=train_configs/debug_model.toml
if [[ $# -gt 0 && "$1" != --* ]]; then
    CONFIG_FILE=$1
    shift
fi
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python && -z "${VIRTUAL_ENV:-}" ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# One intra-op thread per process unless told otherwise: several threads per process on shared
# cores are many times slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# The value of SECTION.KEY: the last --SECTION.KEY on the command line, else the config file's.
config_value() {
    local option="--$1.$2" value previous="" arg
    value=$(awk -v section="[$1]" -v key="$2" '/^\[/ { current = $0 }
        current == section && $0 ~ "^[[:space:]]*" key "[[:space:]]*=" {
        sub(/#.*/, ""); sub(/^[^=]*=/, ""); gsub(/["'"'"'[:space:]]/, ""); print }' "$CONFIG_FILE" 2>/dev/null)
    shift 2
    for arg in "$@"; do
        [[ "$previous" == "$option" ]] && value=$arg
        [[ "$arg" == "$option="* ]] && value=${arg#"$option"=}
        previous=$arg
    done
    echo "$value"
}

# comm.mode "fake_backend" (a dry run at the real world size: NGPU, else the config's
# comm.fake_world_size) and "local_tensor" (a small world simulated with real numerics) run in
# this one process, without torchrun; the mode comes from the command line or the config file.
COMM_MODE=$(config_value comm mode "$@")
if [[ "$COMM_MODE" == fake_backend || "$COMM_MODE" == local_tensor ]]; then
    exec "$PYTHON" -m titanlab.train --job.config_file "$CONFIG_FILE" "$@"
fi
# fault_tolerance.enable: `titanlab train` starts torchft's lighthouse and one torchrun per
# replica group (titanlab/resilience/ft_launch.py), or, given a lighthouse, this one group.
if [[ "$(config_value fault_tolerance enable "$@")" == true ]]; then
    exec "$PYTHON" -m titanlab.cli train "$CONFIG_FILE" "$@"
fi

if [[ -z "${NGPU:-}" ]]; then
    NGPU=$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || true)
    [[ "${NGPU:-0}" -gt 0 ]] || NGPU=2
fi
LOG_RANK=${LOG_RANK:-0}

# Rank 0 writes this file when it stopped for preemption after saving.
export TITANLAB_PREEMPT_MARKER
TITANLAB_PREEMPT_MARKER=$(mktemp -u "${TMPDIR:-/tmp}/titanlab-preempt.XXXXXX")

# titanlab.launcher runs torchrun, keeps its traceback in <dump_folder>/logs/launcher-*.log and
# ends with the failing rank's one `titanlab: error:` line and exit code. With --preflight,
# torchrun's agent first runs the pre-flight check (titanlab.planning.agent): an invalid config,
# or one that cannot fit, fails in seconds with one line and nothing written.
"$PYTHON" -m titanlab.launcher --preflight \
    --nproc_per_node="$NGPU" --max-restarts="${MAX_RESTARTS:-0}" \
    --rdzv_backend=c10d --rdzv_endpoint="localhost:${MASTER_PORT:-0}" \
    --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    -m titanlab.train --job.config_file "$CONFIG_FILE" "$@" &
TORCHRUN=$!
# torchrun forwards SIGTERM to the ranks (it would die on SIGUSR1), so both become SIGTERM.
trap 'kill -TERM "$TORCHRUN" 2>/dev/null' TERM USR1
while true; do
    wait "$TORCHRUN"
    STATUS=$?
    kill -0 "$TORCHRUN" 2>/dev/null || break  # wait returned for a trapped signal: keep waiting
done
if [[ -f "$TITANLAB_PREEMPT_MARKER" ]]; then
    echo "run_train.sh: preempted after step $(cat "$TITANLAB_PREEMPT_MARKER"); exit 75 to requeue" >&2
    rm -f "$TITANLAB_PREEMPT_MARKER"
    exit 75
fi
exit "$STATUS"
