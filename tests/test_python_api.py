"""The Python API as the README shows it, run the ways people run Python (issue 28.1), and helper
processes that the job's signals never reach (issue 27.11): megarl starts no process that
re-imports the user's `__main__`, and every process it starts ignores SIGTERM/SIGINT from its
first instruction (the main process owns pre-emption)."""
import multiprocessing
import os
import pickle
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megarl.checkpoint.write_results import FileQueue
from megarl_run import TINY, command, env

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------- the README's snippet

RUN_DIR_OVERRIDE = '"train.run_dir=runs/notebook"'
# Every stage a step or two on a one-layer model: the point is the first checkpoint (where the
# spawned results server re-imported __main__), not learning.
SHRINK = ("model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=2",
          "model.num_kv_heads=1", "tracking.backend=none", "data.micro_batch_size=4", "data.global_batch_size=8",
          *(f"stages.{s}.{key}" for s in ("sft", "rm", "rl") for key in ("train.eval_interval=0", "lr_schedule.warmup_steps=0")),
          "stages.sft.train.steps=2",
          "stages.sft.sft.eval_samples=0", "stages.rm.train.steps=2", "stages.rm.data.global_batch_size=8",
          "stages.rl.train.steps=1", "stages.rl.rl.prompts_per_step=2", "stages.rl.rl.samples_per_prompt=2",
          "stages.rl.rl.micro_batch_size=4", "stages.rl.rl.max_new_tokens=4", "stages.rl.rl.eval_prompts=2")


def readme_snippet() -> str:
    """The ```python block after README.md's "From Python"."""
    text = (REPO / "README.md").read_text()
    match = re.search(r"From Python.*?\n```python\n(.*?)\n```", text, re.S)
    assert match, "README.md: no ```python block after 'From Python'"
    return match[1]


def shrunk_snippet(run_dir: Path) -> str:
    code = readme_snippet()
    assert code.count(RUN_DIR_OVERRIDE) == 1, code
    return code.replace(RUN_DIR_OVERRIDE, ", ".join(f'"{o}"' for o in (f"train.run_dir={run_dir}", *SHRINK)))


def _run_python(how: str, code: str, cwd: Path) -> subprocess.CompletedProcess:
    script = cwd / "my_api.py"
    script.write_text(code + "\n")
    argv, stdin = {"script": ([sys.executable, str(script)], None),          # no main guard
                   "stdin": ([sys.executable, "-"], code),                  # python - < my_api.py
                   "dash_c": ([sys.executable, "-c", code], None),
                   "interactive": ([sys.executable, "-i"], code)}[how]      # a REPL / notebook: no __file__
    return subprocess.run(argv, input=stdin, cwd=cwd, env=env(), capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["script", "stdin", "dash_c", "interactive"])
def test_readme_python_example_runs_as_written(tmp_path, how):
    """From a directory of the user's (the recipes ship in the package): the whole pipeline once,
    every stage's checkpoint written, nothing re-run by a helper process."""
    run_dir = tmp_path / "runs" / "notebook"
    out = _run_python(how, shrunk_snippet(run_dir), tmp_path)
    log = out.stdout[-3000:] + out.stderr[-5000:]
    assert out.returncode == 0, log
    assert "Traceback" not in out.stderr, log  # python -i exits 0 after an exception
    for stage, steps in (("sft", 2), ("reward_model", 2), ("rl", 1)):
        latest = run_dir / stage / "checkpoints" / "latest"
        assert latest.read_text().strip() == f"step_{steps:08d}", (stage, log)
    assert len(re.findall(r"megarl sft: world size", out.stdout + out.stderr)) == 1, log  # one pipeline, not two


# ---------------------------------------------------------------------------- signals at helper start


def _signal_each_new_helper(proc: subprocess.Popen, count: int, deadline: float) -> set:
    """SIGTERM then SIGINT to each new child process of `proc` as soon as it appears, until
    `count` were signalled alive; returns the pids seen."""
    parent, seen, signalled = psutil.Process(proc.pid), set(), 0
    while signalled < count and proc.poll() is None and time.time() < deadline:
        try:
            children = parent.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for child in children:
            if child.pid in seen:
                continue
            seen.add(child.pid)
            try:
                os.kill(child.pid, signal.SIGTERM)
                os.kill(child.pid, signal.SIGINT)
                signalled += 1
            except ProcessLookupError:  # it ended before we saw it
                pass
        time.sleep(0.002)
    assert signalled >= count, f"only {signalled} helper processes signalled (run ended: {proc.poll()})"
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("checkpoint.async_save=true",), ("data.num_workers=1",)],
                         ids=["sync_save", "async_save", "dataloader_workers"])
def test_helpers_survive_signals_sent_as_they_start(tmp_path, extra):
    """A checkpoint every step: 20 helper processes (checkpoint writers, data workers) get SIGTERM
    and SIGINT right after they appear, and the run goes on; then the whole process group gets
    SIGTERM right as the next helper starts: a clean pre-emption (checkpoint, exit 75)."""
    from megarl.checkpoint.distributed import latest_checkpoint

    run = tmp_path / "run"
    args = ["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={run}", *TINY, "train.steps=1000",
            "train.eval_interval=0", "checkpoint.save_interval=1", "sft.eval_samples=0", *extra]
    proc = subprocess.Popen(command(args), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=REPO)
    try:
        seen = _signal_each_new_helper(proc, 20, time.time() + 240)
        parent = psutil.Process(proc.pid)
        while proc.poll() is None and not {c.pid for c in parent.children(recursive=True)} - seen:
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, (out[-2000:], err[-4000:])
    assert "pre-empted at step" in err
    checkpoints = run / "sft" / "checkpoints"
    assert latest_checkpoint(str(checkpoints)) is not None  # verified: every file, every size
    assert not [d for d in os.listdir(checkpoints) if d.startswith(".tmp")]


# ---------------------------------------------------------------------------- FileQueue


def _put_all(q, items):
    for item in items:
        q.put(item)


class _Unpicklable(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.callback = lambda: None  # a lambda does not pickle


def test_file_queue_hands_results_of_any_size_from_forked_processes_in_order():
    """What megatron's writers need: put() in a forked process that then exits (a pipe-backed
    queue would block that exit on a full pipe: 4 MiB here), get_nowait() afterwards, FIFO."""
    q = FileQueue()
    big = os.urandom(4 << 20)
    ctx = multiprocessing.get_context("fork")
    first = ctx.Process(target=_put_all, args=(q, [{"rank": 0, "results": [1, 2]}, big]))
    first.start()
    first.join(timeout=60)
    assert first.exitcode == 0
    second = ctx.Process(target=_put_all, args=(q, [_Unpicklable("disk on fire")]))
    second.start()
    second.join(timeout=60)
    assert second.exitcode == 0
    assert q.get_nowait() == {"rank": 0, "results": [1, 2]}
    assert q.get_nowait() == big
    err = q.get_nowait()
    assert isinstance(err, RuntimeError) and "disk on fire" in str(err)
    with pytest.raises(queue.Empty):
        q.get_nowait()
    assert os.fstat(q._fd).st_size == 0  # read to the end: the file starts over
    q.put("again")
    assert q.get_nowait() == "again"
    with pytest.raises(TypeError, match="forked"):
        pickle.dumps(q)
