"""Experiment tracking for rank 0: `Tracker` (MLflow) and `NullTracker` (everything else).

Contract with the training loop: every public method returns in microseconds and never raises
because of the tracking store. Calls become ops in an `Outbox`; one daemon thread delivers them
through `MlflowClient` with retries and exponential backoff. Delivery guarantee ("at least once,
possibly later"):

* store slow or down mid-run: ops wait in memory (bounded; the overflow goes to
  `<run_dir>/tracking_spill.jsonl`) and are delivered in order once it answers again;
* store down at start: the MLflow run is created as soon as the store answers;
* the process killed (SIGKILL, OOM): what it held in memory is lost, so a resumed stage calls
  `backfill` with its metrics.jsonl, and the points the run lacks are logged, once each;
* `close()` waits up to `flush_timeout` seconds; what is still undelivered is appended to the
  spill file and replayed by the next `Tracker.start` on the same run dir (a resumed job), or
  explicitly with `python -m megarl.tracking replay RUN_DIR`.

One warning line is logged when delivery starts failing and one when it recovers.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .delivery import MlflowSink, NotReady, is_permanent
from .outbox import Outbox, read_spill
from .params import MAX_TAG_VALUE_LEN, flatten_params, metric_value, sanitize_key, truncate
from .state import RunState
from .store import BrokenStore
from .system import SystemSampler

log = logging.getLogger("megarl.tracking")

_TERMINAL = ("FINISHED", "FAILED", "KILLED")


def default_tracking_uri(run_dir: str | os.PathLike) -> str:
    """The embedded store used when nothing is configured: a SQLite file inside the run dir."""
    return f"sqlite:///{Path(run_dir).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(run_dir, uri: str | None = None, parent: Any = None) -> str:
    """explicit uri > the parent tracker's store > $MLFLOW_TRACKING_URI > SQLite in run_dir."""
    if uri:
        return uri
    if isinstance(parent, Tracker):
        return parent.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(run_dir)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


