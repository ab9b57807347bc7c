# Sourced by setup.sh, quickstart.sh and tests/run.sh: the Python environment megarl lives in.
# An active venv or conda env, or PYTHON=/path/to/python, is used as it is. Otherwise the
# repository's own .venv: created on first use (python3 -m venv) and activated for the script.

megarl_use_venv() {
  if [ -n "${PYTHON:-}" ] || [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
    return 0
  fi
  local venv
  venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: no venv is active: creating $venv (python3 -m venv)"
    python3 -m venv "$venv" || { echo "setup: python3 -m venv failed (Debian/Ubuntu: apt install python3-venv)" >&2; return 1; }
  fi
  # shellcheck disable=SC1091
  source "$venv/bin/activate"
}

# The line a new shell needs before the `megarl` and `mlflow ui` commands work.
megarl_activate_line() {
  local py
  py="$(command -v "${PYTHON:-python3}")"
  if [ -f "$(dirname "$py")/activate" ]; then
    echo "source $(cd "$(dirname "$py")" && pwd)/activate"
  elif [ -n "${CONDA_PREFIX:-}" ]; then
    echo "conda activate $CONDA_PREFIX"
  else
    echo "(none: megarl is installed for $py)"
  fi
}
