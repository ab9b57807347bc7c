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

# True for a CPU run: MEGARL_DEVICE=cpu, or MEGARL_DEVICE unset and no GPU visible.
megarl_is_cpu_run() {
    case "${MEGARL_DEVICE:-}" in
        cpu) return 0 ;;
        "") ! nvidia-smi -L 2> /dev/null | grep -q '^GPU' ;;
        *) return 1 ;;
    esac
}

# CPU runs only: make glibc malloc back its large blocks with transparent huge pages.
# Every step allocates and frees tensors of 100+ MiB (logits and their gradients: 125 MiB at
# 8x128 tokens x 32000 vocab, fp32). glibc serves blocks above 32 MiB (its largest mmap
# threshold) with fresh mmaps, so each new one is first-touched again: one page fault per
# 4 KiB page, 35-45 ms per 125 MiB. glibc.malloc.hugetlb=1 (glibc >= 2.35) madvises those
# mappings as huge pages: 2 MiB pages, 512x fewer faults (see "Step speed" in docs/benchmarks.md
# for the measured effect). Ignored by older glibc and where THP is "never"; the user's own
# GLIBC_TUNABLES malloc settings win; MEGARL_CPU_MALLOC=default leaves the allocator alone.
megarl_cpu_allocator_env() {
    [ "${MEGARL_CPU_MALLOC:-hugetlb}" = default ] && return 0
    [ "${MEGARL_CPU_MALLOC:-hugetlb}" = hugetlb ] || megarl_die "MEGARL_CPU_MALLOC must be hugetlb or default, got '${MEGARL_CPU_MALLOC}'"
    megarl_is_cpu_run || return 0
    case "${GLIBC_TUNABLES:-}" in
        *glibc.malloc.hugetlb=*) ;;
        "") export GLIBC_TUNABLES=glibc.malloc.hugetlb=1 ;;
        *) export GLIBC_TUNABLES="${GLIBC_TUNABLES}:glibc.malloc.hugetlb=1" ;;
    esac
}
