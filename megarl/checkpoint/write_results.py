"""The queue on which megatron-core's checkpoint writers hand back their results: a file, not a process.

megatron-core's FileSystemWriterAsync puts each rank's write results (or the writer's exception)
on one module-level queue, from the process that wrote the files (forked for the write, or this
one), and reads them back with get_nowait() once that process has ended. Its default is a queue
served by a multiprocessing Manager started with spawn: a second interpreter that re-imports the
user's `__main__` (a script without a main guard runs its pipeline twice; stdin and notebooks
cannot be re-imported) and that a job's SIGTERM can kill before it has set up its signal handling
(the pre-emption checkpoint then fails). This queue is an unlinked temporary file in append
mode: forked writers inherit its descriptor, put() appends one length-prefixed pickle under a
POSIX record lock (a record is whole or absent), get_nowait() reads the next whole one. No
process to start or to kill, no pipe to fill (results of any size), nothing left on disk.
"""
from __future__ import annotations

import fcntl
import os
import pickle
import queue
import struct
import tempfile
import weakref
from contextlib import contextmanager

_LENGTH = struct.Struct("<Q")  # the payload's size in bytes, before each record


class FileQueue:
    """FIFO of picklable objects shared with forked processes; one reader (the creating process)."""

    def __init__(self, directory: str | None = None):
        fd, path = tempfile.mkstemp(prefix="megarl-write-results-", dir=directory)
        os.unlink(path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._fd = fd
        self._read_at = 0  # the next record's offset; only the reader moves it
        self._finalizer = weakref.finalize(self, os.close, fd)

    def __getstate__(self):
        raise TypeError("FileQueue reaches forked processes only (its descriptor is not picklable)")

    def put(self, item, block: bool = True, timeout: float | None = None) -> None:
        try:
            payload = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            if not isinstance(item, BaseException):
                raise
            payload = pickle.dumps(RuntimeError(f"{type(item).__name__}: {item}"))  # the message survives
        record = memoryview(_LENGTH.pack(len(payload)) + payload)
        with _locked(self._fd):
            start = os.lseek(self._fd, 0, os.SEEK_END)
            try:
                while record:
                    record = record[os.write(self._fd, record):]
            except BaseException:
                os.ftruncate(self._fd, start)  # never a partial record
                raise

    def get_nowait(self):
        header = os.pread(self._fd, _LENGTH.size, self._read_at)
        if len(header) < _LENGTH.size:
            raise queue.Empty
        (size,) = _LENGTH.unpack(header)
        payload = os.pread(self._fd, size, self._read_at + _LENGTH.size)
        if len(payload) < size:
            raise queue.Empty
        self._read_at += _LENGTH.size + size
        with _locked(self._fd):  # all read: start the file over, so that it never grows
            if os.fstat(self._fd).st_size == self._read_at:
                os.ftruncate(self._fd, 0)
                self._read_at = 0
        return pickle.loads(payload)


@contextmanager
def _locked(fd: int):
    """An exclusive POSIX record lock on the whole file (held per process: it excludes forked ones,
    which share the descriptor; flock would not)."""
    fcntl.lockf(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.lockf(fd, fcntl.LOCK_UN)
