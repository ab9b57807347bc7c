#!/usr/bin/env bash
# Install megarl. Idempotent; run from anywhere. Into the active venv (or conda env, or
# PYTHON=/path/to/python); with none active, into the repository's own .venv, created here:
# `source .venv/bin/activate` then makes `megarl` available in a shell (launchers/local/venv.sh).
#   launchers/local/setup.sh            # runtime + test tools
#   EXTRAS=dev,dali launchers/local/setup.sh
# It also installs bubblewrap with apt where it can (launchers/local/bubblewrap.sh).
# torch is installed first and pinned (2.13.0 on Python 3.11, the release megatron-core 0.16
# supports) so that resolving megatron-core never swaps a local CPU build for the multi-GB CUDA
# wheel. On a CPU machine without a local wheel, add --index-url https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=launchers/local/venv.sh
source launchers/local/venv.sh
megarl_use_venv
EXTRAS="${EXTRAS:-dev}"
PY="${PYTHON:-python3}"
echo "setup: installing megarl[${EXTRAS}] for $(command -v "$PY") (torch first, then megatron-core, mlflow, ...)"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then
    "$PY" -m pip install -q "torch==2.13.0"
  else
    "$PY" -m pip install -q "torch>=2.6"
  fi
fi
launchers/local/bubblewrap.sh || echo "setup: without bubblewrap the python tool (rl.python_tool) is refused; the rest of megarl works"
# No build isolation: csrc/build.py needs the installed (CUDA) torch to build the kernels.
"$PY" -m pip install -q --no-build-isolation -e ".[${EXTRAS}]"
"$PY" -W ignore -c "import megarl, megatron.core, torch; print(f'megarl {megarl.__version__} | torch {torch.__version__} | megatron-core {megatron.core.__version__}')"
