#!/usr/bin/env bash
# The README's main job: install, then SFT -> reward model -> GRPO on the synthetic arithmetic
# task with a tiny model (`megarl pipeline --config configs/tiny_pipeline.yaml`). One process on
# CPU; set NPROC=2 (and parallel.tp=2 etc.) to use more. Ends with the held-out figures.
#   launchers/local/quickstart.sh [key=value overrides, e.g. stages.rl.train.steps=20]
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=launchers/local/venv.sh
source launchers/local/venv.sh
megarl_use_venv  # no venv active: the repository's .venv, which setup.sh fills
launchers/local/setup.sh
# shellcheck source=launchers/lib.sh
source launchers/lib.sh
NPROC="${NPROC:-1}"
RUN_DIR="${RUN_DIR:-runs/quickstart}"
if [ "$NPROC" = 1 ]; then launch=(megarl); else launch=(python3 -m torch.distributed.run --standalone --nproc_per_node="$NPROC" -m megarl.cli.main); fi
"${launch[@]}" pipeline --config configs/tiny_pipeline.yaml train.run_dir="$RUN_DIR" "$@"
megarl report "$RUN_DIR" >/dev/null 2>&1 || echo "(megarl report $RUN_DIR could not write plots)"
echo
echo "Run directory: $RUN_DIR (sft/, reward_model/, rl/, logs/)"
echo "MLflow store:  mlflow ui --backend-store-uri sqlite:///$(cd "$RUN_DIR" && pwd)/mlflow.db"
echo "Plots:         $RUN_DIR/report/ (megarl report $RUN_DIR)"
echo "In a new shell, first: $(megarl_activate_line)"
