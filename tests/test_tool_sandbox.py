"""The python tool's sandbox (megarl/rollout/sandbox.py): every escape a hostile program tries
ends as an `error: ...` observation and no process outlives its call, for a caller that is this
test's user and, when that is root, for uid 65534 too (bwrap then runs in a user namespace).
Where the sandbox cannot start, enabling the python tool fails in one line before any role loads."""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time

import pytest

import sandbox_escapes
from megarl.rollout import sandbox
from megarl.rollout.tools import PythonTool, build_tools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
# tests that run the python tool skip only where bwrap is missing: CI installs it
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed "
                                 "(.ci/run and launchers/local/setup.sh install it)")
CALLERS = ["this user"] + (["uid 65534"] if os.geteuid() == 0 else [])
# what the uid-65534 caller needs of the checkout: the tool's modules (megarl.rollout stays a
# namespace package, so the engine and torch are not imported) and the escapes
TREE = ["megarl/__init__.py", "megarl/utils/__init__.py", "megarl/utils/imports.py", "megarl/rollout/sandbox.py",
        "megarl/rollout/tools.py"]


def _as_nobody(cmd, **kw):
    return subprocess.run(cmd, user=sandbox.NOBODY, group=sandbox.NOBODY, extra_groups=[],
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, capture_output=True, text=True, **kw)


def _runs_as_nobody(python: str) -> bool:
    try:
        return _as_nobody([python, "-c", "import json"], timeout=60).returncode == 0
    except OSError:  # not executable by 65534 (e.g. under a 0700 home)
        return False


def _observe_as_nobody() -> list[dict]:
    """The escapes run by a uid-65534 process, from a copy of the tool's modules it can read (the
    checkout or pytest's temp dir may sit under a 0700 home)."""
    python = next((p for p in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"])
                   if p and _runs_as_nobody(p)), None)
    if python is None:
        pytest.skip("no Python interpreter here can be run by uid 65534")
    work = tempfile.mkdtemp(prefix="megarl-sandbox-test-")
    try:
        for rel in TREE + ["tests/sandbox_escapes.py"]:
            os.makedirs(os.path.join(work, os.path.dirname(rel)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, rel), os.path.join(work, rel))
        for d, _, _ in os.walk(work):
            os.chmod(d, 0o755)
        out = _as_nobody([python, os.path.join(work, "tests", "sandbox_escapes.py"), work], cwd=work, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)
    finally:
        shutil.rmtree(work)


@pytest.fixture(scope="module", params=[pytest.param(c, marks=needs_bwrap) for c in CALLERS])
def observations(request):
    """{escape name: observation}, from one PythonTool per caller."""
    assert sandbox.unavailable() is None  # bwrap is installed: the sandbox must start
    rows = sandbox_escapes.observe(HERE) if request.param == "this user" else _observe_as_nobody()
    want_uid = os.getuid() if request.param == "this user" else sandbox.NOBODY
    assert {r["caller_uid"] for r in rows} == {want_uid}
    return {r["name"]: r for r in rows}


@pytest.mark.parametrize("name,status,needle", [e[:1] + e[2:] for e in sandbox_escapes.escapes(HERE)],
                         ids=[e[0] for e in sandbox_escapes.escapes(HERE)])
def test_escape_becomes_an_observation_and_leaves_no_process(observations, name, status, needle):
    r = observations[name]
    assert r["status"] == status and needle in r["text"], r
    assert r["survivors"] == [], f"{name}: processes {r['survivors']} outlived the call"
    assert r["seen"] == name.startswith("setsid child"), r  # the setsid'd child did run during the call
    assert not os.path.exists(os.path.join(HERE, "escaped"))


def test_survivor_check_finds_a_live_process():
    """The check above can fail: a process with the marker in its argv is found until it ends."""
    marker = "megarl-escape-control"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        deadline = time.monotonic() + 30
        while not sandbox_escapes.pids_with(marker) and time.monotonic() < deadline:  # until it has exec'd
            time.sleep(0.01)
        assert sandbox_escapes.pids_with(marker) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert sandbox_escapes.pids_with(marker) == []


@needs_bwrap
def test_fork_bomb_past_the_hook_is_contained():
    """Processes started past the audit hook meet RLIMIT_NPROC, and all of them end with the call."""
    marker = "megarl-escape-fork-bomb"
    tool = PythonTool(timeout_s=30.0, max_output_chars=200, memory_mb=256)  # it ends at the 64th process
    r = tool.call(sandbox_escapes.BYPASS + "for _ in range(200):\n    subprocess.Popen([sys.executable, '-I', '-S', "
                  f"'-c', 'import time; time.sleep(60)', {marker!r}])")
    assert r.status == "error" and "Resource temporarily unavailable" in r.text, r
    assert sandbox_escapes.pids_with(marker) == []


# ------------------------------------------------------------------ no sandbox: one line, no fallback


def _fake_bwrap(tmp_path, monkeypatch, script: str | None):
    """PATH with only a fake bwrap (or none): the sandbox's probe answers afresh."""
    if script is not None:
        path = tmp_path / "bwrap"
        path.write_text("#!/bin/sh\n" + script)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox.unavailable.cache_clear()


@pytest.mark.parametrize("script,needle", [
    (None, "bwrap is not on PATH: install it (apt-get install bubblewrap"),
    ('[ "$1" = --version ] && echo "bubblewrap 0.4.0" && exit 0\nexit 1\n', "needs bubblewrap >= 0.8"),
    ('[ "$1" = --version ] && echo "bubblewrap 0.8.0" && exit 0\n'
     'echo "bwrap: No permissions to create new namespace" >&2\nexit 1\n',
     "does not start here: bwrap: No permissions to create new namespace;"),
])
def test_no_sandbox_refuses_the_python_tool_in_one_line(tmp_path, monkeypatch, script, needle):
    from megarl.config import load_config
    from megarl.trainers.data_setup import preflight
    from megarl.trainers.pipeline import check_stages

    _fake_bwrap(tmp_path, monkeypatch, script)
    try:
        reason = sandbox.unavailable()
        assert needle in reason and "\n" not in reason
        with pytest.raises(ValueError) as e:
            PythonTool()
        assert str(e.value) == reason
        with pytest.raises(ValueError, match="sandbox"):
            build_tools(["calculator", "python"], python=True)
        assert build_tools(["calculator"])[0].call("6*7").text == "42>>"  # the calculator needs no sandbox
        cfg = load_config(None, ["rl.tools=[calculator, python]", "rl.python_tool=true",
                                 f"train.run_dir={tmp_path / 'run'}"])
        for stage in ("rl", "eval"):
            assert f"rl.tools has python: {reason}" in preflight(cfg, stage)
        assert not any("rl.tools" in e for e in preflight(load_config(None, ["rl.tools=[calculator]"]), "rl"))
        with pytest.raises(Exception, match="stage rl.*rl.tools has python: .*sandbox"):
            check_stages({"rl": cfg}, 1, ["rl"], where="pipeline.yaml")
    finally:
        sandbox.unavailable.cache_clear()
