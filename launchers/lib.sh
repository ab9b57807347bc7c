# shellcheck shell=bash disable=SC2034  # variables used by the scripts that source this
# Shared by launchers/local/run.sh and launchers/slurm/*.sh (sourced, not executed).
#
# The training command is given the same way everywhere:
#   STAGE CONFIG [key=value ...]    ->  megarl STAGE --config CONFIG key=value ...
#   -- COMMAND [ARGS ...]           ->  any command, run once per rank (tests, tools)

# Exit code by which a trainer says "pre-empted, checkpoint written, requeue me" (EX_TEMPFAIL).
MEGARL_REQUEUE_EXIT=75

megarl_die() { echo "megarl launcher: $*" >&2; exit 2; }

# Fill the array MEGARL_CMD from the launcher arguments (see the top of this file).
# $MEGARL_BIN overrides the megarl executable (e.g. "python -m megarl.cli.main").
megarl_build_cmd() {
    [ $# -ge 1 ] || megarl_die "missing command: STAGE CONFIG [key=value ...] or -- COMMAND [ARGS ...]"
    if [ "$1" = "--" ]; then
        shift
        [ $# -ge 1 ] || megarl_die "nothing after --"
        MEGARL_CMD=("$@")
        return
    fi
    [ $# -ge 2 ] || megarl_die "usage: STAGE CONFIG [key=value ...] (got: $*)"
    local stage=$1 config=$2 bin
    shift 2
    [ -f "$config" ] || echo "megarl launcher: note: no file $config in $(pwd); megarl looks among its shipped configs" >&2
    if [ -n "${MEGARL_BIN:-}" ]; then
        read -r -a bin <<< "$MEGARL_BIN"
    elif command -v megarl > /dev/null 2>&1; then
        bin=(megarl)
    else  # not installed as a console script: import the CLI directly
        bin=("${MEGARL_PYTHON:-python3}" -c 'import sys; from megarl.cli.main import main; sys.exit(main())')
    fi
    MEGARL_CMD=("${bin[@]}" "$stage" --config "$config" "$@")
}

# Ranks to start on this node: $MEGARL_NPROC_PER_NODE, else 1 for MEGARL_DEVICE=cpu, else the
# GPUs SLURM gave this node, else the GPUs nvidia-smi sees, else 1.
megarl_nproc_per_node() {
    if [ -n "${MEGARL_NPROC_PER_NODE:-}" ]; then
        echo "$MEGARL_NPROC_PER_NODE"
    elif [ "${MEGARL_DEVICE:-}" = cpu ]; then
        echo 1
    elif [ -n "${SLURM_GPUS_ON_NODE:-}" ] && [ "${SLURM_GPUS_ON_NODE}" -gt 0 ] 2> /dev/null; then
        echo "$SLURM_GPUS_ON_NODE"
    else
        local n
        n=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU' || true)
        if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
    fi
}

# The torchrun we launch with: torchrun.py exits with the workers' exit code (75 included),
# where plain torchrun always exits 1 when a worker fails.
megarl_torchrun() {
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    echo "${MEGARL_PYTHON:-python3}" "$here/torchrun.py"
}

