#!/usr/bin/env bash
# Run megarl on this machine with torchrun.
#
#   launchers/local/run.sh NPROC STAGE CONFIG [key=value ...]
#   launchers/local/run.sh 2 sft configs/tiny_sft.yaml train.run_dir=runs/sft optim.lr=1e-3
#   launchers/local/run.sh auto sft configs/tiny_sft.yaml     # auto: one rank per GPU (1 on CPU)
#   launchers/local/run.sh 2 -- python my_check.py            # any command, once per rank
#
# STAGE is sft, rm, rl, eval or pipeline. The command is checked once before any rank starts
# (`megarl validate` at world size NPROC): a mistake is one line and exit 2.
# Same rank environment as the SLURM launchers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).
# Ctrl-C / SIGTERM / SIGUSR1: the trainer checkpoints at its next step boundary and this exits
# 75; run the same command again (same train.run_dir) to resume. MEGARL_DEVICE=cpu selects
# gloo on CPU; MEGARL_TORCHRUN_ARGS adds torchrun options (e.g. "--log-dir logs/ranks --tee 3").
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launchers/lib.sh
source "$HERE/../lib.sh"

[ $# -ge 2 ] || megarl_die "usage: $0 NPROC STAGE CONFIG [key=value ...]  |  $0 NPROC -- COMMAND [ARGS ...]"
NPROC=$1
shift
[ "$NPROC" = auto ] && NPROC=$(megarl_nproc_per_node)
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
    megarl_die "NPROC must be a positive integer or 'auto', got '$NPROC'"
fi
megarl_build_cmd "$@"

# The stage command, checked once at this world size before torchrun starts: a config or input
# mistake is one line and exit 2 (under torchrun every rank would fail on it, and torchrun would
# add its own failure report and exit 1).
check_command() {
    local stage=$1 config=$2 arg value_next=0 overrides=()
    shift 2
    case "$stage" in
        sft | rm | rl | eval | pipeline) ;;
        *) megarl_die "unknown stage '$stage': expected sft, rm, rl, eval or pipeline (or -- COMMAND [ARGS ...])" ;;
    esac
    for arg in "$@"; do  # the overrides, not the stage's own options (eval --checkpoint DIR)
        if [ "$value_next" = 1 ]; then
            value_next=0
        elif [[ $arg == -* ]]; then
            [[ $arg == *=* ]] || value_next=1  # --checkpoint DIR (every such option takes a value)
        else
            overrides+=("$arg")
        fi
    done
    local n=$((${#MEGARL_CMD[@]} - $# - 3))  # MEGARL_CMD = megarl executable + STAGE --config CONFIG ARGS
    "${MEGARL_CMD[@]:0:n}" validate --config "$config" --world-size "$NPROC" --stage "$stage" \
        ${overrides[@]+"${overrides[@]}"} > /dev/null
}
[ "$1" = "--" ] || check_command "$@" || exit $?
read -r -a EXTRA <<< "${MEGARL_TORCHRUN_ARGS:-}"
read -r -a TORCHRUN <<< "$(megarl_torchrun)"
export MEGARL_REQUEUE_EXIT_CODE=$MEGARL_REQUEUE_EXIT
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

echo "[megarl] $NPROC ranks on $(hostname): ${MEGARL_CMD[*]}" >&2
# --standalone: private rendezvous on a free local port, so several runs can share a machine.
exec "${TORCHRUN[@]}" --standalone --nnodes=1 --nproc-per-node="$NPROC" "${EXTRA[@]}" \
    --no-python "${MEGARL_CMD[@]}"
