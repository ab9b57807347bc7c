"""Atomic writes: a crash never leaves a half-written file or directory behind.

The one place megarl writes a file atomically (`write_atomic`: configs, manifests, `latest`
pointers, tracking state, model.yaml) or a directory of files (`atomic_directory`: datasets,
shards, HF exports).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def as_created(path: str, directory: bool = False) -> None:
    """The mode open()/mkdir() would have given `path` (mkstemp/mkdtemp make it private: 0600/0700),
    so an atomically written output is as readable as any other."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike, text: str, *, durable: bool = True) -> None:
    """Replace `path` with `text` in one step: readers see the old file or the new one, never a
    part. The temporary file is unique, so concurrent writers never share it. `durable` also
    fsyncs the file and its directory (a power cut keeps the new file once this returns)."""
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    try:
        as_created(tmp, directory=False)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(parent)


@contextmanager
def atomic_directory(out_dir: str, replace: bool = False, last: tuple[str, ...] = ()):
    """Yield a temporary directory to write into; move its files into out_dir only on success.

    If out_dir does not exist, the temporary directory is renamed onto it (one atomic step).
    If it exists: replace=True swaps the whole directory (old contents removed); replace=False
    moves each file in with os.replace (each file atomic; other files in out_dir untouched), the
    files named in `last` (e.g. an index) after all the others. On error the temporary is deleted.
    """
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        as_created(tmp, directory=True)
        yield tmp
        if not os.path.exists(out_dir):
            os.rename(tmp, out_dir)
        elif replace:
            trash = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.rename(out_dir, os.path.join(trash, "old"))
            os.rename(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            names = sorted(os.listdir(tmp), key=lambda n: (n in last, n))
            for name in names:
                os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
            os.rmdir(tmp)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
