"""torchrun, with the two changes pre-emption needs. Same arguments as torchrun.

1. Exit code: torchrun exits 1 whenever a worker fails; this exits with the first failed
   worker's code, so a trainer's 75 ("checkpointed, requeue me") reaches the SLURM script.
2. Signals: SIGUSR1 (SLURM's pre-emption warning) is handled like SIGTERM, i.e. forwarded to
   the workers, which then get MEGARL_GRACE_SECONDS (default 100) to checkpoint before SIGKILL.
   When torchrun itself was signalled (its graceful wait may be cut short by a second signal,
   e.g. SLURM's TERM arriving both directly and through srun), any worker still running is
   waited for here, with further signals ignored, and the exit code is 75.
"""
import os
import signal
import sys
import time

REQUEUE_EXIT = 75
_STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def _reap_children(deadline: float) -> None:
    """Wait (bounded) for worker processes that outlived torchrun's own shutdown wait."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no children left
        if pid == 0:
            time.sleep(0.2)


def main(argv=None) -> int:
    grace = os.environ.get("MEGARL_GRACE_SECONDS", "100")
    # torchrun reads its options from PET_* variables; older torch reads the TORCHELASTIC_ ones.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", _STOP_SIGNALS)
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", _STOP_SIGNALS)
    os.environ.setdefault("PET_SHUTDOWN_TIMEOUT", grace)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", grace)

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
        return 0
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        code = failure.exitcode
        code = 128 - code if code < 0 else code  # killed by signal N -> 128 + N, like a shell
        code = code if 0 < code < 256 else 1
    except SignalException as err:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        print(f"megarl torchrun: got {err.sigval.name}; waiting for workers to checkpoint", file=sys.stderr)
        _reap_children(time.monotonic() + float(grace))
        code = REQUEUE_EXIT
    if code == REQUEUE_EXIT:
        print("megarl torchrun: exit 75 (pre-empted); run the same command again to resume",
              file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    code = main()
    if code == REQUEUE_EXIT:
        # Leave without the interpreter's teardown: after an interrupted shutdown, the destructor
        # of torch's rendezvous store (a libuv server thread) can throw and abort the process,
        # which turns 75 into SIGABRT (seen once in a loaded full test run). Nothing is left to
        # clean up here: the workers have exited or been reaped.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
