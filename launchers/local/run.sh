#!/usr/bin/env bash
# Run megarl on this machine with torchrun.
#
#   launchers/local/run.sh NPROC STAGE CONFIG [key=value ...]
#   launchers/local/run.sh 2 train configs/tiny_lm.yaml train.run_dir=runs/tiny optim.lr=1e-3
#   launchers/local/run.sh auto sft configs/sft.yaml          # auto: one rank per GPU (1 on CPU)
#   launchers/local/run.sh 2 -- python my_script.py           # any command, once per rank
#
# Same rank environment as the SLURM launchers (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...).
# Ctrl-C / SIGTERM / SIGUSR1: the trainer checkpoints at its next step boundary and this exits
# 75; run the same command again (same train.run_dir) to resume. MEGARL_DEVICE=cpu selects
# gloo on CPU; MEGARL_TORCHRUN_ARGS adds torchrun options (e.g. "--log-dir logs/ranks --tee 3").
# CPU runs get GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (MEGARL_CPU_MALLOC=default: not).
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
megarl_cpu_allocator_env  # CPU runs: huge-page-backed malloc for the big per-step tensors (lib.sh)
read -r -a EXTRA <<< "${MEGARL_TORCHRUN_ARGS:-}"
read -r -a TORCHRUN <<< "$(megarl_torchrun)"
export MEGARL_REQUEUE_EXIT_CODE=$MEGARL_REQUEUE_EXIT
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

echo "[megarl] $NPROC ranks on $(hostname): ${MEGARL_CMD[*]}" >&2
# --standalone: private rendezvous on a free local port, so several runs can share a machine.
exec "${TORCHRUN[@]}" --standalone --nnodes=1 --nproc-per-node="$NPROC" "${EXTRA[@]}" \
    --no-python "${MEGARL_CMD[@]}"
