"""SFT and reward-model stages end to end through the real CLI: learning, layout parity,
resume exactness after SIGKILL, and pre-emption (SIGTERM -> checkpoint, exit 75, resume)."""
import os
import signal
import subprocess
import time

import pytest
import torch

from megarl_run import TINY, command, env, final_weights, megarl, metrics, train_losses

pytestmark = pytest.mark.slow


def sft_args(run_dir, *extra):
    return ["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={run_dir}", *TINY, *extra]


def rm_args(run_dir, *extra):
    return ["rm", "--config", "configs/tiny_rm.yaml", f"train.run_dir={run_dir}", *TINY, *extra]


def test_sft_learns_and_leaves_a_complete_run_dir(tmp_path):
    run = tmp_path / "run"
    megarl(sft_args(run, "train.steps=40", "train.eval_interval=20", "optim.lr=3e-3", "lr_schedule.warmup_steps=5"))
    losses = train_losses(run / "sft")
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
    evals = [m for m in metrics(run / "sft") if "eval/loss" in m]
    assert [m["step"] for m in evals] == [20, 40] and evals[1]["eval/loss"] < evals[0]["eval/loss"]
    assert {"eval/token_accuracy", "eval/teacher_forced_exact_match", "eval/sample_accuracy"} <= set(evals[1])
    assert (run / "sft" / "config.yaml").exists()
    assert (run / "sft" / "checkpoints" / "latest").read_text().strip() == "step_00000040"
    assert (run / "data" / "train_sft.jsonl").exists()


# One-operation problems and a tiny model keep this to ~1.5 min on one thread; the full task is
# the quickstart's (docs/benchmarks.md). 192 test pairs = 6 eval batches of 32. Clean SFT
# demonstrations (base.yaml's noisy teacher is for the RL stage): from the noisy SFT the same RM
# reached only 0.56 / 0.83 / 0.93 at steps 100-300 (2026-11-25), a thin margin over 0.9.
EASY_PAIRS = ("data.synthetic.max_ops=1", "data.synthetic.n_test=192", "data.synthetic.sft_mistakes=0",
              "data.seq_length=96", "data.micro_batch_size=32", "data.global_batch_size=32",
              "model.ffn_hidden_size=176", "checkpoint.save_interval=0")


def test_reward_model_ranks_held_out_pairs_above_90_percent(tmp_path):
    """SFT, then a reward model from its checkpoint: Bradley-Terry on the synthetic pairs
    (a misread quantity in the rejected solution) must rank > 90% of all held-out pairs."""
    run = tmp_path / "run"
    megarl(sft_args(run, *EASY_PAIRS, "train.steps=300", "train.eval_interval=0", "sft.eval_samples=0"))
    # 64 pairs a step (the quickstart recipe's batch): when the RM leaves its 0.55 plateau moves
    # with rounding at 32 (0.88/0.99/1.0 at steps 100/200/300 on one machine, 0.54/0.51/0.69 on
    # another, 2026-11-25); at 64 on the latter: 0.83 @100, 1.0 @200, 1.0 @300
    megarl(rm_args(run, *EASY_PAIRS, "data.global_batch_size=64", "train.steps=300", "train.eval_interval=100",
                   "train.eval_batches=3", "optim.lr=2e-3", "lr_schedule.style=constant",
                   "lr_schedule.warmup_steps=10"))
    records = metrics(run / "reward_model")
    evals = [m for m in records if "eval/pair_accuracy" in m]
    assert [m["step"] for m in evals] == [100, 200, 300]
    assert evals[-1]["eval/pair_accuracy"] > 0.9, evals
    # learnt, not given: the fresh scalar head ranks the first training batches near chance
    first = [m["train/pair_accuracy"] for m in records if "train/pair_accuracy" in m][:5]
    assert sum(first) / len(first) < 0.75, first
    assert evals[-1]["eval/reward_gap"] > evals[0]["eval/reward_gap"] > 0


def test_rm_pooling_is_saved_with_the_checkpoint_and_read_back_by_rl(tmp_path, monkeypatch):
    """reward_model.pooling=mean trains on the mean over response tokens, the checkpoint's manifest
    records it, and RL's reward role built from that checkpoint reads the model the same way."""
    import json
    import types

    from megarl.config import load_config
    from megarl.trainers import weights

    run = tmp_path / "run"
    megarl(rm_args(run, "reward_model.init_from=null", "reward_model.pooling=mean", "train.steps=2",
                   "train.eval_interval=0", "checkpoint.save_interval=2"))
    ckpt = run / "reward_model" / "checkpoints" / "step_00000002"
    assert json.loads((ckpt / "megarl_manifest.json").read_text())["reward_pooling"] == {"reward_model": "mean"}
    monkeypatch.setattr("megarl.checkpoint.distributed.load_weights", lambda *a, **k: None)
    monkeypatch.setattr(weights, "load_weights", lambda *a, **k: None, raising=False)
    cfg = load_config("configs/tiny_ppo.yaml", [f"train.run_dir={run}"])
    role = types.SimpleNamespace(name="reward", head="scalar")
    weights.load_role_weights(cfg, role, str(ckpt), "roles.reward.init_from")
    assert role.reward_pooling == "mean"
    megarl(rm_args(tmp_path / "last", "reward_model.init_from=null", "reward_model.pooling=last", "train.steps=2",
                   "train.eval_interval=0", "checkpoint.save_interval=2"))
    role = types.SimpleNamespace(name="reward", head="scalar")
    weights.load_role_weights(cfg, role, str(tmp_path / "last" / "reward_model" / "checkpoints" / "step_00000002"),
                              "roles.reward.init_from")
    assert role.reward_pooling == "last"


