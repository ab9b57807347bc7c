"""The embedded MLflow store after a kill during its creation, and spilled records replayed
(issue 27.4): creation is atomic, a half-created store is replaced (or, holding runs, named in
one line), and a stage's spilled records reach the store even when a rerun skips that stage."""
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

from megarl.tracking import Tracker, replay_stage_spills  # noqa: E402
from megarl.tracking.store import BrokenStore, prepare_store, store_problem  # noqa: E402

pytestmark = pytest.mark.timeout(400)

# creating a store takes MLflow 5-30 s (its migrations) on a loaded 2-core machine
FAST = dict(system_metrics_interval=None, retry_backoff=(0.05, 0.2), flush_timeout=150)
MID_MIGRATION = "c8d9e0f1a2b3"  # where a kill -9 during creation was seen to leave a store


def _half_created(path, with_run=False):
    """A store as a kill -9 during MLflow's migrations leaves it: an earlier schema revision and
    alembic's temp table of the batch migration that was running (what MLflow then fails on)."""
    if with_run:
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        client = MlflowClient(f"sqlite:///{path}")
        client.create_run(client.create_experiment("x"))
        SqlAlchemyStore._engine_map.pop(f"sqlite:///{path}").dispose()  # as if another process made it
    else:
        from alembic import command
        from mlflow.store.db.utils import _get_alembic_config, create_sqlalchemy_engine_with_retry
        from mlflow.store.tracking.dbmodels.initial_models import Base

        engine = create_sqlalchemy_engine_with_retry(f"sqlite:///{path}")
        Base.metadata.create_all(engine)
        config = _get_alembic_config(str(engine.url))
        with engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, MID_MIGRATION)
        engine.dispose()
    con = sqlite3.connect(path)
    con.execute(f"update alembic_version set version_num = '{MID_MIGRATION}'")
    con.execute("create table _alembic_tmp_experiments (experiment_id integer)")
    con.commit()
    con.close()


def _metrics(uri, run_id, key):
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def test_a_half_created_store_is_replaced_and_records_reach_it(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="megarl.tracking")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "mlflow.db"
    _half_created(db)
    assert store_problem(db)[0] == "an interrupted schema migration left table _alembic_tmp_experiments"
    t = Tracker.start(run_dir, **FAST)  # the embedded store: sqlite:///<run_dir>/mlflow.db
    t.log_metrics({"train/loss": 0.5}, step=1)
    assert t.close()  # before: never delivered (each try fails on the leftover table), records only spilled
    assert _metrics(t.uri, t.run_id, "train/loss") == [(1, 0.5)]
    assert store_problem(db) == (None, 1)
    assert len(list(run_dir.glob("mlflow.db.broken-*"))) == 1
    warned = [r.getMessage() for r in caplog.records if "half-created MLflow store" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]


def test_a_broken_store_with_runs_is_named_in_one_line_and_nothing_is_lost(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="megarl.tracking")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    db = run_dir / "mlflow.db"
    _half_created(db, with_run=True)
    before = db.read_bytes()
    t = Tracker.start(run_dir, **FAST)
    t.log_metrics({"train/loss": 0.5}, step=1)
    start = time.monotonic()
    assert t.close() is False
    assert time.monotonic() - start < 60  # not the 150 s close timeout: retrying cannot help
    assert db.read_bytes() == before  # left as it was
    broken = [r.getMessage() for r in caplog.records if "the MLflow store is unusable" in r.getMessage()]
    assert len(broken) == 1 and "\n" not in broken[0] and "holds 1 run(s)" in broken[0], broken
    assert "mlflow db upgrade" in broken[0]
    spilled = [json.loads(line) for line in (run_dir / "tracking_spill.jsonl").read_text().splitlines()]
    assert any(op["op"] == "metrics" and op["data"] == {"train/loss": 0.5} for op in spilled)
    with pytest.raises(BrokenStore):
        prepare_store(f"sqlite:///{db}")


def test_store_creation_killed_leaves_no_store_then_is_completed(tmp_path):
    db = tmp_path / "mlflow.db"
    code = "import sys\nfrom megarl.tracking.store import prepare_store\nprepare_store(sys.argv[1])\n"
    proc = subprocess.Popen([sys.executable, "-c", code, f"sqlite:///{db}"])
    deadline = time.time() + 120
    while not list(tmp_path.glob("mlflow.db.creating-*")):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    time.sleep(0.3)  # in the middle of MLflow's migrations
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not db.exists()  # before: a half-migrated mlflow.db, broken for good
    prepare_store(f"sqlite:///{db}")  # the next run: the dead creator's temp file goes, a whole store comes
    assert store_problem(db) == (None, 0)
    assert sorted(os.listdir(tmp_path)) == ["mlflow.db"]


def test_a_stage_that_ended_before_the_store_worked_is_replayed(tmp_path):
    """SFT ran while the store was unusable (its records went to the spill files); the store is
    then fixed; a rerun that skips SFT (a pipeline resumed at RL) or `python -m megarl.tracking
    replay` delivers SFT's records into a run nested under the pipeline's run."""
    for how in ("next run", "replay command"):
        run_dir = tmp_path / how.replace(" ", "_")
        run_dir.mkdir()
        db = run_dir / "mlflow.db"
        _half_created(db, with_run=True)
        parent = Tracker.start(run_dir, run_name="pipe", **FAST)
        sft = Tracker.start(run_dir / "sft", {"optim": {"lr": 0.1}}, run_name="sft", parent=parent,
                            tags={"megarl.stage": "sft"}, **FAST)
        sft.log_metrics({"train/loss": 2.0}, step=1)
        assert sft.close("FINISHED") is False and parent.close("FINISHED") is False
        assert (run_dir / "sft" / "tracking_spill.jsonl").exists()
        os.replace(db, run_dir / "old.db")  # the user moves the broken store away
        if how == "next run":
            parent = Tracker.start(run_dir, run_name="pipe", **FAST)
            rl = Tracker.start(run_dir / "rl", run_name="rl", parent=parent, **FAST)
            replays = replay_stage_spills(run_dir, parent, exclude=[run_dir / "rl"])
            assert len(replays) == 1
            assert rl.close() and parent.close() and all(r.close(None) for r in replays)
        else:
            out = subprocess.run([sys.executable, "-m", "megarl.tracking", "replay", str(run_dir), "--timeout", "150"],
                                 capture_output=True, text=True, timeout=300)
            assert out.returncode == 0, out.stderr[-2000:]
        state = json.loads((run_dir / "sft" / "tracking.json").read_text())
        client = MlflowClient(f"sqlite:///{db}")
        run = client.get_run(state["run_id"])
        assert _metrics(f"sqlite:///{db}", state["run_id"], "train/loss") == [(1, 2.0)], how
        assert run.info.run_name == "sft" and run.info.status == "FINISHED" and run.data.params == {"optim.lr": "0.1"}
        assert run.data.tags["megarl.stage"] == "sft"
        parent_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
        assert run.data.tags["mlflow.parentRunId"] == parent_id, how
        assert not list((run_dir / "sft").glob("tracking_spill*"))
