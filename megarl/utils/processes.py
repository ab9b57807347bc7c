"""Helper processes that the job's signals never reach: the main process owns pre-emption.

SLURM (pre-emption, requeue, scancel, time limit), srun and `kill -TERM -PGID` signal every
process of the job, helpers included; Ctrl-C signals the terminal's whole process group. A
helper that dies of it (a checkpoint writer, a data worker) turns a clean pre-emption (the main
process checkpoints and exits 75) into a failed one. A process inherits the signal mask of the
thread that forks it and keeps it across exec, so a helper started inside `signals_blocked()`
has those signals blocked from its first instruction (they stay pending, never delivered;
SIGKILL still ends it). The calling thread's own mask is restored on exit, and a signal that
arrived meanwhile is then handled as usual.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


@contextmanager
def signals_blocked(signals=JOB_SIGNALS):
    """Block `signals` in the calling thread, so that processes started meanwhile never see them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
