"""The embedded MLflow store (`sqlite:///<run_dir>/mlflow.db`): created whole or not at all.

MLflow creates a SQLite store by running ~50 alembic migrations in place, and alembic's SQLite
DDL is not transactional: a process killed meanwhile (kill -9, OOM, a node lost) leaves a
half-migrated file (e.g. a leftover `_alembic_tmp_experiments` table) that every later run
fails on, silently, since tracking never stops training. So:

* a new store is built in a temp file next to it and hard-linked into place when complete (if
  another opener created one meanwhile, ours is dropped and theirs waited for);
* an existing store is checked first (schema at MLflow's head revision, every table present, no
  migration debris). A broken one that holds no run (which is what an interrupted creation
  leaves) is moved aside to `mlflow.db.broken-<time>` and recreated, with one warning; one that
  holds runs is left alone and `BrokenStore` says, in one line, what is wrong and what to do.

Only sqlite:/// URIs are touched; a tracking server or another database manages itself.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from pathlib import Path

log = logging.getLogger("megarl.tracking")

CREATING = ".creating-"  # <db>.creating-<pid>-<ns>: a store being built by process <pid>


class BrokenStore(RuntimeError):
    """An existing SQLite store MLflow cannot use and megarl will not replace; str(e) is one line."""


def sqlite_path(uri: str) -> Path | None:
    """The file of a `sqlite:///` URI, or None for anything else (servers, other databases, memory)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    return None if not path or path == ":memory:" else Path(path)


def prepare_store(uri: str) -> None:
    """Make the SQLite store of `uri` usable before MLflow opens it: create it atomically, or
    check it and replace a broken, empty one. Raises BrokenStore for a broken store with runs."""
    path = sqlite_path(uri)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with _dir_lock(path.parent):  # one creator or checker per directory (threads and processes)
        _remove_dead_creations(path)
        if path.exists():
            problem, runs = store_problem(path)
            if problem is None:
                return
            if runs:
                raise BrokenStore(
                    f"{path}: the MLflow store is unusable ({problem}) and holds {runs} run(s), so megarl leaves "
                    f"it as it is; back it up and run `mlflow db upgrade sqlite:///{path}`, or move it away for a "
                    f"new store (until then records wait in tracking_spill.jsonl; replay them with "
                    f"`python -m megarl.tracking replay {path.parent}`)")
            aside = path.with_name(f"{path.name}.broken-{time.strftime('%Y%m%d-%H%M%S')}")
            os.replace(path, aside)
            log.warning("megarl.tracking: %s was a half-created MLflow store (%s; no runs in it), probably from a "
                        "process killed while creating it; moved to %s and created anew", path, problem, aside.name)
        _create(path)


def store_problem(path: Path) -> tuple[str | None, int]:
    """(what is wrong with the store at `path` or None, how many runs it holds)."""
    from mlflow.store.db.utils import _get_latest_schema_revision
    from mlflow.store.tracking.dbmodels.models import Base

    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
            version = None
            if "alembic_version" in tables:
                row = con.execute("select version_num from alembic_version").fetchone()
                version = row[0] if row else None
            runs = con.execute("select count(*) from runs").fetchone()[0] if "runs" in tables else 0
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        return f"not a readable SQLite database: {e}", 0
    head = _get_latest_schema_revision()
    debris = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
    missing = sorted(set(Base.metadata.tables) - tables)
    if debris:
        return f"an interrupted schema migration left table {debris[0]}", runs
    if version != head:
        return f"schema version {version}, expected {head}", runs
    if missing:
        return f"table {missing[0]} missing", runs
    return None, runs


def _create(path: Path) -> None:
    """Build the store in a temp file, then link it into place (never a half-built `path`)."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # its INFO lines, at every retry
    tmp = path.with_name(f"{path.name}{CREATING}{os.getpid()}-{time.time_ns()}")
    uri = f"sqlite:///{tmp}"
    try:
        store = SqlAlchemyStore(uri, (path.parent / "mlartifacts").resolve().as_uri())
        store.engine.dispose()
        SqlAlchemyStore._engine_map.pop(uri, None)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # a plain MLflow client (e.g. `mlflow ui`) is creating it in place
            _wait_complete(path)
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + "-journal")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leftover)


def _wait_complete(path: Path, timeout: float = 120.0) -> None:
    """Until the store another opener is creating in place is complete (two migrating at once
    break it), or `timeout` seconds (then MLflow reports what is wrong)."""
    deadline = time.monotonic() + timeout
    while store_problem(path)[0] is not None and time.monotonic() < deadline:
        time.sleep(0.2)


def _remove_dead_creations(path: Path) -> None:
    """Temp stores of processes that died while building them."""
    for tmp in path.parent.glob(f"{path.name}{CREATING}*"):
        pid = tmp.name[len(path.name) + len(CREATING):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _dir_lock(directory: Path):
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
