"""megarl as a user installs it: a wheel built from the repository, installed into a fresh venv,
runs `megarl sft` from a directory outside the repository with a shipped config. And the
development install (`pip install --no-build-isolation -e .[dev]`, as launchers/local/setup.sh
runs it) resolves every dependency from what is installed, so it never reinstalls torch.

The venvs see the site-packages of the environment running the tests, whatever its base
interpreter holds (torch, megatron-core, mlflow are not downloaded again; pip runs with
--no-index, so anything missing fails the test instead of downloading), and each test checks
that `megarl` is imported from the venv, not from the repository's editable install.
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megarl_run import TINY

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for k in ("PYTHONPATH", "RANK", "WORLD_SIZE", "VIRTUAL_ENV", "MLFLOW_TRACKING_URI"):
        env.pop(k, None)
    return env


def _run(cmd, cwd, timeout=300) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _venv(path: Path) -> Path:
    """A venv that sees this environment's site-packages, after its own. `--system-site-packages`
    would show the base interpreter's instead: where torch lives only in the venv running the
    tests (a fresh machine, CI), pip then found neither safetensors nor wheel. The directories
    are added by a .pth file as plain paths, so their own .pth files (the repository's editable
    megarl) are not. No pip of its own: ensurepip's old setuptools would shadow this env's and
    fail torch's requirement on it; this env's pip installs into the venv it is run from."""
    _run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    own = _run([python, "-c", "import site; print(site.getsitepackages()[0])"], cwd=path.parent).stdout.split()[-1]
    Path(own, "_megarl_test_parent_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _imported_from(python: Path, module: str, cwd: Path) -> Path:
    out = _run([python, "-c", f"import {module}; print({module}.__file__)"], cwd=cwd)
    return Path(out.stdout.strip().splitlines()[-1]).resolve()


def _repo_modules() -> set[str]:
    return {str(p.relative_to(REPO)) for p in (REPO / "megarl").rglob("*.py") if "__pycache__" not in p.parts}


def test_wheel_installs_and_trains_outside_the_repo(tmp_path):
    # Built from a clean copy of the tree: an in-tree build/ would keep (and ship) deleted modules.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "mlruns", "logs", ".venv"))
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, src],
         cwd=tmp_path)
    (wheel,) = wheels.glob("megarl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every module of the source tree is in the wheel (a package without __init__.py would be
    # skipped), the quickstart's configs are package data, and no test code is shipped.
    missing = sorted(_repo_modules() - names)
    assert not missing, f"modules missing from the wheel: {missing}"
    for cfg in ("base.yaml", "tiny_sft.yaml", "tiny_rm.yaml"):
        assert f"megarl/configs/{cfg}" in names
    assert not [n for n in names if n.startswith("tests/") or n.endswith("/testing.py")]
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    metadata = zipfile.ZipFile(wheel).read(meta).decode()
    assert "Requires-Dist: torch==2.13.0; python_version < \"3.12\"" in metadata
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "megarl = megarl.cli.main:main" in zipfile.ZipFile(wheel).read(entry).decode()

    python = _venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "--no-index", wheel], cwd=tmp_path)
    work = tmp_path / "user"  # a user's directory: no configs/ here, nothing of the repository
    work.mkdir()
    site = _imported_from(python, "megarl", work)
    assert (tmp_path / "venv") in site.parents and REPO not in site.parents, site

    megarl = tmp_path / "venv" / "bin" / "megarl"
    out = _run([megarl, "sft", "--config", "configs/tiny_sft.yaml", "train.run_dir=run", "train.steps=2",
                "train.eval_interval=0", "checkpoint.save_interval=2", *TINY], cwd=work)
    stage = work / "run" / "sft"
    with open(stage / "metrics.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if "train/loss" in r]
    assert steps == [1, 2], out.stderr[-2000:]
    assert (stage / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert (stage / "config.yaml").is_file() and "resolved config: " + str(stage / "config.yaml") in out.stderr + out.stdout


def test_editable_dev_install_uses_the_installed_torch(tmp_path):
    python = _venv(tmp_path / "venv")
    out = _run([python, "-m", "pip", "install", "--no-index", "--no-build-isolation", "-e", f"{REPO}[dev]"],
               cwd=tmp_path)
    assert "torch" not in out.stdout.split("Successfully installed")[-1]
    assert REPO in _imported_from(python, "megarl", tmp_path).parents
    torch_at = _imported_from(python, "torch", tmp_path)
    assert (tmp_path / "venv") not in torch_at.parents, f"torch was reinstalled into the venv: {torch_at}"


def test_config_names_resolve_to_the_shipped_recipes(tmp_path, monkeypatch):
    """`--config configs/x.yaml` / `x.yaml` / `x` find the recipe shipped in megarl/configs when
    no such file exists; a local file always wins; an unknown name is reported with the list."""
    from megarl.config import ConfigError, load_config
    from megarl.config.shipped import SHIPPED_DIR, resolve_config_path, shipped_configs

    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(SHIPPED_DIR, "tiny_sft.yaml")
    assert {"base.yaml", "tiny_sft.yaml", "tiny_rm.yaml"} <= set(shipped_configs())
    for name in ("configs/tiny_sft.yaml", "tiny_sft.yaml", "tiny_sft"):
        assert resolve_config_path(name) == shipped
    assert load_config("tiny_sft").train.steps == load_config(shipped).train.steps == 600
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny_sft.yaml").write_text("train: {steps: 7}\n")
    assert resolve_config_path("configs/tiny_sft.yaml") == "configs/tiny_sft.yaml"
    assert load_config("configs/tiny_sft.yaml").train.steps == 7  # the user's file, not the shipped one
    assert resolve_config_path("other/tiny_sft.yaml") == "other/tiny_sft.yaml"  # a path is a path
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found \(shipped configs: base.yaml, .*tiny_sft.yaml"):
        load_config("nope.yaml")


def test_setup_without_a_venv_makes_and_names_the_repos_own(tmp_path):
    """launchers/local/venv.sh, which setup.sh, quickstart.sh and tests/run.sh source: with no
    venv active, the clone's .venv is created once and used, and the quickstart's last line
    names the `source` command that a new shell needs for `megarl` and `mlflow ui`."""
    (tmp_path / "launchers" / "local").mkdir(parents=True)
    shutil.copy(REPO / "launchers" / "local" / "venv.sh", tmp_path / "launchers" / "local" / "venv.sh")
    env = _env()
    for k in ("CONDA_PREFIX", "PYTHON"):
        env.pop(k, None)
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not Path(p, "activate").is_file())
    script = ("source launchers/local/venv.sh && megarl_use_venv && megarl_activate_line && "
              "python3 -c 'import sys; print(sys.prefix)'")
    runs = [subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    venv = tmp_path / ".venv"
    for out in runs:
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[-3:] == [f"source {venv}/bin/activate", str(venv), ""], out.stdout
    assert f"creating {venv}" in runs[0].stdout and "creating" not in runs[1].stdout
