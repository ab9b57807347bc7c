"""The RL stage end to end (`megarl rl`), on tiny random-initialised models over gloo.

- invariants of a first step (KL 0 with reference = actor, ratio 1 and clip fraction 0 on the
  first mini-batch of an epoch) and learning: GRPO drives a dense rule reward up;
- every layout (TP2, PP2, DP2, TP2xPP2) runs the same PPO steps (all four roles) as one process;
- a run SIGKILLed mid-way and resumed equals the uninterrupted run (metrics and weights);
- the PPO surrogate decreases on a fixed batch (in process), and the experience's masks.
"""
import os
import signal
import subprocess
import time

import pytest
import torch

from megarl_run import command, env, final_weights, metrics

HERE = os.path.dirname(__file__)

TINY_RL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
           "model.num_kv_heads=2", "tracking.backend=none", "train.log_interval=1", "train.eval_interval=0",
           "roles.actor.init_from=random", "roles.reference.init_from=random", "roles.critic.init_from=random",
           "roles.reward.init_from=random", "rl.max_new_tokens=8", "rl.micro_batch_size=8"]


def rl_args(run, *extra):
    return ["rl", "--config", "configs/tiny_grpo.yaml", f"train.run_dir={run}", *TINY_RL, *extra]


def rl_env():
    e = env()
    e["PYTHONPATH"] = os.pathsep.join([HERE, e.get("PYTHONPATH", "")])  # tests/rl_rewards.py
    return e


