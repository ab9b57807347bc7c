"""megarl.tracking against the embedded (SQLite) store: logging, resume, nesting, spill/replay,
params flattening, NullTracker parity and the offline report.

Server-backed behaviour (a real `mlflow server` going down and coming back) is in
test_tracking_server.py. Creating a SQLite store costs MLflow a few seconds (schema migrations),
so most tests share one module-level database and pass its URI explicitly.
"""
import dataclasses
import inspect
import json
import logging
import math
import time

import pytest

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from dist_helpers import free_port  # noqa: E402
from megarl.tracking import (  # noqa: E402
    NullTracker, Tracker, create_tracker, flatten_params, replay_spill, write_report,
)
from megarl.tracking.params import MAX_PARAM_VALUE_LEN, TRUNCATION_MARK, metric_value, sanitize_key  # noqa: E402

pytestmark = pytest.mark.timeout(120)

FAST = dict(system_metrics_interval=None, retry_backoff=(0.05, 0.2), flush_timeout=30)


@pytest.fixture(scope="module")
def store_uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


def history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


# ------------------------------------------------------------------ params and keys
@dataclasses.dataclass
class _Optim:
    lr: float = 1e-4
    betas: tuple = (0.9, 0.95)


def test_flatten_params_nested_dataclass_lists_and_limits():
    cfg = {
        "optim": _Optim(),
        "model": {"num_layers": 2, "rope": {"theta": 10000.0}, "empty": {}},
        "data": {"sources": [{"path": "a.jsonl", "weight": 0.7}, {"path": "b.jsonl", "weight": 0.3}]},
        "train": {"run_dir": "runs/x", "resume": None, "flag": True},
        "bad key!": {"x@y": 1},
        "long": "v" * (MAX_PARAM_VALUE_LEN + 100),
    }
    flat = flatten_params(cfg)
    assert flat["optim.lr"] == "0.0001"
    assert flat["optim.betas"] == "[0.9, 0.95]"
    assert flat["model.rope.theta"] == "10000.0"
    assert flat["model.empty"] == "{}"
    assert flat["data.sources.1.path"] == "b.jsonl"
    assert flat["train.resume"] == "None" and flat["train.flag"] == "True"
    assert flat["bad key_.x_y"] == "1"
    assert len(flat["long"]) == MAX_PARAM_VALUE_LEN and flat["long"].endswith(TRUNCATION_MARK)


def test_sanitize_key_and_metric_value():
    import numpy as np
    import torch

    assert sanitize_key("train/loss") == "train/loss"
    assert sanitize_key("a//b/./c/") == "a/b/c"
    assert sanitize_key("eval@step#1") == "eval_step_1"
    assert len(sanitize_key("k" * 400)) == 250
    assert metric_value(torch.tensor(2.5)) == 2.5 and metric_value(np.float32(1.5)) == 1.5
    assert metric_value("abc") is None and metric_value(None) is None
    assert metric_value(float("inf")) > 1e300 and math.isnan(metric_value(float("nan")))


# ------------------------------------------------------------------ embedded store
def test_default_store_is_inside_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("optim:\n  lr: 0.001\n")
    t = Tracker.start(run_dir, {"optim": {"lr": 1e-3}}, run_name="tiny",
                      **{**FAST, "system_metrics_interval": 0.2})
    assert t.uri == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    for step in range(5):
        t.log_metrics({"train/loss": 1.0 / (step + 1), "train/lr": 1e-3, "junk": "x"}, step=step)
    t.log_artifact(cfg_file)
    t.log_table([{"prompt": "1+1=", "output": "2"}, {"prompt": "hi", "output": "hello", "reward": 0.5}],
                "eval_samples", step=4)
    t.log_checkpoint(run_dir / "checkpoints" / "step_4", 4)
    assert t.flush(60)  # the store exists (a plain client opened while the Tracker creates it would race it)
    client = MlflowClient(t.uri)
    deadline = time.monotonic() + 30  # the system sampler (every 0.2 s) must have reported
    while time.monotonic() < deadline:
        if t.flush(10) and "system/cpu_rss_gib" in client.get_run(t.run_id).data.metrics:
            break
        time.sleep(0.2)
    assert t.close() is True

    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert run.data.params == {"optim.lr": "0.001"}
    assert history(client, t.run_id, "train/loss") == [(s, 1.0 / (s + 1)) for s in range(5)]
    assert "junk" not in run.data.metrics
    assert "system/cpu_rss_gib" in run.data.metrics
    assert run.data.tags["checkpoint.latest"].endswith("checkpoints/step_4")
    assert run.data.tags["checkpoint.latest_step"] == "4"
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == t.run_id
    # artifacts live in the run dir, the table is in MLflow's table format and registered
    art_root = run_dir / "mlartifacts"
    assert list(art_root.rglob("config.yaml"))
    table_file = next(art_root.rglob("step_00000004.json"))
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "output", "reward"]
    assert table["data"][1] == [4, "hi", "hello", 0.5]
    assert "tables/eval_samples/step_00000004.json" in run.data.tags["mlflow.loggedArtifacts"]


