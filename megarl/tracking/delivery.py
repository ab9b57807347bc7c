"""Apply tracking ops to one MLflow run through `MlflowClient` (never the fluent global API).

Runs only on the Tracker's delivery thread. Every method may raise; `is_permanent()` tells the
caller whether retrying can help (a bad key or a deleted run cannot be fixed by waiting, a
refused connection or a locked SQLite file can).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from .params import MAX_TAG_VALUE_LEN, metric_value, sanitize_key, truncate
from .state import RunState
from .store import prepare_store

log = logging.getLogger("megarl.tracking")

# MLflow's per-call limits for log_batch (mlflow.utils.validation).
MAX_METRICS_PER_CALL = 1000
MAX_PARAMS_PER_CALL = 100
MAX_TAGS_PER_CALL = 100

# Error codes for which a retry gives the same answer. Everything else (connection refused,
# timeouts, 5xx, "database is locked", auth problems that an operator can fix) is transient.
_PERMANENT_CODES = {
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
    "INVALID_STATE", "BAD_REQUEST", "ENDPOINT_NOT_FOUND", "MALFORMED_REQUEST",
}

PARENT_TAG = "mlflow.parentRunId"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # what MlflowClient.log_table maintains


class NotReady(Exception):
    """The run cannot be created yet (e.g. the parent run does not exist yet); retry later."""


def is_permanent(exc: BaseException) -> bool:
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, TypeError, ValueError)) and not hasattr(
        exc, "error_code"
    ):
        return True
    return getattr(exc, "error_code", None) in _PERMANENT_CODES


def default_artifact_location(uri: str) -> str | None:
    """For an embedded SQLite store, keep artifacts next to the database (inside the run dir)."""
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":
        db_path = uri[len("sqlite:///"):]
        return Path(db_path).resolve().parent.joinpath("mlartifacts").as_uri()
    return None  # a tracking server (or other database) decides where artifacts go


def read_points(path: str, upto: int) -> dict[str, dict[int, float]]:
    """{MLflow key: {step: value}} of a metrics.jsonl's records with step <= upto, keyed and
    valued as `Tracker.log_metrics` would log them; a torn or unreadable line is skipped."""
    out: dict[str, dict[int, float]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
            step = int(record["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if step > upto:
            continue
        for k, v in record.items():
            value = metric_value(v) if k != "step" else None
            if value is not None:
                out.setdefault(sanitize_key(k), {})[step] = value
    return out


def missing_points(wanted: dict[str, dict[int, float]], have: dict[str, set[int]]) -> list[tuple[str, int, float]]:
    """(key, step, value) of each wanted point whose (key, step) the store does not hold."""
    return [(k, s, v) for k, points in sorted(wanted.items()) for s, v in sorted(points.items())
            if s not in have.get(k, ())]


class MlflowSink:
    """One MLflow run: created or resumed on first use, then fed batches of ops."""

    def __init__(
        self,
        uri: str,
        state: RunState,
        experiment: str,
        run_name: str | None,
        tags: dict[str, str],
        parent_run_id: Callable[[], str | None] | None,
        mark_running: bool = True,
    ):
        self.uri = uri
        self.state = state
        self.experiment = experiment
        self.run_name = run_name
        self.tags = tags
        self.parent_run_id = parent_run_id
        self.mark_running = mark_running  # False when only replaying a finished run's spill
        self.run_id: str | None = None
        # The run may be created long after the Tracker started (store down, slow first start):
        # stamp it with the Tracker's start, so that start <= metric timestamps <= end.
        self.start_time = int(time.time() * 1000)
        self._client = None
        self._known_params: dict[str, str] = {}
        self._changed_params: dict[str, list[str]] = {}
        # A resumed run's newest step per metric: a resumed process repeats the steps between its
        # checkpoint and the kill; those keep the point already logged (one point per step).
        self._logged_up_to: dict[str, int] = {}

    @property
    def client(self):
        if self._client is None:
            from mlflow.tracking import MlflowClient  # heavy import, done off the training thread

            prepare_store(self.uri)  # an embedded store: created whole, or a half-created one replaced
            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    # ------------------------------------------------------------------ run lifecycle
    def ensure_run(self) -> str:
        """Resume the run recorded in the run dir, or create it (under its parent, if any)."""
        if self.run_id:
            return self.run_id
        _ = self.client  # open (an embedded store: prepare) the store before waiting on a parent run
        saved = self.state.load()
        if saved.get("run_id"):
            run = self._get_run_or_none(saved["run_id"])
            if run is not None:
                if self.mark_running:
                    self.client.update_run(run.info.run_id, status="RUNNING")
                self._known_params = dict(run.data.params)
                if self.mark_running:
                    self._logged_up_to = self._newest_steps(run)
                self.run_id = run.info.run_id
                self.state.save(run_id=self.run_id, experiment_id=run.info.experiment_id,
                                tracking_uri=self.uri, resumed_at=time.time())
                log.info("megarl.tracking: resumed MLflow run %s at %s", self.run_id, self.uri)
                return self.run_id
            log.warning("megarl.tracking: run %s recorded in %s is not in %s; starting a new run",
                        saved["run_id"], self.state.path, self.uri)
        tags = dict(self.tags)
        if self.parent_run_id is not None:
            parent = self.parent_run_id()
            if not parent:
                raise NotReady("parent run not created yet")
            tags[PARENT_TAG] = parent
        exp_id = self._experiment_id()
        run = self.client.create_run(exp_id, start_time=self.start_time, tags=tags, run_name=self.run_name)
        self.run_id = run.info.run_id
        self.state.save(run_id=self.run_id, experiment_id=exp_id, experiment=self.experiment,
                        tracking_uri=self.uri, run_name=run.info.run_name,
                        parent_run_id=tags.get(PARENT_TAG), created_at=time.time())
        log.info("megarl.tracking: created MLflow run %s (%s) at %s", self.run_id, run.info.run_name, self.uri)
        return self.run_id

    def _newest_steps(self, run) -> dict[str, int]:
        """{metric key: its newest step} of a stored run (MLflow's latest metric is the one with
        the highest step)."""
        objs = getattr(run.data, "_metric_objs", None)
        if objs is not None:
            return {m.key: int(m.step) for m in objs}
        return {k: max((int(m.step) for m in self.client.get_metric_history(run.info.run_id, k)), default=-1)
                for k in run.data.metrics}

    def _get_run_or_none(self, run_id: str):
        try:
            run = self.client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001 - classify below
            if getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return None if run.info.lifecycle_stage == "deleted" else run

    def _experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            return exp.experiment_id
        try:
            return self.client.create_experiment(
                self.experiment, artifact_location=default_artifact_location(self.uri))
        except Exception as exc:  # noqa: BLE001 - another process created it concurrently
            if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(self.experiment).experiment_id

    # ------------------------------------------------------------------ ops
    def apply(self, ops: list[dict], *, replay_status: bool = True) -> None:
        """Deliver ops in order, merging runs of metrics/params/tags into log_batch calls."""
        from mlflow.entities import Metric, Param, RunTag

        run_id = self.ensure_run()
        metrics: list = []
        params: dict[str, str] = {}
        tags: dict[str, str] = {}

        def flush():
            m, p, t = metrics[:], list(params.items()), list(tags.items())
            while m or p or t:
                mm, m = m[:MAX_METRICS_PER_CALL], m[MAX_METRICS_PER_CALL:]
                room = MAX_METRICS_PER_CALL - len(mm)  # 1000 entities per call in total
                pp, p = p[:min(MAX_PARAMS_PER_CALL, room)], p[min(MAX_PARAMS_PER_CALL, room):]
                room -= len(pp)
                tt, t = t[:min(MAX_TAGS_PER_CALL, room)], t[min(MAX_TAGS_PER_CALL, room):]
                self.client.log_batch(
                    run_id, metrics=mm, params=[Param(k, v) for k, v in pp],
                    tags=[RunTag(k, v) for k, v in tt], synchronous=True,
                )
                self._known_params.update(pp)
            metrics.clear(), params.clear(), tags.clear()

        for op in ops:
            kind = op["op"]
            if kind == "metrics":
                metrics.extend(Metric(k, v, op["ts"], op["step"]) for k, v in op["data"].items()
                               if op["step"] > self._logged_up_to.get(k, -1))
            elif kind == "params":
                params.update(self._new_params(op["data"]))
                if self._changed_params:
                    tags["megarl.changed_params"] = truncate(
                        json.dumps(self._changed_params, sort_keys=True), MAX_TAG_VALUE_LEN)
            elif kind == "tags":
                tags.update(op["data"])
            else:
                flush()
                if kind == "artifact":
                    self._log_artifact(run_id, op["path"], op.get("artifact_path"))
                elif kind == "table":
                    self._log_table(run_id, op["artifact_file"], op["columns"], op["data"])
                elif kind == "status":
                    if replay_status:
                        self.client.set_terminated(run_id, op["status"], end_time=op["ts"])
                elif kind == "backfill":
                    self._backfill(run_id, op["path"], op["upto"], op["ts"])
                else:
                    log.warning("megarl.tracking: unknown op %r dropped", kind)
        flush()

    def _backfill(self, run_id: str, path: str, upto: int, ts: int) -> None:
        """Log the points of metrics.jsonl (steps <= upto) that the run lacks: what a killed
        process held in memory never reached the store, and the file is the durable record."""
        from mlflow.entities import Metric

        wanted = read_points(path, upto)
        if not wanted:
            return
        stored = self.client.get_run(run_id).data.metrics
        have = {k: {int(m.step) for m in self.client.get_metric_history(run_id, k)} for k in wanted if k in stored}
        missing = missing_points(wanted, have)
        for i in range(0, len(missing), MAX_METRICS_PER_CALL):
            self.client.log_batch(run_id, metrics=[Metric(k, v, ts, s) for k, s, v in missing[i:i + MAX_METRICS_PER_CALL]],
                                  synchronous=True)
        for k, points in wanted.items():
            self._logged_up_to[k] = max(self._logged_up_to.get(k, -1), max(points))
        if missing:
            log.info("megarl.tracking: %d metric points of %s were not in MLflow run %s; logged them",
                     len(missing), path, run_id)

    def _new_params(self, data: dict[str, str]) -> dict[str, str]:
        """Params not yet on the run. MLflow params are immutable, so on resume a changed value
        is recorded in the `megarl.changed_params` tag instead of failing the whole batch."""
        out = {}
        for k, v in data.items():
            old = self._known_params.get(k)
            if old is None:
                out[k] = v
            elif old != v and self._changed_params.get(k, [None, None])[1] != v:
                self._changed_params[k] = [old, v]
                log.warning("megarl.tracking: param %s changed on resume (%r -> %r); kept as tag "
                            "megarl.changed_params", k, old[:80], v[:80])
        return out

    def _log_artifact(self, run_id: str, path: str, artifact_path: str | None) -> None:
        if os.path.isdir(path):
            self.client.log_artifacts(run_id, path, artifact_path)
        elif os.path.exists(path):
            self.client.log_artifact(run_id, path, artifact_path)
        else:
            raise FileNotFoundError(f"artifact {path} no longer exists")

    def _log_table(self, run_id: str, artifact_file: str, columns: list, data: list) -> None:
        """Write MLflow's table format (pandas 'split' orient) and register it like
        `MlflowClient.log_table` does, but overwrite instead of append so a retry is harmless."""
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, os.path.basename(artifact_file))
            with open(local, "w", encoding="utf-8") as f:
                json.dump({"columns": columns, "data": data}, f, default=str)
            self.client.log_artifact(run_id, local, os.path.dirname(artifact_file) or None)
        tables = json.loads(self.client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
        entry = {"path": artifact_file, "type": "table"}
        if entry not in tables:
            value = json.dumps(tables + [entry])
            if len(value) <= MAX_TAG_VALUE_LEN:  # past the limit the table is still an artifact
                self.client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, value)