def run_rl(args, nproc=1, timeout=600):
    out = subprocess.run(command(args, nproc), capture_output=True, text=True, timeout=timeout, env=rl_env(),
                         cwd=os.path.dirname(HERE))
    if out.returncode != 0:
        raise AssertionError(f"megarl {' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def deterministic(records):
    """The figures a rerun must repeat: no wall-clock or memory-ledger figures."""
    return [{k: v for k, v in r.items() if not k.startswith("memory/")} for r in records]


# ------------------------------------------------------------------------------ learning


def test_grpo_first_step_invariants_and_learning(tmp_path):
    """From a random model, GRPO raises the fraction of digits in its answers from a few % to most
    of them in 16 steps; the first step shows the textbook invariants."""
    run_rl(rl_args(tmp_path, "train.steps=16", "rl.prompts_per_step=8", "rl.samples_per_prompt=4",
                   "rl.old_logprobs=rollout",
                   "rl.micro_batch_size=32", "rl.mini_batches=2", "rl.reward_fn=rl_rewards:digits",
                   "optim.lr=1e-2", "rl.kl_coef=0.01", "checkpoint.save_interval=0"))
    m = metrics(tmp_path / "rl")
    first = m[0]
    assert first["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # the reference is the actor's start
    # the rollout's own log-probs are the behaviour policy's (to rounding): ratio 1, no clipping
    assert first["actor/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
    assert first["actor/clip_fraction_first_minibatch"] == 0.0
    assert first["actor/approx_kl_first_minibatch"] == pytest.approx(0.0, abs=1e-7)
    assert first["actor/clip_fraction"] > 0  # the second mini-batch moved off-policy enough to clip
    rewards = [r["reward/mean"] for r in m]
    assert max(rewards[:3]) < 0.15, rewards
    assert min(rewards[-3:]) > 0.6, rewards
    assert any(r["kl/mean"] > 0 for r in m[1:])
    assert all(r["rollout/response_len_mean"] <= 8 for r in m)


# ------------------------------------------------------------------------------ layouts


PARITY = ("train.steps=2", "rl.algorithm=ppo", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
          "rl.kl_coef=0.05", "rl.kl_in=reward", "rl.reward_model_coef=0.5", "rl.reward_fn=rl_rewards:digits",
          "rl.mini_batches=2", "optim.lr=1e-3", "optim.eps=1e-4", "lr_schedule.style=constant",
          "rl.value_clip=null", "checkpoint.save_interval=0")


@pytest.mark.slow
def test_every_layout_runs_the_same_ppo_steps(tmp_path):
    """PPO with actor, reference, critic and reward model: TP2, PP2, DP2 and TP2xPP2 sample the
    same responses and report the same losses, rewards, KL and values as one process."""
    megarl_layouts = {"tp1": ((), 1), "tp2": (("parallel.tp=2",), 2), "pp2": (("parallel.pp=2",), 2),
                      "dp2": ((), 2), "tp2pp2": (("parallel.tp=2", "parallel.pp=2"), 4)}
    results = {}
    for name, (extra, nproc) in megarl_layouts.items():
        run_rl(rl_args(tmp_path / name, *PARITY, *extra), nproc=nproc)
        results[name] = deterministic(metrics(tmp_path / name / "rl"))
    ref = results.pop("tp1")
    assert ref[-1]["critic/loss"] > 0 and ref[-1]["actor/grad_norm"] > 0
    for name, got in results.items():
        assert_same_steps(got, ref, name)


def assert_same_steps(got, ref, name):
    """PARITY's metrics of a layout against one process's."""
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.keys() == b.keys(), name
        for k in b:
            if k == "train/padding_waste":  # a property of each rank's micro-batches
                continue
            # a clip indicator may flip on a token sitting at the boundary (rounding): one or
            # two tokens of the 64 per step; every continuous figure agrees to 1e-5. (Value
            # clipping is off here: a random critic's values jump past any clip range.)
            tol = dict(abs=2 / 64) if "clip_fraction" in k else dict(rel=1e-5, abs=1e-6)
            assert a[k] == pytest.approx(b[k], **tol), (name, k, a[k], b[k])


DAPO = ("train.steps=3", "rl.prompts_per_step=4", "rl.samples_per_prompt=4", "rl.reward_fn=rl_rewards:digits",
        "rl.dynamic_sampling=true", "rl.max_resample_rounds=3", "rl.overlong=soft", "rl.overlong_buffer=4",
        "optim.lr=1e-3", "checkpoint.save_interval=0")


@pytest.mark.slow
def test_dynamic_sampling_is_the_same_at_dp2_as_one_process(tmp_path):
    """DAPO's dynamic sampling replaces groups without signal by groups of further prompts; which
    groups are kept, and so the step, does not depend on the DP size."""
    results = {}
    for name, nproc in (("dp1", 1), ("dp2", 2)):
        run_rl(rl_args(tmp_path / name, *DAPO), nproc=nproc)
        results[name] = deterministic(metrics(tmp_path / name / "rl"))
    ref, got = results["dp1"], results["dp2"]
    assert any(r["rollout/filtered_fraction"] > 0 and r["rollout/sampling_rounds"] > 1 for r in ref), ref
    assert all(r["reward/overlong_penalty_mean"] < 0 for r in ref)  # 8 new tokens, a buffer of 4
    for a, b in zip(got, ref):
        assert a.keys() == b.keys()
        for k in b:
            if k != "train/padding_waste":  # a property of each rank's micro-batches
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (k, a[k], b[k])


# ------------------------------------------------------------------------------ resume


RESUME = ("train.steps=4", "rl.algorithm=ppo", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
          "rl.kl_coef=0.05", "rl.kl_target=0.01", "rl.reward_fn=rl_rewards:digits", "optim.lr=1e-3",
          "checkpoint.save_interval=1")


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_exact(tmp_path):
    full = tmp_path / "full"
    run_rl(rl_args(full, *RESUME))
    run = tmp_path / "run"
    proc = subprocess.Popen(command(rl_args(run, *RESUME)), env=rl_env(), cwd=os.path.dirname(HERE),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (run / "rl" / "metrics.jsonl").exists() or not any(m["step"] >= 3 for m in metrics(run / "rl")):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "step 3 not reached"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run_rl(rl_args(run, *RESUME))
    assert deterministic(metrics(run / "rl")) == deterministic(metrics(full / "rl"))
    a, b = final_weights(run / "rl"), final_weights(full / "rl")
    assert any(k.startswith("actor.") for k in a) and any(k.startswith("critic.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ in process


def _overfit_body(rank, world_size, run_dir):
    from megarl.config import load_config
    from megarl.roles.phases import PhaseClock
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers.rl import RLStage

    cfg = load_config("configs/tiny_grpo.yaml", [f"train.run_dir={run_dir}", *TINY_RL, "rl.prompts_per_step=4",
                                                  "rl.samples_per_prompt=4", "rl.reward_fn=rl_rewards:digits",
                                                  "optim.lr=3e-3", "rl.mini_batches=1", "rl.clip_high=0.2",
                                                  "rl.overlong=filter"])
    init_distributed(1, 1, seed=cfg.train.seed)
    stage = RLStage(cfg, str(run_dir / "rl"))
    clock = PhaseClock(stage.phases)
    exp, _ = stage.generate(0, clock)  # the phases hand their results on
    full_mask = exp.mask.clone()
    # a random model never stops by itself: say half the rows did, so rl.overlong=filter keeps them
    # in the loss and masks out the others (cut at max_new_tokens)
    exp.stopped = torch.arange(exp.tokens.shape[0]) % 2 == 0
    metrics = stage.advantages(exp, stage.score(exp, clock), clock)
    # rl.old_logprobs=recompute: the actor's recomputed log-probs equal the engine's own log-probs
    # of the sampled tokens, in the label columns (temperature 1, no top-k/top-p)
    torch.testing.assert_close(exp.rollout_logp[full_mask], exp.old_logp[full_mask], atol=2e-5, rtol=0)
    losses = []
    for epoch in range(6):  # the same batch, again and again: the clipped surrogate must fall
        out = stage._train(stage.actor, exp, stage._policy_loss(), 0, "actor")
        losses.append(out["actor/pg_loss"])
    return exp, full_mask, metrics, clock.metrics(), losses


def test_surrogate_falls_on_a_fixed_batch_and_masks_mark_responses(tmp_path, monkeypatch):
    from dist_helpers import run_distributed

    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    (exp, full_mask, metrics, timing, losses), = run_distributed(_overfit_body, 1, tmp_path)
    assert losses[-1] < losses[0] - 1e-4, losses
    assert metrics["finite"] and {"perf/generate_s", "perf/score_rule_s", "perf/score_actor_s",
                                  "perf/advantages_s"} <= timing.keys()
    # the action mask covers exactly the response tokens, shifted by one (column t predicts t+1)
    for i in range(exp.tokens.shape[0]):
        p, r = int(exp.prompt_lens[i]), exp.lengths[i] - int(exp.prompt_lens[i])
        cols = full_mask[i].nonzero().flatten().tolist()
        assert cols == list(range(p - 1, p + r - 1))
        assert torch.equal(exp.labels[i, p - 1:p + r - 1], exp.tokens[i, p:p + r])
    # rl.overlong=filter: responses cut at max_new_tokens leave the loss, the others stay whole
    assert torch.equal(exp.mask, full_mask & exp.stopped[:, None])
    assert torch.isfinite(exp.advantages).all() and (exp.advantages[~exp.mask] == 0).all()
    assert (exp.old_logp[full_mask] < 0).all()


def test_plan_microbatches_respects_the_token_budget():
    from megarl.trainers.common import padding_waste, plan_microbatches

    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 60, (37,), generator=g).tolist()
    groups = plan_microbatches(lengths, max_rows=8, max_tokens=128)
    assert sorted(i for grp in groups for i in grp) == list(range(37))
    for grp in groups:
        assert len(grp) <= 8 and len(grp) * max(lengths[i] for i in grp) <= 128
    fixed = plan_microbatches(lengths, max_rows=8)
    assert [len(x) for x in fixed] == [8, 8, 8, 8, 5] and fixed[0] == list(range(8))
    computed = sum(len(grp) * max(lengths[i] for i in grp) for grp in groups)
    assert padding_waste(lengths, groups) == pytest.approx(1 - sum(lengths) / computed)
    assert padding_waste(lengths, groups) < padding_waste(lengths, fixed)  # sorting by length pays
    with pytest.raises(ValueError, match="below the longest sequence"):
        plan_microbatches(lengths, max_rows=8, max_tokens=10)


def test_minibatches_are_the_same_global_rows_at_every_dp_size():
    from megarl.trainers.rl import minibatch_rows

    n, m, key = 48, 4, (1234, 7, 1)

    def global_sets(dp):
        per = n // dp
        sets = [set() for _ in range(m)]
        for rank in range(dp):
            for k, rows in enumerate(minibatch_rows(per, rank * per, m, key)):
                assert len(rows) == per // m  # balanced over ranks
                sets[k] |= {rank * per + j for j in rows}
        return sets

    ref = global_sets(1)
    assert all(len(s) == n // m for s in ref) and set().union(*ref) == set(range(n))
    assert global_sets(2) == ref and global_sets(4) == ref
    assert [sorted(s) for s in ref] != [sorted(s) for s in
                                        [set(r) for r in minibatch_rows(n, 0, m, (1234, 7, 2))]]  # epochs differ
    assert sorted(ref[0]) != list(range(0, n, m))  # not a fixed stride


OFFLOAD_ALL = [f"roles.{r}.offload.{k}=true" for r in ("actor", "reference", "critic", "reward")
               for k in ("params", "grads", "optimizer")]


def test_offloading_every_role_between_phases_changes_nothing_but_memory(tmp_path):
    """PPO with four roles, each resident only in its phases, equals the run that keeps all of
    them resident, exactly; the ledger shows the difference."""
    args = ("train.steps=2", "rl.algorithm=ppo", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
            "rl.kl_coef=0.05", "rl.reward_model_coef=0.5", "rl.reward_fn=rl_rewards:digits",
            "optim.lr=1e-3", "checkpoint.save_interval=1")
    run_rl(rl_args(tmp_path / "resident", *args))
    run_rl(rl_args(tmp_path / "offload", *args, *OFFLOAD_ALL))
    kept, moved = metrics(tmp_path / "resident" / "rl"), metrics(tmp_path / "offload" / "rl")
    assert deterministic(moved) == deterministic(kept)
    assert all(m["memory/host_gib"] == 0 for m in kept)
    last = moved[-1]
    assert last["memory/host_gib"] > 0
    # every phase holds only its own roles: the peak is one phase's need, below all roles at once
    assert last["memory/peak_device_gib"] < kept[-1]["memory/device_gib"]
    assert last["memory/generate_device_gib"] < last["memory/train_actor_device_gib"]


def test_kl_ceiling_stops_the_run_in_one_line_with_the_last_good_checkpoint(tmp_path):
    args = rl_args(tmp_path, "train.steps=6", "rl.prompts_per_step=4", "rl.samples_per_prompt=2",
                   "rl.reward_fn=rl_rewards:digits", "optim.lr=1e-2", "rl.kl_coef=0.01", "rl.kl_ceiling=1e-9",
                   "rl.kl_ceiling_steps=2", "checkpoint.save_interval=1")
    out = subprocess.run(command(args), capture_output=True, text=True, timeout=600, env=rl_env(),
                         cwd=os.path.dirname(HERE))
    assert out.returncode == 1, out.stderr[-2000:]
    line = [x for x in out.stderr.splitlines() if x.startswith("megarl: stopped:")]
    assert line and "stayed above rl.kl_ceiling" in line[0] and "Traceback" not in out.stderr
    # KL is 0 at step 1 (reference = actor) and above the ceiling from step 2: stopped at step 3,
    # whose state was never saved
    assert (tmp_path / "rl" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