def test_env_uri_overrides_default(tmp_path, monkeypatch, store_uri):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store_uri)
    t = Tracker.start(tmp_path / "run", **FAST)
    assert t.uri == store_uri
    t.log_metrics({"x": 1.0}, step=0)
    assert t.close()
    assert not (tmp_path / "run" / "mlflow.db").exists()
    assert MlflowClient(store_uri).get_run(t.run_id).data.metrics["x"] == 1.0


def test_resume_continues_same_run_and_keeps_changed_params(tmp_path, store_uri):
    run_dir = tmp_path / "run"
    t1 = Tracker.start(run_dir, {"optim": {"lr": 0.1}, "seed": 1}, uri=store_uri, **FAST)
    for s in range(3):
        t1.log_metrics({"train/loss": float(s)}, step=s)
    assert t1.close("KILLED")  # pre-empted
    t2 = Tracker.start(run_dir, {"optim": {"lr": 0.05}, "seed": 1, "new": "x"}, uri=store_uri, **FAST)
    for s in range(3, 6):
        t2.log_metrics({"train/loss": float(s)}, step=s)
    assert t2.close()
    assert t2.run_id == t1.run_id
    client = MlflowClient(store_uri)
    run = client.get_run(t1.run_id)
    assert run.info.status == "FINISHED"
    assert history(client, t1.run_id, "train/loss") == [(s, float(s)) for s in range(6)]
    assert run.data.params["optim.lr"] == "0.1" and run.data.params["new"] == "x"
    assert json.loads(run.data.tags["megarl.changed_params"]) == {"optim.lr": ["0.1", "0.05"]}


def test_backfill_logs_only_the_points_the_run_lacks(tmp_path, store_uri):
    """A killed process delivered steps 1-2 of `a` and nothing of `b`; metrics.jsonl holds 1-4.
    The resumed tracker logs what is missing, once, and later steps as usual."""
    from megarl.tracking.delivery import missing_points, read_points

    run_dir = tmp_path / "run"
    t1 = Tracker.start(run_dir, uri=store_uri, **FAST)
    for s in (1, 2):
        t1.log_metrics({"a": float(s)}, step=s)
    assert t1.close("KILLED")
    lines = [{"step": s, "a": float(s), "b/x": 10.0 + s, "note": "text"} for s in range(1, 5)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 5, "a"')
    assert read_points(run_dir / "metrics.jsonl", 3) == {"a": {1: 1.0, 2: 2.0, 3: 3.0}, "b/x": {1: 11.0, 2: 12.0, 3: 13.0}}
    assert missing_points({"a": {1: 1.0, 2: 2.0}, "b": {2: 5.0}}, {"a": {1}}) == [("a", 2, 2.0), ("b", 2, 5.0)]
    for _ in range(2):  # a second resume backfills nothing more
        t2 = Tracker.start(run_dir, uri=store_uri, **FAST)
        t2.backfill(run_dir / "metrics.jsonl", 4)
        t2.log_metrics({"a": 4.5, "b/x": 14.5}, step=4)  # a step the file already holds: kept as it is
        t2.log_metrics({"a": 5.0}, step=5)
        assert t2.close()
    client = MlflowClient(store_uri)
    assert history(client, t1.run_id, "a") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    assert history(client, t1.run_id, "b/x") == [(s, 10.0 + s) for s in range(1, 5)]


@pytest.mark.slow
def test_sigkilled_runs_resumed_leave_every_metrics_jsonl_point_in_mlflow_once(tmp_path):
    """A real SFT run (embedded store) SIGKILLed at three random steps, then resumed to the end:
    MLflow holds each (key, step) of metrics.jsonl exactly once, nothing else, and the values
    of every figure but the wall-clock ones (perf/) equal the file's."""
    import os
    import random
    import signal
    import subprocess

    from megarl_run import TINY, command, env, metrics

    run = tmp_path / "run"
    total = 16
    args = ["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={run}", *TINY, "tracking.backend=mlflow",
            f"train.steps={total}", "train.eval_interval=5", "sft.eval_samples=0", "checkpoint.save_interval=3"]
    rng = random.Random(os.environ.get("PYTEST_SEED", 60))
    for target in sorted(rng.sample(range(2, total), 3)):
        proc = subprocess.Popen(command(args), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        path = run / "sft" / "metrics.jsonl"
        while not (path.exists() and any(m.get("step", 0) >= target for m in metrics(run / "sft"))):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.3))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    done = subprocess.run(command(args), env=env(), capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]

    want: dict = {}
    for record in metrics(run / "sft", wall_clock=True):
        for k, v in record.items():
            if k != "step":
                want.setdefault(sanitize_key(k), []).append((record["step"], float(v)))
    assert [s for s, _ in want["train/loss"]] == list(range(1, total + 1))
    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    run_id = json.loads((run / "sft" / "tracking.json").read_text())["run_id"]
    for key, points in want.items():
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [s for s, _ in got] == [s for s, _ in points], key  # each step once, none missing
        if not key.startswith("perf/"):
            assert got == points, key


