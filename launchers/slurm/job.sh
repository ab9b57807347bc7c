#!/usr/bin/env bash
# Body of every megarl SLURM job (the .sbatch files exec it; it also works inside salloc).
#
#   job.sh STAGE CONFIG [key=value ...]     megarl STAGE --config CONFIG key=value ...
#   job.sh -- COMMAND [ARGS ...]            any command, once per rank
#
# Launch modes ($MEGARL_LAUNCHER):
#   torchrun (default)  srun starts ONE task per node; each runs torchrun (launchers/torchrun.py)
#                       for that node's ranks, all meeting in a c10d rendezvous hosted on the
#                       first node. Ranks get exactly the environment they get from
#                       launchers/local/run.sh, so a run behaves the same on a laptop, one node
#                       or many; torchrun also supervises the ranks (MEGARL_MAX_RESTARTS>0 restarts
#                       crashed workers in place, without going back through the queue).
#   srun                srun starts one task per rank (submit with --ntasks-per-node=<GPUs>);
#                       launchers/slurm/task.sh maps SLURM_PROCID/NTASKS/LOCALID to
#                       RANK/WORLD_SIZE/LOCAL_RANK. No torchrun in between: useful where
#                       site tooling (CPU/GPU binding, profilers) expects one srun task per GPU.
#
# Pre-emption and requeue: `#SBATCH --signal=B:USR1@120` makes SLURM send SIGUSR1 to this script
# 120 s before the time limit (or on a site's pre-emption warning). The trap below forwards it
# to the srun step, i.e. to every rank (and torchrun); the trainer checkpoints at its next step
# boundary and exits 75. Then this script runs `scontrol requeue` (only while the job is still
# RUNNING: never for a job that was cancelled or that SLURM itself is already requeuing), and the
# requeued job, running the same command with the same train.run_dir, resumes from the latest
# checkpoint. Cancel/requeue/pre-emption by SLURM itself sends SIGTERM to every process of the
# job directly; the trainer treats it the same way, and SLURM requeues (`--requeue`) by itself.
set -uo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launchers/lib.sh
source "$HERE/../lib.sh"

[ -n "${SLURM_JOB_ID:-}" ] || megarl_die "job.sh must run inside a SLURM allocation (sbatch/salloc)"
megarl_build_cmd "$@"

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
MODE=${MEGARL_LAUNCHER:-torchrun}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The address slurmctld itself uses to reach the head node; no DNS assumption about node names.
HEAD_ADDR=${MEGARL_RDZV_HOST:-$(scontrol show node "$HEAD_NODE" 2> /dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' | head -n 1)}
HEAD_ADDR=${HEAD_ADDR:-$HEAD_NODE}
RDZV_PORT=${MEGARL_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export MEGARL_RDZV_ENDPOINT="$HEAD_ADDR:$RDZV_PORT"
export MEGARL_RDZV_ID="megarl-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
export MEGARL_REQUEUE_EXIT_CODE=$MEGARL_REQUEUE_EXIT
export MEGARL_NNODES=$NNODES
# Megatron's tensor-parallel communication overlap needs kernels queued in issue order.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

echo "[megarl] job ${SLURM_JOB_ID} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}" \
    "(${NNODES} nodes), launcher=${MODE}, rendezvous ${MEGARL_RDZV_ENDPOINT}, $(date -Is)"
echo "[megarl] command: ${MEGARL_CMD[*]}"

case "$MODE" in
    torchrun)
        srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 \
            bash "$HERE/node.sh" "${MEGARL_CMD[@]}" &
        ;;
    srun)
        export MASTER_ADDR=$HEAD_ADDR MASTER_PORT=$RDZV_PORT
        srun --kill-on-bad-exit=0 bash "$HERE/task.sh" "${MEGARL_CMD[@]}" &
        ;;
    *) megarl_die "MEGARL_LAUNCHER must be torchrun or srun, got '$MODE'" ;;
esac
SRUN_PID=$!

WARNED=0
# shellcheck disable=SC2317  # invoked by the traps below
forward_warning() {  # SLURM's B:USR1 reaches only this shell: pass it on to every rank
    WARNED=1
    echo "[megarl] got SIG$1 at $(date -Is); forwarding to the job step (checkpoint + exit $MEGARL_REQUEUE_EXIT)"
    kill -s "$1" "$SRUN_PID" 2> /dev/null || true
}
trap 'forward_warning USR1' USR1
trap 'forward_warning USR2' USR2
# SIGTERM comes from SLURM ending the job (cancel, requeue, pre-emption, time limit); SLURM
# signals every process of the step itself, so only remember it.
trap 'WARNED=1; echo "[megarl] got SIGTERM at $(date -Is)"' TERM

# `wait` returns early (status > 128) whenever a trapped signal arrives: wait until srun is gone.
while :; do
    wait "$SRUN_PID"
    RC=$?
    kill -0 "$SRUN_PID" 2> /dev/null && continue
    if [ "$RC" -gt 128 ]; then  # cut short by a trap just as srun exited: fetch its real status
        wait "$SRUN_PID" 2> /dev/null
        R2=$?
        [ "$R2" -ne 127 ] && RC=$R2
    fi
    break
done

job_state() { scontrol show job "$SLURM_JOB_ID" 2> /dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' | head -n 1; }

if [ "$RC" -eq "$MEGARL_REQUEUE_EXIT" ] || { [ "$WARNED" = 1 ] && [ "$RC" -ne 0 ]; }; then
    STATE=$(job_state)
    echo "[megarl] training exited $RC (pre-empted); job state ${STATE:-unknown}"
    if [ "$STATE" = RUNNING ] && [ "${MEGARL_REQUEUE:-1}" = 1 ]; then
        echo "[megarl] requeueing job $SLURM_JOB_ID; it resumes from the latest checkpoint"
        if scontrol requeue "$SLURM_JOB_ID"; then
            # Let SLURM end this instance: exiting first races the requeue, and the job can then be
            # recorded as finished instead of going back to the queue. Bounded: 120 s at most.
            for _ in $(seq 240); do
                [ "$(job_state)" = RUNNING ] || break
                sleep 0.5
            done
        else
            echo "[megarl] scontrol requeue failed: resubmit the same command to resume" >&2
        fi
    fi
    exit "$MEGARL_REQUEUE_EXIT"
fi
echo "[megarl] training exited $RC at $(date -Is)"
exit "$RC"
