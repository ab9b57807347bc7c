"""megarl.tracking against a real `mlflow server` on 127.0.0.1 that is stopped and restarted:
down at start, killed mid-run, slow (accepts but never answers). Training-side calls must stay
fast and every metric must arrive once the server is back (directly or via the spill replay).

One server per module (startup costs ~10 s on 2 cores); it runs in its own process group so
that stopping it also stops the workers it forks, and it is always stopped at module teardown.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from dist_helpers import free_port  # noqa: E402
from megarl.tracking import Tracker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAST = dict(system_metrics_interval=None, retry_backoff=(0.1, 0.5), flush_timeout=30)


class MlflowServer:
    """`mlflow server` on a fixed port + SQLite backend, restartable with the same data."""

    def __init__(self, workdir, port: int, startup_timeout: float = 90.0):
        self.workdir, self.port, self.startup_timeout = workdir, port, startup_timeout
        self.uri = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        assert self.proc is None
        self._log = open(self.workdir / "server.log", "ab")
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")  # no huey workers
        env.pop("MLFLOW_TRACKING_URI", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.workdir / 'server.db'}",
             "--artifacts-destination", str(self.workdir / "artifacts"), "--workers", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        log = (self.workdir / "server.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"mlflow server did not come up within {self.startup_timeout}s:\n{log}")

    def stop(self, sig=signal.SIGKILL) -> None:
        """Kill the server's whole process group (it forks uvicorn workers)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        try:  # stragglers of the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = MlflowServer(tmp_path_factory.mktemp("mlflow_server"), free_port())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def running(server):
    """The shared server, (re)started if a previous test left it down."""
    if server.proc is None:
        server.start()
    return server


def history(uri, run_id, key):
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


FAST_CALL = 0.5  # s; generous for a loaded CI box, far below any HTTP timeout or retry


def timed_log(tracker, steps, key="train/loss"):
    """Log one metric per step; return the slowest call's duration."""
    slowest = 0.0
    for s in steps:
        t0 = time.perf_counter()
        tracker.log_metrics({key: float(s)}, step=s)
        slowest = max(slowest, time.perf_counter() - t0)
    return slowest


def test_logging_through_server(running, tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("optim:\n  lr: 0.1\n")
    t = Tracker.start(tmp_path / "run", {"optim": {"lr": 0.1}}, uri=running.uri, **FAST)
    timed_log(t, range(10))
    t.log_artifact(cfg)
    t.log_table([{"prompt": "p", "output": "o"}], "samples", step=9)
    assert t.close()
    client = MlflowClient(running.uri)
    run = client.get_run(t.run_id)
    assert run.data.params == {"optim.lr": "0.1"} and run.info.status == "FINISHED"
    assert history(running.uri, t.run_id, "train/loss") == [(s, float(s)) for s in range(10)]
    assert {a.path for a in client.list_artifacts(t.run_id)} >= {"config.yaml", "tables"}
    local = client.download_artifacts(t.run_id, "tables/samples/step_00000009.json", str(tmp_path))
    assert json.load(open(local))["data"] == [[9, "p", "o"]]


def test_server_down_at_start_and_through_close(running, tmp_path):
    """(1) A run whose server never came back spills at close and is replayed by the resumed
    job; (2) a run started while the server is down is created once it is up."""
    running.stop()
    a = Tracker.start(tmp_path / "a", {"x": 1}, uri=running.uri, **FAST)
    assert timed_log(a, range(5)) < FAST_CALL
    t0 = time.monotonic()
    assert a.close(timeout=1.0) is False and time.monotonic() - t0 < 5
    assert (tmp_path / "a" / "tracking_spill.jsonl").exists() and a.run_id is None

    b = Tracker.start(tmp_path / "b", {"y": 2}, uri=running.uri, **FAST)
    assert timed_log(b, range(5)) < FAST_CALL
    running.start()
    assert b.flush(60), "metrics logged while the server was down were not delivered"
    assert b.close()
    assert history(running.uri, b.run_id, "train/loss") == [(s, float(s)) for s in range(5)]
    assert MlflowClient(running.uri).get_run(b.run_id).data.params == {"y": "2"}

    a2 = Tracker.start(tmp_path / "a", {"x": 1}, uri=running.uri, **FAST)  # the requeued job
    timed_log(a2, range(5, 8))
    assert a2.close()
    assert history(running.uri, a2.run_id, "train/loss") == [(s, float(s)) for s in range(8)]
    assert not list((tmp_path / "a").glob("tracking_spill*"))


def test_server_killed_mid_run_then_back(running, tmp_path):
    t = Tracker.start(tmp_path / "run", uri=running.uri, **FAST)
    timed_log(t, range(10))
    assert t.flush(30)
    run_id = t.run_id
    running.stop()  # SIGKILL, like a crashed server
    assert timed_log(t, range(10, 30)) < FAST_CALL
    time.sleep(1.0)  # the delivery thread is now failing and backing off
    assert t.pending > 0
    running.start()
    assert t.flush(60)
    assert t.close()
    assert t.run_id == run_id
    assert history(running.uri, run_id, "train/loss") == [(s, float(s)) for s in range(30)]


def test_hanging_server_does_not_stall_training(tmp_path, monkeypatch):
    """A socket that accepts connections but never answers (a wedged server)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
        t = Tracker.start(tmp_path / "run", {"a": 1}, uri=uri, **FAST)
        assert timed_log(t, range(50)) < FAST_CALL
        t0 = time.monotonic()
        assert t.close(timeout=1.5) is False
        assert time.monotonic() - t0 < 5
    ops = (tmp_path / "run" / "tracking_spill.jsonl").read_text().splitlines()
    assert sum(json.loads(op)["op"] == "metrics" for op in ops) == 50