def test_scale_panels_keep_small_series_readable():
    from megarl.tracking.report import scale_panels

    def series(*peaks):
        return {f"m{i}": ([0, 1], [p / 2, p]) for i, p in enumerate(peaks)}

    assert scale_panels(series(0.4, 0.9, 17.0)) == [["m0", "m1"], ["m2"]]
    assert scale_panels(series(0.5, 3.0, 40.0, 300.0)) == [["m0", "m1"], ["m2", "m3"]]
    assert scale_panels(series(0.0, 0.2, -0.8)) == [["m0", "m1", "m2"]]  # zeros and signs: one scale
    assert scale_panels({"a": ([0], [float("nan")]), "b": ([0], [1.0])}) == [["a", "b"]]


def test_nested_runs_and_report(tmp_path, store_uri):
    pipe = Tracker.start(tmp_path / "pipe", {"pipeline": "sft,rl"}, uri=store_uri, run_name="pipeline", **FAST)
    sft = Tracker.start(tmp_path / "pipe" / "sft", {"optim": {"lr": 1e-5}}, parent=pipe, run_name="sft", **FAST)
    rl = Tracker.start(tmp_path / "pipe" / "rl", {"algo": "grpo"}, parent=pipe, run_name="rl", **FAST)
    assert sft.uri == rl.uri == store_uri  # children log into the parent's store
    for s in range(20):
        sft.log_metrics({"train/loss": 2.0 * math.exp(-s / 5), "train/lr": 1e-5 * min(1, s / 5),
                         "train/grad_norm": 1.0 + 0.1 * s}, step=s)
        rl.log_metrics({"rl/reward_mean": s / 20, "rl/kl": 0.01 * s}, step=s)
        if s % 10 == 0:
            rl.log_metrics({"eval/pass_at_1": 0.4 + s / 100, "eval/response_len": 17.0 + s / 10}, step=s)
        if s % 5 == 4:
            sft.log_metrics({"eval/loss": 2.0 * math.exp(-s / 6), "eval/token_accuracy": s / 20}, step=s)
    pipe.log_metrics({"pipeline/stage": 2}, step=0)
    for t in (sft, rl, pipe):
        assert t.close()
    client = MlflowClient(store_uri)
    for child in (sft, rl):
        assert client.get_run(child.run_id).data.tags["mlflow.parentRunId"] == pipe.run_id

    report = write_report(tmp_path / "pipe")
    out = report.parent
    names = {p.name for p in out.glob("*.png")}
    assert {"sft__loss.png", "sft__lr.png", "sft__grad_norm.png", "sft__eval.png",
            "rl__reward.png", "rl__kl.png"} <= names, names
    from matplotlib.image import imread

    img = imread(out / "sft__loss.png")
    assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0.01  # a real, non-blank plot
    assert imread(out / "rl__eval.png").shape[0] > img.shape[0]  # pass@1 and lengths: two panels
    md = report.read_text()
    assert pipe.run_id in md and sft.run_id in md and "![loss](sft__loss.png)" in md
    assert "| `eval/token_accuracy` | 0.95 (step 19) | higher | 0.95 (step 19) | 4 |" in md
    assert "| `train/grad_norm` | 2.9 (step 19) | - | - | 20 |" in md  # no direction: no best
    # the child's own run dir reports just that run
    assert write_report(tmp_path / "pipe" / "sft", tmp_path / "sft_report").exists()
    assert (tmp_path / "sft_report" / "loss.png").exists()


