"""The SLURM launch path end to end on a real two-node cluster on localhost (tests/slurm_cluster.py):
launchers/slurm/megarl.sbatch -> srun -> torchrun per node (c10d rendezvous on node 0) or one
srun task per rank -> gloo across the two "nodes" -> MLflow through megarl.tracking. Plus
pre-emption: `scontrol requeue` mid-run and SLURM's time-limit warning (SIGUSR1 to the batch
script) must both end in a resumed job with the same final numbers as an uninterrupted run.
The real trainers go through the same path: `megarl sft` and `megarl rl` (GRPO), each requeued
mid-run and compared with an uninterrupted job.

The workload is a stand-in trainer defined at the bottom of this file (run as
`python tests/test_slurm.py standin ...`), which follows megarl's trainer contract: checkpoint at
a step boundary on SIGTERM/SIGUSR1, exit 75, resume from the checkpoint when rerun.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable  # tests/ is on sys.path, also in jobs

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "launchers" / "slurm" / "megarl.sbatch"
STEPS, SLEEP = 12, 0.3  # a few seconds of "training"; interrupted runs are held at step 3

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def _job_env(**extra) -> dict:
    return {"MEGARL_DEVICE": "cpu", "PYTHONPATH": str(REPO), "MEGARL_GRACE_SECONDS": "30",
            "MLFLOW_TRACKING_URI": "", **extra}


def submit_standin(cluster, workdir: Path, name: str, *, launcher: str = "torchrun",
                   hold_at: int = -1) -> tuple[str, Path]:
    """The stand-in trainer on 2 nodes x 1 CPU rank through the generic sbatch script."""
    run_dir = workdir / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    job = cluster.submit(
        SBATCH, "--", sys.executable, str(Path(__file__).resolve()), "standin",
        "--run-dir", str(run_dir), "--steps", str(STEPS), "--sleep", str(SLEEP), "--hold-at", str(hold_at),
        sbatch_args=["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1", f"--job-name={name}"],
        env=_job_env(MEGARL_LAUNCHER=launcher), cwd=workdir)
    return job, run_dir


def job_log(workdir: Path, name: str, job: str) -> str:
    path = workdir / "logs" / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no log at {path})"


def assert_completed(cluster, info: dict, log: str) -> None:
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", \
        f"job ended {info.get('JobState')} {info.get('ExitCode')}\n--- job log ---\n{log}\n{cluster.daemon_logs()}"


def loss_history(run_dir: Path) -> tuple[str, set, list]:
    from mlflow.tracking import MlflowClient

    state = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(state["tracking_uri"])
    points = {(m.step, m.value) for m in client.get_metric_history(state["run_id"], "train/loss")}
    runs = client.search_runs([state["experiment_id"]])
    return state["run_id"], points, runs


def wait_held(cluster, run_dir: Path, timeout: float = 240) -> str:
    """Wait until the stand-in idles at its --hold-at step with its MLflow run created; return
    the run id. The interruption then certainly lands mid-run, however slow the machine is."""
    def ready():
        try:
            held = json.loads((run_dir / "progress.json").read_text()).get("held")
            run_id = json.loads((run_dir / "tracking.json").read_text()).get("run_id")
        except (OSError, ValueError):
            return None
        return run_id if held else None

    return cluster.wait_for(ready, timeout, f"{run_dir.name} to be held mid-run")


def test_one_sbatch_script_takes_the_stage():
    """One job script for every stage (no per-stage copies to drift apart); a submission
    without STAGE CONFIG stops at once with the usage line, before anything else runs."""
    # (doctor.sbatch checks a node with `megarl doctor`; it runs no stage)
    assert sorted(p.name for p in SBATCH.parent.glob("*.sbatch")) == ["doctor.sbatch", "megarl.sbatch"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for args in ([], ["sft"], ["--"]):
        out = subprocess.run(["bash", str(SBATCH), *args], capture_output=True, text=True, env=env, timeout=30)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("usage: sbatch [options] megarl.sbatch STAGE CONFIG"), (args, out.stderr)


@pytest.fixture(scope="module")
def cluster():
    try:
        c = SlurmCluster(nodes=("n1", "n2"), cpus_per_node=4, kill_wait=30)
        c.start()
    except SlurmUnavailable as exc:
        print(f"SKIP test_slurm: {exc}")
        pytest.skip(str(exc))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm_jobs")


@pytest.fixture(scope="module")
def jobs(cluster, workdir):
    """All jobs submitted at once (they run side by side): name -> (job id, run dir)."""
    return {
        "baseline": submit_standin(cluster, workdir, "baseline"),  # uninterrupted reference
        "srunmode": submit_standin(cluster, workdir, "srunmode", launcher="srun"),
        "requeued": submit_standin(cluster, workdir, "requeued", hold_at=3),
        "usr1": submit_standin(cluster, workdir, "usr1", hold_at=3),
    }


@pytest.fixture(scope="module")
def baseline(cluster, workdir, jobs):
    job, run_dir = jobs["baseline"]
    info = cluster.wait(job, timeout=300)
    assert_completed(cluster, info, job_log(workdir, "baseline", job))
    return job, run_dir, json.loads((run_dir / "final.json").read_text())

@pytest.mark.slurm
def test_two_nodes_torchrun_rendezvous_and_tracking(cluster, workdir, baseline):
    job, run_dir, final = baseline
    assert final["world_size"] == 2 and sorted(final["nodes"]) == ["n1", "n2"]
    assert final["resumed_from"] == 0 and final["steps_run"] == STEPS
    run_id, points, runs = loss_history(run_dir)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    assert runs[0].data.params["standin.world_size"] == "2"
    assert runs[0].data.tags["nodes"] == "n1,n2"
    assert sorted(points) == sorted(map(tuple, final["losses"])) and len(points) == STEPS
    log = job_log(workdir, "baseline", job)
    assert "[megarl] job" in log and "launcher=torchrun" in log and "training exited 0" in log

@pytest.mark.slurm
def test_two_nodes_srun_mode(cluster, workdir, jobs, baseline):
    job, run_dir = jobs["srunmode"]
    info = cluster.wait(job, timeout=300)
    assert_completed(cluster, info, job_log(workdir, "srunmode", job))
    final = json.loads((run_dir / "final.json").read_text())
    assert sorted(final["nodes"]) == ["n1", "n2"] and final["w"] == baseline[2]["w"]
    assert "launcher=srun" in job_log(workdir, "srunmode", job)

def _check_resumed_like_baseline(cluster, workdir, name, job, run_dir, run_id_before, baseline):
    info = cluster.wait(job, timeout=300)
    log = job_log(workdir, name, job)
    assert_completed(cluster, info, log)
    assert int(info["Restarts"]) >= 1, info
    final = json.loads((run_dir / "final.json").read_text())
    assert final["resumed_from"] == 3, final  # the checkpoint written before the hold
    assert final["w"] == baseline[2]["w"] and final["loss"] == baseline[2]["loss"]
    run_id, points, runs = loss_history(run_dir)
    assert run_id == run_id_before and len(runs) == 1  # the same MLflow run continued
    assert runs[0].info.status == "FINISHED"
    assert points == set(map(tuple, baseline[2]["losses"]))  # same curve, nothing missing
    assert log.count("[megarl] job") >= 2 and "restart 1" in log
    return log

@pytest.mark.slurm
def test_scontrol_requeue_resumes_from_checkpoint(cluster, workdir, jobs, baseline):
    name = "requeued"
    job, run_dir = jobs[name]
    run_id_before = wait_held(cluster, run_dir)
    cluster.run("scontrol", "requeue", job)
    _check_resumed_like_baseline(cluster, workdir, name, job, run_dir, run_id_before, baseline)

@pytest.mark.slurm
def test_time_limit_warning_checkpoints_and_self_requeues(cluster, workdir, jobs, baseline):
    """What `#SBATCH --signal=B:USR1@120` does before the time limit: USR1 to the batch
    script only -> forwarded to the ranks -> checkpoint, exit 75 -> job.sh requeues."""
    name = "usr1"
    job, run_dir = jobs[name]
    run_id_before = wait_held(cluster, run_dir)
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    log = _check_resumed_like_baseline(cluster, workdir, name, job, run_dir, run_id_before, baseline)
    assert "got SIGUSR1" in log and "training exited 75" in log and "requeueing job" in log

# The project's own trainer through its own sbatch script: `megarl sft` on 2 nodes (DP=2 over
# gloo between the "nodes"), then the same job requeued mid-run.
TRAINER_STEPS = 80
TRAINER_ARGS = ("model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                "data.micro_batch_size=8", "data.global_batch_size=16", f"train.steps={TRAINER_STEPS}",
                "train.eval_interval=0", "train.log_interval=10", "checkpoint.save_interval=4",
                "lr_schedule.warmup_steps=2")


def submit_trainer(cluster, workdir: Path, name: str) -> tuple[str, Path]:
    run_dir = workdir / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    job = cluster.submit(SBATCH, "sft", str(REPO / "configs" / "tiny_sft.yaml"), f"train.run_dir={run_dir}",
                         *TRAINER_ARGS, sbatch_args=["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1",
                                                     f"--job-name={name}"], env=_job_env(), cwd=workdir)
    return job, run_dir


def trainer_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock figures (perf/), which no two runs repeat."""
    from megarl_run import metrics

    return metrics(str(run_dir / "sft"))


