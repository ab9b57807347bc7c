#!/usr/bin/env bash
# The README's test command: install (idempotent), then the whole suite on CPU, in the active
# venv or, with none active, in the repository's .venv (created by setup.sh on first use).
# pytest exits non-zero when it collects nothing, so an empty run fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launchers/local/venv.sh
source launchers/local/venv.sh
megarl_use_venv
EXTRAS="${EXTRAS:-dev,dali}" launchers/local/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1
"${PYTHON:-python3}" -m pytest -q -ra --durations=15 "$@"