class Tracker:
    """MLflow run of one run directory. Create with `Tracker.start(...)`; see module docstring."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        uri: str,
        experiment: str = "megarl",
        run_name: str | None = None,
        parent: "Tracker | str | None" = None,
        tags: Mapping[str, Any] | None = None,
        system_metrics_interval: float | None = 30.0,
        max_pending: int = 10_000,
        flush_timeout: float = 15.0,
        retry_backoff: tuple[float, float] = (0.5, 30.0),
        http_timeout: float = 10.0,
        replay_status: bool = False,
        mark_running: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.uri = uri
        self.flush_timeout = float(flush_timeout)
        self._backoff_min, self._backoff_max = map(float, retry_backoff)
        self._replay_status = replay_status
        if uri.startswith(("http://", "https://")):
            # MLflow's own HTTP retries would keep our thread in one call for minutes; we retry
            # ourselves (with backoff, without blocking anyone), so one short attempt per call.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, int(http_timeout))))

        self._outbox = Outbox(self.run_dir, max_pending)
        if isinstance(parent, Tracker):
            parent_id = lambda: parent.run_id  # noqa: E731 - resolved when the run is created
        elif isinstance(parent, str) and parent:
            parent_id = lambda: parent  # noqa: E731
        else:  # None, or a NullTracker (tracking off): a top-level run
            parent_id = None
        run_tags = {"megarl.run_dir": str(self.run_dir.resolve())}
        run_tags.update({sanitize_key(k): truncate(str(v), MAX_TAG_VALUE_LEN) for k, v in (tags or {}).items()})
        state = RunState(self.run_dir)
        if mark_running:  # what a replay needs to create this run if the store never saw it
            state.save(store_uri=uri, experiment=experiment, run_name=run_name, tags=run_tags,
                       parent_run_dir=str(parent.run_dir.resolve()) if isinstance(parent, Tracker) else None,
                       parent_run_id=parent if isinstance(parent, str) and parent else None)
        self._sink = MlflowSink(uri, state, experiment, run_name, run_tags, parent_id, mark_running=mark_running)

        self._last_step = 0
        self._closing = threading.Event()
        self._abort = threading.Event()
        self._closed = False
        self._broken = False  # the store is unusable (BrokenStore): everything goes to the spill file
        self._failing_since: float | None = None
        self._dropped_warned: set[str] = set()
        self._worker = threading.Thread(target=self._deliver_loop, name="megarl-tracking", daemon=True)
        self._worker.start()
        self._system = None
        if system_metrics_interval:
            self._system = SystemSampler(self.log_metrics, lambda: self._last_step,
                                         system_metrics_interval).start()
        atexit.register(self._atexit)

    @classmethod
    def start(
        cls,
        run_dir: str | os.PathLike,
        params: Any = None,
        *,
        uri: str | None = None,
        experiment: str = "megarl",
        run_name: str | None = None,
        parent: "Tracker | str | None" = None,
        tags: Mapping[str, Any] | None = None,
        **options,
    ) -> "Tracker":
        """Start (or resume, if `<run_dir>/tracking.json` names a run) the MLflow run of run_dir.

        params: the resolved config (nested dict / dataclass), logged flattened with dotted keys.
        uri: tracking URI; default `$MLFLOW_TRACKING_URI`, else `sqlite:///<run_dir>/mlflow.db`
            (artifacts in `<run_dir>/mlartifacts`). A child inherits its parent Tracker's store.
        parent: the pipeline's Tracker (or a run id) -> this run is nested under it.
        options: system_metrics_interval (s, None = off), max_pending (ops kept in memory),
            flush_timeout (s close() waits), retry_backoff (min, max s), http_timeout (s per HTTP
            request to a tracking server; applied only if $MLFLOW_HTTP_REQUEST_TIMEOUT is unset,
            and note that MLflow reads these settings process-wide).
        Returns immediately; nothing here talks to the store.
        """
        tracker = cls(run_dir, uri=resolve_tracking_uri(run_dir, uri, parent), experiment=experiment,
                      run_name=run_name, parent=parent, tags=tags, **options)
        if params is not None:
            tracker.log_params(params)
        return tracker

    # ------------------------------------------------------------------ logging API
    @property
    def run_id(self) -> str | None:
        """The MLflow run id once the run exists in the store (None while it is unreachable)."""
        return self._sink.run_id

    @property
    def pending(self) -> int:
        """Ops not yet delivered that are held in memory (spilled ones not counted)."""
        return len(self._outbox)

    def log_params(self, params: Any) -> None:
        """Nested config -> flattened dotted params (see `flatten_params`)."""
        flat = flatten_params(params)
        if flat:
            self._put({"op": "params", "data": flat})

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Scalars at a training step; non-numeric values are dropped."""
        data = {}
        for k, v in metrics.items():
            value = metric_value(v)
            if value is not None:
                data[sanitize_key(k)] = value
        if data:
            step = int(step)
            self._last_step = max(self._last_step, step)
            self._put({"op": "metrics", "ts": int(time.time() * 1000), "step": step, "data": data})

    def backfill(self, metrics_file: str | os.PathLike, upto_step: int) -> None:
        """After a resume: log the points of `metrics_file` (metrics.jsonl) up to `upto_step`
        that the run lacks, once each; a process killed before delivering its ops loses none."""
        self._put({"op": "backfill", "path": str(Path(metrics_file).resolve()), "upto": int(upto_step),
                   "ts": int(time.time() * 1000)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self._put({"op": "tags", "data": {
            sanitize_key(k): truncate(str(v), MAX_TAG_VALUE_LEN) for k, v in tags.items()}})

    def log_checkpoint(self, path: str | os.PathLike, step: int) -> None:
        """Record the latest checkpoint as tags (`checkpoint.latest`, `checkpoint.latest_step`)."""
        self.set_tags({"checkpoint.latest": str(Path(path).resolve()), "checkpoint.latest_step": int(step)})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or directory. Uploaded asynchronously: keep it in place until close()."""
        self._put({"op": "artifact", "path": str(Path(path).resolve()), "artifact_path": artifact_path})

    def log_table(self, rows: list[Mapping[str, Any]], name: str, step: int) -> None:
        """Rows (e.g. sample generations at an evaluation) as an MLflow table artifact
        `tables/<name>/step_<step>.json` (with a `step` column), shown in the UI's artifact view
        and readable with `MlflowClient.load_table`."""
        columns = ["step"]
        for row in rows:
            columns.extend(k for k in row if k not in columns)
        data = [[int(step)] + [row.get(c) for c in columns[1:]] for row in rows]
        safe = sanitize_key(name).replace("/", "_")
        self._put({"op": "table", "artifact_file": f"tables/{safe}/step_{int(step):08d}.json",
                   "columns": columns, "data": json.loads(json.dumps(data, default=str))})

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything logged so far is delivered (spill files included); True if so."""
        target = self._outbox.last_seq
        deadline = time.monotonic() + (self.flush_timeout if timeout is None else timeout)
        cond = self._outbox.cond
        with cond:
            while not (self._outbox.delivered_upto(target) and not self._outbox.has_spill()):
                left = deadline - time.monotonic()
                if left <= 0 or not self._worker.is_alive() or self._broken:
                    return False
                cond.notify_all()  # wake the worker if it idles
                cond.wait(min(left, 0.1))
        return True

    def close(self, status: str | None = "FINISHED", timeout: float | None = None) -> bool:
        """Mark the run terminated, deliver what is pending within `timeout` (default
        flush_timeout) and spill the rest to disk. Returns True if everything was delivered.
        status: FINISHED / FAILED / KILLED, or None to leave the run's status unchanged."""
        if self._closed:
            return True
        self._closed = True
        atexit.unregister(self._atexit)
        if self._system is not None:
            self._system.stop()
        if status is not None:
            if status not in _TERMINAL:
                raise ValueError(f"status must be one of {_TERMINAL}, got {status!r}")
            self._outbox.put({"op": "status", "status": status, "ts": int(time.time() * 1000)})
        self._closing.set()
        with self._outbox.cond:
            self._outbox.cond.notify_all()
        self._worker.join(self.flush_timeout if timeout is None else timeout)
        if not self._worker.is_alive() and not self._broken:
            return True
        self._abort.set()
        spilled = self._outbox.spill_all()
        log.warning(
            "megarl.tracking: %s %s; %d ops saved to %s and replayed when this run dir is resumed "
            "(or: python -m megarl.tracking replay %s)", self.uri,
            "is unusable (see above)" if self._broken else "not reachable before close timeout",
            spilled, self._outbox.spill_path, self.run_dir,
        )
        return False

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None or (exc_type is SystemExit and exc.code in (0, None)):
            self.close("FINISHED")
        elif exc_type in (KeyboardInterrupt, SystemExit):
            self.close("KILLED")  # includes the requeue exit (75) after pre-emption
        else:
            self.close("FAILED")

    def _atexit(self) -> None:
        self.close("KILLED")  # the process ended without close(): at least keep the data

    def _put(self, op: dict) -> None:
        if self._closed:
            log.debug("megarl.tracking: %s after close() ignored", op["op"])
            return
        self._outbox.put(op)

    # ------------------------------------------------------------------ delivery thread
    def _deliver_loop(self) -> None:
        backoff = self._backoff_min
        while not self._abort.is_set():
            try:
                self._sink.ensure_run()
                spill = self._outbox.claim_spill()  # older than anything in memory: first
                if spill is not None:
                    for chunk in read_spill(spill, 200):
                        if self._abort.is_set():
                            return
                        self._deliver(chunk, replay_status=self._replay_status)
                    spill.unlink()
                    with self._outbox.cond:
                        self._outbox.cond.notify_all()
                    continue
                batch = self._outbox.peek(200)
                if not batch:
                    if self._closing.is_set():
                        return
                    with self._outbox.cond:
                        self._outbox.cond.wait(0.5)
                    continue
                self._deliver([op for _, op in batch])
                self._outbox.ack(batch[-1][0])
                if self._failing_since is not None:
                    log.warning("megarl.tracking: delivery to %s recovered after %.0f s",
                                self.uri, time.monotonic() - self._failing_since)
                    self._failing_since = None
                backoff = self._backoff_min
            except NotReady:  # the parent's run is being created (its thread reports failures)
                (self._abort if self._closing.is_set() else self._closing).wait(0.2)
            except BrokenStore as exc:  # retrying cannot help: say so once, keep everything on disk
                log.warning("megarl.tracking: %s", exc)
                self._broken = True
                self._closing.wait()
                return
            except Exception as exc:  # noqa: BLE001 - the store may fail in any way; keep data
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
                    log.warning("megarl.tracking: cannot deliver to %s (%s); %d ops buffered, "
                                "retrying in the background", self.uri, _one_line(exc), len(self._outbox))
                else:
                    log.debug("megarl.tracking: retry failed: %s", _one_line(exc))
                if self._closing.is_set():  # close() waits only flush_timeout: retry often
                    self._abort.wait(min(backoff, 0.25))
                else:  # close() cuts a long backoff short
                    self._closing.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max)

    def _deliver(self, ops: list[dict], replay_status: bool = True) -> None:
        """Apply ops; an op the store rejects for good is dropped (one warning per kind of
        rejection) so it cannot block everything behind it. Transient errors propagate."""
        try:
            self._sink.apply(ops, replay_status=replay_status)
        except NotReady:
            raise
        except Exception as exc:  # noqa: BLE001
            if not is_permanent(exc):
                raise
            if len(ops) > 1:
                for op in ops:
                    self._deliver([op], replay_status)
                return
            key = f"{ops[0]['op']}:{getattr(exc, 'error_code', type(exc).__name__)}"
            if key not in self._dropped_warned:
                self._dropped_warned.add(key)
                log.warning("megarl.tracking: %s op rejected by the store and dropped (%s)",
                            ops[0]["op"], _one_line(exc))


class NullTracker:
    """Same interface as Tracker; does nothing (non-zero ranks, `tracking.backend: none`)."""

    run_id = None
    uri = None
    pending = 0

    def __init__(self, run_dir: str | os.PathLike | None = None, **_ignored):
        self.run_dir = Path(run_dir) if run_dir is not None else None

    @classmethod
    def start(cls, run_dir=None, params=None, **_ignored) -> "NullTracker":
        return cls(run_dir)

    def log_params(self, params): pass
    def log_metrics(self, metrics, step): pass
    def backfill(self, metrics_file, upto_step): pass
    def set_tags(self, tags): pass
    def log_checkpoint(self, path, step): pass
    def log_artifact(self, path, artifact_path=None): pass
    def log_table(self, rows, name, step): pass
    def flush(self, timeout=None): return True
    def close(self, status="FINISHED", timeout=None): return True
    def __enter__(self): return self
    def __exit__(self, *exc): self.close()


def create_tracker(run_dir, params: Any = None, *, backend: str = "mlflow", rank: int = 0,
                   **kwargs) -> "Tracker | NullTracker":
    """The tracker a process should use: MLflow on rank 0 when backend == "mlflow", else Null."""
    if backend in (None, "none", "null", "off", False) or rank != 0:
        return NullTracker(run_dir)
    if backend != "mlflow":
        raise ValueError(f"tracking.backend must be 'mlflow' or 'none', got {backend!r}")
    return Tracker.start(run_dir, params, **kwargs)


def _replay_tracker(run_dir, uri: str | None, timeout: float, parent: "Tracker | str | None" = None) -> Tracker:
    """A Tracker that delivers run_dir's spill files into its run, creating the run (with the name,
    tags and parent recorded at its start) if the store never saw it, and applies recorded statuses."""
    saved = RunState(run_dir).load()
    if parent is None:
        parent = RunState(saved["parent_run_dir"]).load().get("run_id") if saved.get("parent_run_dir") \
            else saved.get("parent_run_id")
    uri = uri or saved.get("tracking_uri") or saved.get("store_uri") or resolve_tracking_uri(run_dir, None, parent)
    return Tracker(run_dir, uri=uri, experiment=saved.get("experiment") or "megarl", run_name=saved.get("run_name"),
                   parent=parent, tags=saved.get("tags"), system_metrics_interval=None, replay_status=True,
                   mark_running=False, flush_timeout=timeout)


def _spilled(run_dir) -> bool:
    return any(Path(run_dir).glob("tracking_spill*.jsonl"))


_NOT_TRACKING = ("checkpoints", "data", "mlartifacts", "logs")  # run dir parts that hold no tracking state


def _tracking_dirs(run_dir) -> list[Path]:
    """run_dir and the dirs below it that hold a run's tracking state, parents before children."""
    found = []
    for here, dirs, files in os.walk(run_dir):
        dirs[:] = sorted(d for d in dirs if d not in _NOT_TRACKING)
        if "tracking.json" in files or any(f.startswith("tracking_spill") for f in files):
            found.append(Path(here))
    return sorted(found, key=lambda p: (len(p.parts), str(p)))


def replay_spill(run_dir, uri: str | None = None, timeout: float = 60.0) -> bool:
    """Deliver the spill files of a run dir and of its stage dirs (left by runs whose store was
    down or unusable at their end, or that ended before it existed) into their MLflow runs,
    applying recorded final statuses; the run dir's own run first, since the stages' runs nest
    under it. Returns True when nothing is left over."""
    ok = True
    for d in _tracking_dirs(run_dir):
        if _spilled(d):
            ok = _replay_tracker(d, uri, timeout).close(status=None, timeout=timeout) and ok
    return ok


def replay_stage_spills(run_dir, parent: "Tracker", exclude=()) -> list[Tracker]:
    """Start delivering, in the background, the spill files of the dirs below run_dir (stage
    dirs, evals) but those in or under `exclude` (e.g. a stage that finished while the store was
    unusable, which a rerun skips). The caller closes the returned trackers (status=None) when it
    closes its own."""
    skip = [Path(p).resolve() for p in exclude] + [Path(run_dir).resolve()]
    out = []
    for d in _tracking_dirs(run_dir):
        if any(d.resolve() == s or (s != skip[-1] and s in d.resolve().parents) for s in skip):
            continue
        if _spilled(d) and (d / "tracking.json").exists():
            nested = RunState(d).load().get("parent_run_dir") == str(Path(run_dir).resolve())
            out.append(_replay_tracker(d, None, parent.flush_timeout, parent=parent if nested else None))
    return out
