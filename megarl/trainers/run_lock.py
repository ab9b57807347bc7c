"""One writer per run directory: `<dir>/megarl.lock` names the process that trains there.

    taken = acquire(stage_dir, "megarl rl ...")   # RunDirInUse (one line) if another process holds it
    ...
    release(stage_dir)                             # (stage_session does both, on rank 0)

Two runs on one stage directory would interleave metrics.jsonl and write the same checkpoint
directories, so the second refuses, naming the first (pid, host, start time, command). A lock
whose holder is gone does not block a resume: on this host, its pid is dead or is another
process now (pid reuse: the kernel's start time differs); under SLURM, a requeue of the same
job id (possibly on another node) replaces the lock of the job's previous incarnation. A lock
held on another host by another job cannot be checked from here: the message names the file
to delete if that process is gone.

The lock file is made whole before it appears (written to a temp file, then hard-linked into
place, which fails if a lock exists), so a reader never sees half a lock.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time

from megarl.config import ConfigError

LOCK_NAME = "megarl.lock"


class RunDirInUse(ConfigError):
    """Another live process holds the directory's lock; str(e) is one line naming it."""


def _proc_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def this_process(command: str) -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "proc_start": _proc_start(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": command,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT", "0")}


def is_self(holder: dict, me: dict) -> bool:
    return holder.get("host") == me["host"] and holder.get("pid") == me["pid"] and \
        holder.get("proc_start") == me["proc_start"]


def is_stale(holder: dict, me: dict) -> bool:
    """True when the holder is known to be gone (see the module docstring)."""
    job = holder.get("slurm_job_id")
    if job and job == me["slurm_job_id"] and not is_self(holder, me):
        if holder.get("host") != me["host"] or holder.get("slurm_restart_count") != me["slurm_restart_count"]:
            return True  # the same job, requeued: its previous incarnation is gone
    if holder.get("host") != me["host"]:
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return True
    start = _proc_start(pid)
    return holder.get("proc_start") is not None and start is not None and start != holder["proc_start"]


def read_holder(path: str) -> dict | None:
    """The lock's record, {} for an unreadable one (treated as stale), None if there is no lock."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"
            + (f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else "")
            + (f" ({holder['command']})" if holder.get("command") else ""))


def in_use_error(directory: str, path: str, holder: dict) -> RunDirInUse:
    return RunDirInUse(f"{directory} is in use by another megarl process: {describe(holder)}; wait for it to end "
                       f"or stop it (if that process is gone, delete {path})")


def live_holder(path: str, me: dict) -> dict | None:
    """The record of another live process holding `path`, else None (no lock, ours, or stale)."""
    holder = read_holder(path)
    if holder is None or is_self(holder, me) or is_stale(holder, me):
        return None
    return holder


def check_free(directory: str) -> None:
    """Raise RunDirInUse if another live process holds `<directory>/megarl.lock`."""
    path = os.path.join(directory, LOCK_NAME)
    holder = live_holder(path, this_process(""))
    if holder is not None:
        raise in_use_error(directory, path, holder)


def check_stages_free(run_dir: str, ignore=()) -> None:
    """Raise RunDirInUse if another live process holds a lock of one of run_dir's stage dirs
    (but those named in `ignore`)."""
    if os.path.isdir(run_dir):
        for name in sorted(os.listdir(run_dir)):
            if name not in ignore and os.path.isdir(os.path.join(run_dir, name)):
                check_free(os.path.join(run_dir, name))


def acquire(directory: str, command: str) -> bool:
    """Take `<directory>/megarl.lock`; True if this call took it, False if this process already
    held it (a pipeline's stage). Raises RunDirInUse if another live process holds it."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_NAME)
    me = this_process(command)
    tmp = f"{path}.{me['pid']}.{time.time_ns()}.tmp"
    with open(tmp, "w") as f:
        json.dump(me, f)
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # atomic, and fails if a lock exists
                return True
            except FileExistsError:
                pass
            holder = read_holder(path)
            if holder is None:
                continue  # released meanwhile
            if is_self(holder, me):
                return False
            if not is_stale(holder, me):
                raise in_use_error(directory, path, holder)
            # stale: replace it only if it is still the lock we judged (another process may
            # have replaced it meanwhile), then check we hold it
            if read_holder(path) == holder:
                os.replace(tmp, path)
                if read_holder(path) == me:
                    return True
                raise in_use_error(directory, path, read_holder(path) or {})
        raise in_use_error(directory, path, read_holder(path) or {})
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def release(directory: str) -> None:
    """Remove the lock if this process holds it."""
    path = os.path.join(directory, LOCK_NAME)
    holder = read_holder(path)
    if holder and is_self(holder, this_process("")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
