#!/usr/bin/env bash
# One srun task per node (torchrun mode of job.sh): this node's torchrun, which joins the c10d
# rendezvous hosted by node 0 and starts the node's ranks. `exec` so that signals from SLURM
# reach torchrun (launchers/torchrun.py) directly.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launchers/lib.sh
source "$HERE/../lib.sh"

NPROC=$(megarl_nproc_per_node)
NODE_RANK=${SLURM_NODEID:-0}
IS_HOST=false
[ "$NODE_RANK" = 0 ] && IS_HOST=true  # decided by SLURM, not by hostname matching
read -r -a EXTRA <<< "${MEGARL_TORCHRUN_ARGS:-}"  # e.g. "--log-dir logs/ranks --tee 3"
read -r -a TORCHRUN <<< "$(megarl_torchrun)"

echo "[megarl] node ${SLURMD_NODENAME:-$(hostname)} (node rank $NODE_RANK): $NPROC ranks"
exec "${TORCHRUN[@]}" \
    --nnodes="${MEGARL_NNODES:-${SLURM_JOB_NUM_NODES:-1}}" --nproc-per-node="$NPROC" \
    --rdzv-backend=c10d --rdzv-endpoint="$MEGARL_RDZV_ENDPOINT" --rdzv-id="$MEGARL_RDZV_ID" \
    --rdzv-conf="is_host=$IS_HOST,join_timeout=${MEGARL_RDZV_TIMEOUT:-900}" \
    --max-restarts="${MEGARL_MAX_RESTARTS:-0}" "${EXTRA[@]}" \
    --no-python "$@"