def mlflow_losses(run_dir: Path) -> tuple[str, list[float]]:
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "sft" / "tracking.json").read_text())["run_id"]
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    by_step = {m.step: m.value for m in history}  # delivery is at-least-once: one value per step
    return run_id, [by_step[s] for s in sorted(by_step)]


def sft_run_ids(run_dir: Path) -> list[str]:
    """Every MLflow run of the sft stage in the run dir's store (a requeue must not add one)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string="tags.`megarl.stage` = 'sft'")
    return [r.info.run_id for r in runs]


@pytest.fixture(scope="module")
def trainer_baseline(cluster, workdir):
    job, run_dir = submit_trainer(cluster, workdir, "trainer")
    info = cluster.wait(job, timeout=400)
    assert_completed(cluster, info, job_log(workdir, "trainer", job))
    return run_dir


@pytest.mark.slurm
def test_megarl_trainer_on_two_nodes(trainer_baseline):
    run_dir = trainer_baseline
    steps = trainer_metrics(run_dir)
    assert [m["step"] for m in steps] == list(range(1, TRAINER_STEPS + 1))
    assert steps[-1]["train/loss"] < steps[0]["train/loss"]
    assert (run_dir / "sft" / "checkpoints" / "latest").read_text().strip() == f"step_{TRAINER_STEPS:08d}"
    _, losses = mlflow_losses(run_dir)
    assert losses == [m["train/loss"] for m in steps], "MLflow holds every step's loss"


@pytest.mark.slurm
def test_megarl_trainer_requeued_mid_run_resumes(cluster, workdir, trainer_baseline):
    job, run_dir = submit_trainer(cluster, workdir, "trainer-requeued")
    latest = run_dir / "sft" / "checkpoints" / "latest"
    cluster.wait_for(latest.exists, timeout=300, what="a first checkpoint before the requeue")
    cluster.run("scontrol", "requeue", job)
    info = cluster.wait(job, timeout=500)
    log = job_log(workdir, "trainer-requeued", job)
    assert_completed(cluster, info, log)
    assert int(info.get("Restarts", "0")) >= 1, f"the job was not requeued\n{log}"
    assert "resumed sft from" in log, log[-3000:]
    assert "sft: pre-empted at step" in log, log[-3000:]  # the pre-emption checkpoint was written
    assert trainer_metrics(run_dir) == trainer_metrics(trainer_baseline)  # the same run, exactly
    run_id, losses = mlflow_losses(run_dir)
    assert sft_run_ids(run_dir) == [run_id], "the resumed job must continue the same MLflow run"
    assert losses == [m["train/loss"] for m in trainer_metrics(trainer_baseline)]


# The RL stage through the same script: `megarl rl` (GRPO, actor + reference from a random
# initialisation, the dense digits reward of tests/rl_rewards.py so that every step moves the
# weights) on 2 nodes x 1 CPU rank (DP=2 over gloo), once uninterrupted and once requeued with
# `scontrol requeue` after its first checkpoint. Both jobs run side by side.
RL_STEPS, RL_SAVE_INTERVAL = 24, 4
RL_ARGS = ("model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
           "model.num_attention_heads=4", "model.num_kv_heads=2", "tracking.backend=none",
           "train.log_interval=1", "train.eval_interval=0", "roles.actor.init_from=random",
           "roles.reference.init_from=random", "rl.algorithm=grpo", "rl.prompts_per_step=4",
           "rl.samples_per_prompt=4", "rl.max_new_tokens=8", "rl.micro_batch_size=8",
           "rl.reward_fn=rl_rewards:digits", "rl.kl_coef=0.05", "optim.lr=1e-2",
           f"train.steps={RL_STEPS}", f"checkpoint.save_interval={RL_SAVE_INTERVAL}")


def submit_rl(cluster, workdir: Path, name: str) -> tuple[str, Path]:
    run_dir = workdir / name
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    env = _job_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),  # rl_rewards
                   OMP_NUM_THREADS="1")
    job = cluster.submit(SBATCH, "rl", str(REPO / "configs" / "tiny_grpo.yaml"), f"train.run_dir={run_dir}",
                         *RL_ARGS, sbatch_args=["-N", "2", "--ntasks-per-node=1", "--cpus-per-task=1",
                                                f"--job-name={name}"], env=env, cwd=workdir)
    return job, run_dir


def rl_metrics(run_dir: Path) -> list[dict]:
    """<run_dir>/rl/metrics.jsonl without the wall-clock figures (perf/), which no two runs repeat."""
    from megarl_run import metrics

    return metrics(str(run_dir / "rl"))


def _rl_step_reached(run_dir: Path, step: int) -> bool:
    try:
        lines = (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()
        return any(json.loads(line).get("step", 0) >= step for line in lines if line.endswith("}"))
    except (OSError, ValueError):
        return False


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_megarl_rl_requeued_mid_run_resumes_bit_exact(cluster, workdir):
    """`scontrol requeue` after the first checkpoint: SIGTERM to every process of the job ->
    the ranks finish the step, write the pre-emption checkpoint and exit 75 -> SLURM requeues ->
    the same command resumes from that checkpoint and ends with the uninterrupted job's metrics
    and weights, bit for bit."""
    import re

    import torch
    from megarl_run import final_weights

    base_job, base_dir = submit_rl(cluster, workdir, "rl-baseline")
    job, run_dir = submit_rl(cluster, workdir, "rl-requeued")
    # Deterministic interruption point: the first periodic checkpoint is published and its step's
    # metrics are written, so the SIGTERM of the requeue lands in the loop, after a checkpoint.
    latest = run_dir / "rl" / "checkpoints" / "latest"
    cluster.wait_for(lambda: latest.exists() and _rl_step_reached(run_dir, RL_SAVE_INTERVAL), timeout=180,
                     what="the first RL checkpoint before the requeue")
    assert cluster.job(job).get("Restarts", "0") == "0"
    cluster.run("scontrol", "requeue", job)

    info = cluster.wait(job, timeout=240)
    log = job_log(workdir, "rl-requeued", job)
    assert_completed(cluster, info, log)
    base_info = cluster.wait(base_job, timeout=120)
    base_log = job_log(workdir, "rl-baseline", base_job)
    assert_completed(cluster, base_info, base_log)

    # It really was interrupted mid-run and resumed from a checkpoint of that run.
    assert int(info.get("Restarts", "0")) >= 1, f"the job was not requeued\n{log}"
    assert log.count("[megarl] job") >= 2 and "restart 1" in log, log[-3000:]
    stopped = re.findall(r"rl: pre-empted at step (\d+); checkpoint saved", log)
    resumed = re.findall(r"resumed rl from \S+ \(step (\d+)\)", log)
    assert stopped and resumed, log[-3000:]
    assert "training exited 75" in log, log[-3000:]
    assert RL_SAVE_INTERVAL <= int(resumed[0]) < RL_STEPS and resumed[0] == stopped[0], (stopped, resumed)
    assert "resumed rl from" not in base_log and "restart 1" not in base_log

    # ... and ended exactly like the uninterrupted job: every step's RL metrics and every tensor
    # of the final checkpoint (weights and optimizer state).
    expected = rl_metrics(base_dir)
    assert [m["step"] for m in expected] == list(range(1, RL_STEPS + 1))
    assert all(m["actor/grad_norm"] > 0 for m in expected) and any(m["kl/mean"] > 0 for m in expected)
    assert rl_metrics(run_dir) == expected
    for d in (base_dir, run_dir):
        assert (d / "rl" / "checkpoints" / "latest").read_text().strip() == f"step_{RL_STEPS:08d}"
    got, want = final_weights(run_dir / "rl"), final_weights(base_dir / "rl")
    assert any(k.startswith("actor.") for k in want)
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def _save_with_sigterm_to_every_process(rank, world, root):
    import psutil

    from megarl.checkpoint.distributed import latest_checkpoint, save_checkpoint
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    save_checkpoint(root, 1, {}, {"n": 1})
    helpers = psutil.Process().children(recursive=True)  # e.g. the checkpoint writer's queue server
    for p in helpers:  # what slurmstepd does at a requeue: SIGTERM to every process of the step
        os.kill(p.pid, signal.SIGTERM)
    time.sleep(1)
    save_checkpoint(root, 2, {}, {"n": 2})  # the pre-emption checkpoint, written after the signal
    latest = latest_checkpoint(root)
    teardown()
    return len(helpers), latest


def test_checkpoint_survives_sigterm_to_every_job_process(tmp_path):
    """Without SLURM: the helper processes a checkpoint save leaves behind get SLURM's SIGTERM
    too (it signals every process of the job step); the next save, the pre-emption checkpoint,
    must still work."""
    from dist_helpers import run_distributed

    helpers, latest = run_distributed(_save_with_sigterm_to_every_process, 1, str(tmp_path / "ckpt"))[0]
    assert helpers == 0  # no helper outlives a save (the write results come back through a file)
    assert latest == str(tmp_path / "ckpt" / "step_00000002")


def test_local_run_sh_preemption_and_resume(tmp_path):
    """launchers/local/run.sh: SIGTERM to the launcher -> ranks checkpoint -> exit 75; the
    same command again resumes and ends like an uninterrupted run (no SLURM needed)."""
    run_dir = tmp_path / "local"
    cmd = [str(REPO / "launchers" / "local" / "run.sh"), "2", "--", sys.executable,
           str(Path(__file__).resolve()), "standin", "--run-dir", str(run_dir),
           "--steps", "6", "--sleep", "0.1", "--hold-at", "2"]
    env = dict(os.environ, **_job_env())
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if json.loads((run_dir / "progress.json").read_text()).get("held"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # run.sh exec'd launchers/torchrun.py: same pid
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 75, out
    assert not (run_dir / "final.json").exists()
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    final = json.loads((run_dir / "final.json").read_text())
    assert final["resumed_from"] == 2 and final["world_size"] == 2 and len(final["losses"]) == 6


# ---------------------------------------------------------------------- the stand-in trainer
def standin_main(argv=None) -> int:
    """Deterministic 2-rank "training" over gloo with megarl's pre-emption contract."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--sleep", type=float, default=SLEEP)
    ap.add_argument("--hold-at", type=int, default=-1,
                    help="first run only: before this step, idle (up to 300 s) until signalled, so a "
                         "test can interrupt a run that is certainly mid-way")
    args = ap.parse_args(argv)

    import datetime

    import torch
    import torch.distributed as dist

    from megarl.tracking import create_tracker

    stop = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, f: stop.append(s))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(args.run_dir)
    ckpt = run_dir / "checkpoint.pt"
    target = torch.arange(4, dtype=torch.float64)
    start, w, losses = 0, torch.zeros(4, dtype=torch.float64), []
    if ckpt.exists():  # resume
        state = torch.load(ckpt)
        start, w, losses = state["step"], state["w"], state["losses"]
    nodes = [None] * world
    dist.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME", socket.gethostname()))
    tracker = create_tracker(run_dir, {"standin": {"steps": args.steps, "world_size": world}}, rank=rank,
                             run_name="standin", system_metrics_interval=None, flush_timeout=60)
    tracker.set_tags({"nodes": ",".join(sorted(nodes))})

    def stop_agreed() -> bool:  # all ranks stop at the same step boundary
        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    loss = float("nan")
    for step in range(start, args.steps):
        if step == args.hold_at and start == 0:  # never again after a resume
            if rank == 0:
                (run_dir / "progress.json").write_text(json.dumps({"step": step, "held": True}))
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not stop_agreed():
                time.sleep(0.2)
        if stop_agreed():
            print(f"[standin] rank {rank}: signal {stop[:1]} -> checkpoint at step {step}, exit 75", flush=True)
            tracker.close("KILLED", timeout=5)
            dist.destroy_process_group()
            return 75
        grad = (w - target) * (rank + 1)
        dist.all_reduce(grad)
        w = w - 0.1 * grad / sum(range(1, world + 1))
        loss = float(((w - target) ** 2).sum())
        losses.append([step, loss])
        tracker.log_metrics({"train/loss": loss, "train/lr": 0.1}, step=step)
        if rank == 0:  # atomic checkpoint, then progress marker
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"step": step + 1, "w": w, "losses": losses}, tmp)
            os.replace(tmp, ckpt)
            (run_dir / "progress.json").write_text(json.dumps({"step": step + 1}))
        time.sleep(args.sleep)
    if rank == 0:
        (run_dir / "final.json").write_text(json.dumps({
            "w": w.tolist(), "loss": loss, "losses": losses, "world_size": world, "nodes": nodes,
            "resumed_from": start, "steps_run": args.steps - start}))
    tracker.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "standin":
        sys.exit(standin_main(sys.argv[2:]))
    sys.exit("usage: python tests/test_slurm.py standin --run-dir DIR [--steps N] [--sleep S]")
