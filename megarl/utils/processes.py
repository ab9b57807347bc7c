"""Helper processes that the job's signals never reach: the main process owns pre-emption.

SLURM (pre-emption, requeue, scancel, time limit), srun and `kill -TERM -PGID` signal every
process of the job, helpers included; Ctrl-C signals the terminal's whole process group. A
helper that dies of it (a checkpoint writer, a data worker) turns a clean pre-emption (the main
process checkpoints and exits 75) into a failed one. A process inherits the signal mask of the
thread that forks it and keeps it across exec, so a helper started inside `signals_blocked()`
has those signals blocked from its first instruction (they stay pending, never delivered;
SIGKILL still ends it). The calling thread's own mask is restored on exit, and a signal that
arrived meanwhile is then handled as usual.

Such a helper would also outlive the process that started it: when the trainer is killed
(SIGKILL, the OOM killer, `scancel --signal=KILL`) mid-save, a forked checkpoint writer that
ignores the job's signals sleeps on forever, holding its memory. So on Linux a process forked
(os.fork, multiprocessing's fork) inside `signals_blocked()` gets SIGKILL when the thread that
forked it ends (PR_SET_PDEATHSIG), and ends at once if that process is already gone; the
processes it forks inside the block in turn die with it. Processes started by exec (subprocess,
multiprocessing's spawn) are not affected.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from contextlib import contextmanager

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1

_blocked = threading.local()  # .depth: open signals_blocked() blocks; .pid: the process they are in
_prctl = []  # libc's prctl, once the fork hook is registered (Linux only)


def _die_with_parent():
    """os.fork's after-in-child hook: inside signals_blocked(), the child gets SIGKILL when its
    parent's forking thread ends, and ends now if the parent is already gone."""
    if not getattr(_blocked, "depth", 0) or not _prctl:
        return
    _prctl[0](PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != _blocked.pid:  # the parent died before the line above
        os._exit(1)
    _blocked.pid = os.getpid()  # the parent of the processes this one forks inside the block


def _register_fork_hook():
    if _prctl or not sys.platform.startswith("linux"):
        return
    try:
        _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
    except (OSError, AttributeError):
        return
    os.register_at_fork(after_in_child=_die_with_parent)


@contextmanager
def signals_blocked(signals=JOB_SIGNALS):
    """Block `signals` in the calling thread, so that processes started meanwhile never see them;
    processes forked meanwhile die with this one (module docstring)."""
    _register_fork_hook()
    depth = getattr(_blocked, "depth", 0)
    _blocked.depth, _blocked.pid = depth + 1, os.getpid()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        _blocked.depth = depth
