#!/usr/bin/env bash
# The first command to run on a GPU machine: build megarl's CUDA kernels, run every `gpu`-marked
# test, then print the rollout table (tokens/s and the decode step against its HBM floor, decode
# steps eager / graph-safe / CUDA graphs) at the 1B shape (8, 64, 256 rows) and the 8B shape (TP 1;
# TP 2 too where two GPUs are).
#   launchers/gpu/first_check.sh            # from the repository root, in a Python env with a CUDA torch
# An offline machine: put the wheels it lacks (megatron-core, ...) in wheels/ first; they are
# installed from there without an index.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if compgen -G "wheels/*.whl" > /dev/null; then
    "$PY" -m pip install -q --no-index --find-links wheels wheels/*.whl
fi
# --no-deps: the environment's CUDA torch stays; --no-build-isolation: csrc/build.py sees it
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" -c "import torch, megarl.ops as o; print('torch', torch.__version__, '| GPU', torch.cuda.get_device_name(), '| kernels', o.kernel_backend())"
status=0
"$PY" -m pytest -q -m gpu tests || status=$?
"$PY" bench/bench_gpu_ops.py --decode --shape 1b --rows 8,64,256 --new-tokens 256 || status=$?
"$PY" bench/bench_gpu_ops.py --decode --shape 8b --rows 8,64,256 --new-tokens 128 || status=$?
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then  # the 8B shape at TP 2
    "$PY" -m torch.distributed.run --nproc-per-node 2 bench/bench_gpu_ops.py --decode --shape 8b \
        --rows 8,64,256 --new-tokens 128 || status=$?
fi
exit "$status"
