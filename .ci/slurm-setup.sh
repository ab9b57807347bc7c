#!/usr/bin/env bash
# Install what tests/test_slurm.py needs to bring up a local two-node SLURM cluster:
# slurm-wlm (slurmctld, slurmd, client commands) and munge. Idempotent, non-interactive.
# Debian/Ubuntu (apt) only; elsewhere install the equivalents and the tests find them on PATH.
set -euo pipefail

have_all() {
    local b
    for b in munged slurmctld slurmd sbatch srun scontrol squeue sinfo scancel; do
        command -v "$b" > /dev/null 2>&1 || return 1
    done
    [ -f /etc/munge/munge.key ]
}

if have_all; then
    echo "slurm-setup: slurm-wlm and munge already installed ($(slurmctld -V 2> /dev/null || true))"
    exit 0
fi
command -v apt-get > /dev/null 2>&1 || { echo "slurm-setup: no apt-get; install slurm-wlm and munge manually" >&2; exit 1; }
SUDO=
[ "$(id -u)" -eq 0 ] || SUDO=sudo

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge

# The munge package normally creates the key in its postinst; make sure one exists.
if [ ! -f /etc/munge/munge.key ]; then
    if command -v mungekey > /dev/null 2>&1; then
        $SUDO mungekey --create --keyfile=/etc/munge/munge.key
    else
        $SUDO dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    $SUDO chown munge:munge /etc/munge/munge.key
    $SUDO chmod 0400 /etc/munge/munge.key
fi
have_all || { echo "slurm-setup: installation incomplete" >&2; exit 1; }
echo "slurm-setup: installed $(slurmctld -V)"
