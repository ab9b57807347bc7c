"""Helpers forked inside `signals_blocked()` (checkpoint writers, data workers) ignore the job's
signals, so they must not outlive the process that forked them (megarl/utils/processes.py): a
trainer killed mid-save would otherwise leave a writer sleeping forever."""
import os
import subprocess
import sys
import time

import psutil
import pytest

SCRIPT = """
import multiprocessing, signal, time
from megarl.utils.processes import signals_blocked

def sleeper():
    time.sleep(120)

ctx = multiprocessing.get_context("fork")
with signals_blocked():
    inside = ctx.Process(target=sleeper)
    inside.start()
outside = ctx.Process(target=sleeper)
outside.start()
print(inside.pid, outside.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_helper_forked_inside_signals_blocked_dies_with_the_process_that_forked_it():
    parent = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True)
    inside = outside = None
    try:
        inside, outside = map(int, parent.stdout.readline().split())
        assert _alive(inside) and _alive(outside)
        os.kill(inside, 15)  # the job's SIGTERM does not reach it (what signals_blocked is for)
        time.sleep(0.5)
        assert _alive(inside), "a helper forked inside signals_blocked() must ignore SIGTERM"
        parent.kill()  # SIGKILL: no handler, no cleanup (the OOM killer, scancel --signal=KILL)
        parent.wait()
        deadline = time.time() + 10
        while _alive(inside) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(inside), "the helper outlived the process that forked it"
        assert _alive(outside), "a process forked outside the block is not affected"
    finally:
        parent.kill()
        for pid in (inside, outside):
            if pid is not None and _alive(pid):
                os.kill(pid, 9)