# ------------------------------------------------------------------ store unreachable
def test_unreachable_store_never_blocks_and_spill_replays(tmp_path, store_uri, caplog):
    """Nothing listens on the port: calls stay fast, close() gives up after its timeout and
    spills; a later Tracker on the same run dir replays the spill into a reachable store."""
    run_dir = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="megarl.tracking")
    t = Tracker.start(run_dir, {"optim": {"lr": 0.1}}, uri=dead, max_pending=50, **FAST)
    seconds = []
    for s in range(200):
        t0 = time.perf_counter()
        t.log_metrics({"train/loss": float(s)}, step=s)
        t.set_tags({"checkpoint.latest": f"ckpt/{s}"})
        seconds.append(time.perf_counter() - t0)
    # Blocking on the dead store (mlflow's own retries and backoff) would make every call take
    # seconds; the shared 2-core CI box may stall any one call for a few hundred ms.
    seconds.sort()
    assert seconds[100] < 0.05 and seconds[-1] < 1.0, f"median {seconds[100]:.3f}s, slowest {seconds[-1]:.3f}s"
    assert t.pending <= 50  # bounded memory: the overflow went to disk
    deadline = time.monotonic() + 30  # the delivery thread has failed (first mlflow import is slow)
    while time.monotonic() < deadline and not any("cannot deliver" in r.getMessage() for r in caplog.records):
        time.sleep(0.1)
    time.sleep(1.0)  # several more failed retries (backoff 0.05..0.2 s) must stay silent
    t0 = time.monotonic()
    assert t.close(timeout=1.0) is False
    assert time.monotonic() - t0 < 5.0
    assert t.run_id is None
    spill = run_dir / "tracking_spill.jsonl"
    ops = [json.loads(line) for line in spill.read_text().splitlines()]
    assert sum(op["op"] == "metrics" for op in ops) == 200
    failures = [r for r in caplog.records if "cannot deliver" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is None  # one line, no traceback storm

    t2 = Tracker.start(run_dir, uri=store_uri, **FAST)  # e.g. the requeued job, store back up
    t2.log_metrics({"train/loss": 200.0}, step=200)
    assert t2.flush(60)
    assert t2.close()
    assert not list(run_dir.glob("tracking_spill*"))
    run = MlflowClient(store_uri).get_run(t2.run_id)
    assert history(MlflowClient(store_uri), t2.run_id, "train/loss") == [(s, float(s)) for s in range(201)]
    assert run.data.params == {"optim.lr": "0.1"}
    assert run.data.tags["checkpoint.latest"] == "ckpt/199"  # replay kept the order
    assert run.info.status == "FINISHED"  # the spilled FINISHED of the first session is not replayed


def test_replay_spill_applies_final_status(tmp_path, store_uri):
    run_dir = tmp_path / "run"
    t = Tracker.start(run_dir, uri=store_uri, **FAST)
    t.log_metrics({"a": 1.0}, step=0)
    assert t.close("KILLED")
    t = Tracker.start(run_dir, uri=f"http://127.0.0.1:{free_port()}", **FAST)  # store "down"
    t.log_metrics({"a": 2.0}, step=1)
    assert t.close("FINISHED", timeout=0.5) is False
    assert replay_spill(run_dir, uri=store_uri, timeout=30)
    client = MlflowClient(store_uri)
    assert history(client, t.run_id or json.loads((run_dir / "tracking.json").read_text())["run_id"], "a") \
        == [(0, 1.0), (1, 2.0)]
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_rejected_op_is_dropped_not_blocking(tmp_path, store_uri, caplog):
    caplog.set_level(logging.WARNING, logger="megarl.tracking")
    gone = tmp_path / "gone.txt"
    gone.write_text("x")
    t = Tracker.start(tmp_path / "run", uri=store_uri, **FAST)
    t.log_artifact(gone)
    gone.unlink()  # deleted before the upload: the op can never succeed
    t.log_metrics({"after": 1.0}, step=0)
    assert t.close()
    assert MlflowClient(store_uri).get_run(t.run_id).data.metrics["after"] == 1.0
    assert any("rejected by the store and dropped" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ NullTracker / factory
def test_null_tracker_has_the_tracker_interface(tmp_path):
    public = {n for n, v in vars(Tracker).items() if not n.startswith("_") and callable(v)} - {"start"}
    for name in public | {"start"}:
        assert hasattr(NullTracker, name), name
        want = list(inspect.signature(getattr(Tracker, name)).parameters)
        got = list(inspect.signature(getattr(NullTracker, name)).parameters)
        if name != "start":
            assert got == want, (name, got, want)
    for prop in ("run_id", "pending", "uri"):
        assert hasattr(NullTracker(), prop)
    assert isinstance(create_tracker(tmp_path, {"a": 1}, rank=1), NullTracker)
    assert isinstance(create_tracker(tmp_path, {"a": 1}, backend="none"), NullTracker)
    with create_tracker(tmp_path, backend="none") as t:
        t.log_metrics({"a": 1}, step=0)
        t.log_table([{"a": 1}], "x", 0)
    assert not (tmp_path / "tracking.json").exists()
    with pytest.raises(ValueError):
        create_tracker(tmp_path, backend="wandb")
