"""torch's intra-op threads per rank (issue 28.4): OMP_NUM_THREADS wins; else the process's
CPUs shared by the node's ranks, one left free, never below 1."""
import os
import subprocess
import sys

import pytest

from megarl.runtime.distributed import cpu_threads, local_ranks


def test_threads_follow_the_machine_and_the_override():
    assert cpu_threads({}, cpus=2) == (1, "2 CPUs / 1 local rank(s), one left free")
    assert cpu_threads({}, cpus=16)[0] == 15
    assert cpu_threads({"LOCAL_WORLD_SIZE": "8"}, cpus=96)[0] == 11
    assert cpu_threads({"SLURM_TASKS_PER_NODE": "4(x2)"}, cpus=32)[0] == 7
    assert cpu_threads({"LOCAL_WORLD_SIZE": "4"}, cpus=2)[0] == 1
    assert cpu_threads({}, cpus=1)[0] == 1
    assert cpu_threads({"OMP_NUM_THREADS": "3"}, cpus=2) == (3, "OMP_NUM_THREADS")
    assert cpu_threads({"OMP_NUM_THREADS": "", "LOCAL_WORLD_SIZE": "2"}, cpus=8)[0] == 3
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "8"}) == 8 and local_ranks({}) == 1


def test_a_stage_process_runs_the_chosen_threads():
    """init_distributed applies the choice (torch's default would be one thread per core)."""
    code = ("import os, torch\n"
            "from megarl.runtime.distributed import cpu_threads, init_distributed, teardown\n"
            "torch.set_num_threads(7)\n"
            "init_distributed(1, 1)\n"
            "print(torch.get_num_threads(), cpu_threads()[0])\n"
            "teardown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got, chosen = map(int, out.stdout.split()[-2:])
    assert got == chosen


# The first SFT losses of configs/tiny_sft.yaml at one thread (torch 2.13.0 CPU). A run at one
# thread is bit-reproducible: all 600 losses agreed between commits 509c93b and a45a861
# (docs/benchmarks.md, "Reproducibility"). The tolerance allows
# another CPU's kernels (AVX2 vs AVX-512), not another recipe, data or initialisation.
TINY_SFT_FIRST_LOSSES = [5.552021621196366, 5.546363630144484, 5.177226807111031, 4.881944418853184,
                         4.735785867081208]


def test_tiny_sft_first_losses_are_pinned(tmp_path):
    from megarl_run import env, megarl, metrics

    megarl(["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={tmp_path}", "train.steps=5",
            "lr_schedule.decay_steps=600", "train.eval_interval=0", "tracking.backend=none", "train.log_interval=1"])
    assert env()["OMP_NUM_THREADS"] == "1"
    losses = [m["train/loss"] for m in metrics(tmp_path / "sft")]
    assert losses == pytest.approx(TINY_SFT_FIRST_LOSSES, rel=1e-5, abs=0), losses
