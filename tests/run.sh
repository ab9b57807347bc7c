#!/usr/bin/env bash
# The README's test command: install (idempotent), then the whole suite on CPU.
# pytest exits non-zero when it collects nothing, so an empty run fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,dali}" launchers/local/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1
python3 -m pytest -q -ra --durations=15 "$@"
