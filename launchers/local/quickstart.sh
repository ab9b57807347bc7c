#!/usr/bin/env bash
# The README's main job: install, then SFT -> reward model on the synthetic arithmetic task with
# a tiny model. One process on CPU; set NPROC=2 (and parallel.tp=2 etc.) to use more.
#   launchers/local/quickstart.sh [key=value overrides for both stages]
set -euo pipefail
cd "$(dirname "$0")/../.."
launchers/local/setup.sh
NPROC="${NPROC:-1}"
RUN_DIR="${RUN_DIR:-runs/quickstart}"
if [ "$NPROC" = 1 ]; then launch=(megarl); else launch=(python3 -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m megarl.cli.main); fi
"${launch[@]}" sft --config configs/tiny_sft.yaml train.run_dir="$RUN_DIR" "$@"
"${launch[@]}" rm --config configs/tiny_rm.yaml train.run_dir="$RUN_DIR" "$@"
echo
echo "Done. Held-out figures are above; the runs are in $RUN_DIR (MLflow: mlflow ui --backend-store-uri sqlite:///$RUN_DIR/mlflow.db)."
echo "Plots and a summary: megarl report $RUN_DIR"
