#!/usr/bin/env bash
# One srun task per rank (srun mode of job.sh): give the rank torchrun's environment, then
# become the trainer (`exec`, so SLURM's signals and the exit code go straight through).
# MASTER_ADDR/MASTER_PORT are exported by job.sh (first node of the allocation).
set -euo pipefail
export RANK=$SLURM_PROCID
export WORLD_SIZE=$SLURM_NTASKS
export LOCAL_RANK=$SLURM_LOCALID
export GROUP_RANK=$SLURM_NODEID
# SLURM_STEP_TASKS_PER_NODE looks like "4(x2),3": expand it and take this node's entry.
COUNTS=()
IFS=, read -r -a ITEMS <<< "${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}"
for ITEM in "${ITEMS[@]}"; do
    REPEAT=1
    [[ $ITEM == *"(x"* ]] && REPEAT=${ITEM#*(x} && REPEAT=${REPEAT%)}
    for ((I = 0; I < REPEAT; I++)); do COUNTS+=("${ITEM%%(*}"); done
done
export LOCAL_WORLD_SIZE=${COUNTS[$SLURM_NODEID]:-${COUNTS[0]}}
exec "$@"
