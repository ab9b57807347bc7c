#!/usr/bin/env bash
# Install bubblewrap (`bwrap`), the sandbox of the python tool (rl.tools: [python]). Idempotent and
# non-interactive: apt-get as root, or through `sudo -n` (never a password prompt). Debian/Ubuntu
# only; elsewhere install bubblewrap >= 0.8 with the system's package manager. Exits 1, with the
# reason, when bwrap is still missing: setup.sh and .ci/run go on (only the python tool needs it).
set -euo pipefail

if command -v bwrap > /dev/null 2>&1; then
    echo "bubblewrap: $(bwrap --version) already installed"
    exit 0
fi
command -v apt-get > /dev/null 2>&1 || { echo "bubblewrap: no apt-get here; install bubblewrap (>= 0.8) with the system's package manager" >&2; exit 1; }
SUDO=
if [ "$(id -u)" -ne 0 ]; then
    sudo -n true 2> /dev/null || { echo "bubblewrap: not root and no passwordless sudo; run: sudo apt-get install bubblewrap" >&2; exit 1; }
    SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends bubblewrap
command -v bwrap > /dev/null 2>&1 || { echo "bubblewrap: installation incomplete (no bwrap on PATH)" >&2; exit 1; }
echo "bubblewrap: installed $(bwrap --version)"
