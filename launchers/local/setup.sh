#!/usr/bin/env bash
# Install megarl into the current Python (a venv is up to you). Idempotent; run from anywhere.
#   launchers/local/setup.sh            # runtime + test tools
#   EXTRAS=dev,dali launchers/local/setup.sh
# torch is installed first and pinned (2.13.0 on Python 3.11, the release megatron-core 0.16
# supports) so that resolving megatron-core never swaps a local CPU build for the multi-GB CUDA
# wheel. On a CPU machine without a local wheel, add --index-url https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
EXTRAS="${EXTRAS:-dev}"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if "$PY" -c "import sys; sys.exit(sys.version_info >= (3, 12))"; then
    "$PY" -m pip install -q "torch==2.13.0"
  else
    "$PY" -m pip install -q "torch>=2.6"
  fi
fi
# No build isolation: csrc/build.py needs the installed (CUDA) torch to build the kernels.
"$PY" -m pip install -q --no-build-isolation -e ".[${EXTRAS}]"
"$PY" -W ignore -c "import megarl, megatron.core, torch; print(f'megarl {megarl.__version__} | torch {torch.__version__} | megatron-core {megatron.core.__version__}')"
