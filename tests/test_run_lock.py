"""One training process per run directory (issue 27.3): a second run refuses in one line naming
the first; a lock whose holder is gone (killed, or a SLURM requeue) does not block a resume."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megarl_run import TINY, command, env, megarl


def _lock(directory, **fields):
    from megarl.trainers import run_lock

    record = run_lock.this_process("megarl sft --config x.yaml")
    record.update(fields)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, run_lock.LOCK_NAME), "w") as f:
        json.dump(record, f)
    return record


@pytest.fixture
def other_process():
    """A live process that is not this one (its pid stands for another megarl run)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p
    p.kill()
    p.wait()


def test_lock_names_a_live_holder_and_replaces_a_gone_one(tmp_path, other_process, monkeypatch):
    from megarl.trainers import run_lock

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    d = str(tmp_path / "sft")
    lock = os.path.join(d, run_lock.LOCK_NAME)
    held = _lock(d, pid=other_process.pid, proc_start=run_lock._proc_start(other_process.pid),
                 started="2026-11-25 18:40:02 UTC")
    with pytest.raises(run_lock.RunDirInUse) as e:
        run_lock.acquire(d, "megarl sft")
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{d} is in use by another megarl process: pid {other_process.pid} on host {socket.gethostname()}, " \
           "started 2026-11-25 18:40:02 UTC (megarl sft --config x.yaml)" in msg and lock in msg
    assert json.load(open(lock)) == held  # untouched

    # another host, another job: cannot be checked from here, so it holds
    _lock(d, pid=1, host="node-elsewhere")
    with pytest.raises(run_lock.RunDirInUse, match="on host node-elsewhere"):
        run_lock.acquire(d, "megarl sft")

    # gone: a dead pid; a reused pid (another start time); a SLURM requeue of the same job on another node
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [dict(pid=dead.pid), dict(pid=other_process.pid, proc_start="1"),
             dict(pid=other_process.pid, host="node-elsewhere", slurm_job_id="4242")]
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    for fields in stale:
        _lock(d, **fields)
        assert run_lock.acquire(d, "megarl sft") is True, fields
        assert json.load(open(lock))["pid"] == os.getpid()
        assert run_lock.acquire(d, "megarl sft") is False  # re-entrant: a pipeline's stage
        run_lock.release(d)
        assert not os.path.exists(lock)
    assert sorted(os.listdir(d)) == []  # no temp files left


def test_second_run_refuses_and_a_killed_run_does_not_block_the_next_run(tmp_path):
    run = tmp_path / "run"
    args = ["sft", "--config", "tiny_sft.yaml", *TINY, f"train.run_dir={run}", "train.eval_interval=0",
            "checkpoint.save_interval=2"]
    first = subprocess.Popen(command(args + ["train.steps=400"]), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=env())
    try:
        deadline = time.time() + 300
        while not (run / "sft" / "checkpoints" / "latest").exists():  # training: lock held, one save made
            assert first.poll() is None and time.time() < deadline, "the first run did not start training"
            time.sleep(0.5)
        assert json.load(open(run / "sft" / "megarl.lock"))["pid"] == first.pid
        second = megarl(args + ["train.steps=400"], check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"megarl: error: {run / 'sft'} is in use by another "
                                                       f"megarl process: pid {first.pid} on host "), lines
        first.send_signal(signal.SIGKILL)
        first.wait()
        with open(run / "sft" / "metrics.jsonl") as f:
            steps = [json.loads(line)["step"] for line in f]
        assert steps == sorted(set(steps))  # one writer: no interleaved steps
        # the killed run's lock is left behind; the next run takes it over and releases it at the end
        # (a short one: with train.steps=2 the stage is past its end, so it starts again explicitly)
        assert json.load(open(run / "sft" / "megarl.lock"))["pid"] == first.pid
        resumed = megarl(args + ["train.steps=2", "checkpoint.resume=false"])
        assert "in use" not in resumed.stderr
        assert not (run / "sft" / "megarl.lock").exists()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_pipeline_lock_is_reentrant_for_its_stages_and_blocks_other_processes(tmp_path):
    """A pipeline's stages take the run dir's lock in turn without blocking each other; while it
    holds it, another process's training stage refuses and `megarl eval` does not."""
    from megarl.trainers import run_lock
    from megarl.trainers.session import _lock

    run = str(tmp_path / "run")
    assert _lock(run, os.path.join(run, "sft"), "sft", pipeline=True)
    run_lock.release(os.path.join(run, "sft"))
    assert _lock(run, os.path.join(run, "reward_model"), "reward_model", pipeline=True)
    probe = ("import sys\nfrom megarl.trainers.session import _lock\n"
             "try:\n    _lock(sys.argv[1], sys.argv[1] + '/' + sys.argv[2], sys.argv[2], pipeline=False)\n"
             "except Exception as e:\n    print(e)\nelse:\n    print('ok')\n"
             "    from megarl.trainers.run_lock import release\n    release(sys.argv[1] + '/' + sys.argv[2])\n")
    outs = [subprocess.run([sys.executable, "-c", probe, run, stage], capture_output=True, text=True, env=env(),
                           check=True).stdout.strip() for stage in ("rl", "eval", "reward_model")]
    assert outs[0].startswith(f"{run} is in use by another megarl process: pid {os.getpid()}"), outs
    assert outs[1] == "ok"
    assert outs[2].startswith(f"{run} is in use"), outs
    run_lock.release(os.path.join(run, "reward_model"))
    run_lock.release(run)
    assert not any(f.endswith(".lock") for _, _, fs in os.walk(run) for f in fs)


def test_a_pipeline_waits_for_no_eval_but_refuses_beside_a_training_stage(tmp_path, other_process, monkeypatch):
    from megarl.trainers import run_lock
    from megarl.trainers.session import _lock as session_lock

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = str(tmp_path / "run")
    live = dict(pid=other_process.pid, proc_start=run_lock._proc_start(other_process.pid))
    _lock(os.path.join(run, "eval"), **live)  # `megarl eval` in another process
    assert session_lock(run, os.path.join(run, "sft"), "sft", pipeline=True)
    run_lock.release(os.path.join(run, "sft"))
    run_lock.release(run)
    _lock(os.path.join(run, "rl"), **live)  # `megarl rl` in another process
    with pytest.raises(run_lock.RunDirInUse, match=f"{run}/rl is in use by another megarl process: pid {other_process.pid}"):
        session_lock(run, os.path.join(run, "sft"), "sft", pipeline=True)
    run_lock.release(run)
    assert not os.path.exists(os.path.join(run, "sft", run_lock.LOCK_NAME))