STEPS3 = ("train.steps=3", "train.eval_interval=0", "checkpoint.save_interval=0")


@pytest.mark.parametrize("stage", ["sft", "rm"])
def test_tp2_and_pp2_match_tp1(tmp_path, stage):
    args = sft_args if stage == "sft" else rm_args
    extra = ("reward_model.init_from=null",) if stage == "rm" else ()
    sub = "sft" if stage == "sft" else "reward_model"
    megarl(args(tmp_path / "tp1", *STEPS3, *extra))
    megarl(args(tmp_path / "tp2", *STEPS3, *extra, "parallel.tp=2"), nproc=2)
    megarl(args(tmp_path / "pp2", *STEPS3, *extra, "parallel.pp=2"), nproc=2)
    ref = train_losses(tmp_path / "tp1" / sub)
    for layout in ("tp2", "pp2"):
        got = train_losses(tmp_path / layout / sub)
        assert got == pytest.approx(ref, rel=1e-5), (layout, got, ref)


# ---------------------------------------------------------------------------- resume


RESUME = ("train.steps=6", "train.eval_interval=3", "checkpoint.save_interval=2", "sft.eval_samples=0")


def _start(args):
    return subprocess.Popen(command(args), env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _wait_for_step(stage_dir, step, proc, timeout=300):
    deadline = time.time() + timeout
    path = stage_dir / "metrics.jsonl"
    while time.time() < deadline:
        if path.exists() and any(m.get("step", 0) >= step for m in metrics(stage_dir)):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout}s")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("full")
    megarl(sft_args(run, *RESUME))
    return metrics(run / "sft"), final_weights(run / "sft")


def test_sigkill_then_resume_is_bit_exact(tmp_path, uninterrupted):
    run = tmp_path / "run"
    proc = _start(sft_args(run, *RESUME))
    _wait_for_step(run / "sft", 3, proc)  # the step-2 checkpoint is durable before step 3 starts
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (run / "sft" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    megarl(sft_args(run, *RESUME))
    ref_metrics, ref_weights = uninterrupted
    assert metrics(run / "sft") == ref_metrics  # every step's loss, lr, grad norm and eval, exactly
    weights = final_weights(run / "sft")
    assert weights.keys() == ref_weights.keys()
    for k in ref_weights:
        assert torch.equal(weights[k], ref_weights[k]), k


def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, uninterrupted):
    run = tmp_path / "run"
    proc = _start(sft_args(run, *RESUME))
    _wait_for_step(run / "sft", 1, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, (out[-2000:], err[-2000:])
    assert "pre-empted at step" in err
    stopped = int((run / "sft" / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 1 <= stopped < 6
    megarl(sft_args(run, *RESUME))
    assert metrics(run / "sft") == uninterrupted[0]


def test_async_saves_preempt_and_resume_like_sync_saves(tmp_path, uninterrupted):
    """Background writes (checkpoint.async_save): pre-emption publishes the in-flight save before
    exiting 75, and the resumed run ends where the synchronous uninterrupted run does."""
    run = tmp_path / "run"
    args = sft_args(run, *RESUME, "checkpoint.async_save=true")
    proc = _start(args)
    _wait_for_step(run / "sft", 1, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, (out[-2000:], err[-2000:])
    assert not [d for d in os.listdir(run / "sft" / "checkpoints") if d.startswith(".tmp")]
    megarl(args)
    ref_metrics, ref_weights = uninterrupted
    assert metrics(run / "sft") == ref_metrics
    weights = final_weights(run / "sft")
    assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_rm_resume_after_sigkill_is_bit_exact(tmp_path):
    args = ("train.steps=4", "train.eval_interval=0", "checkpoint.save_interval=2", "reward_model.init_from=null")
    full = tmp_path / "full"
    megarl(rm_args(full, *args))
    run = tmp_path / "run"
    proc = _start(rm_args(run, *args))
    _wait_for_step(run / "reward_model", 3, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    megarl(rm_args(run, *args))
    assert metrics(run / "reward_model") == metrics(full / "reward_model")
    a, b = final_weights(run / "reward_model"), final_weights(full / "reward_model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dali_loader_trains_exactly_like_the_torch_loader(tmp_path):
    pytest.importorskip("nvidia.dali", reason="NVIDIA DALI not installed (pip install 'megarl[dali]')")
    for loader in ("torch", "dali"):
        megarl(sft_args(tmp_path / loader, *STEPS3, f"data.loader={loader}"))
    assert (tmp_path / "dali" / "sft" / "shards").is_dir()
    assert train_losses(tmp_path / "dali" / "sft") == train_losses(tmp_path / "torch" / "sft")
