"""Rollout-training mismatch (megarl/algorithms/mismatch.py): its metrics and the tis / mis
corrections against float64 references written here with plain loops, their config rules, and
their wiring into the RL stage (a tiny GRPO step's metrics; the actor's loss on a crafted batch)."""
import math
import os

import pytest
import torch

from megarl.algorithms import mis_keep, mismatch_metrics, ppo_policy_loss, ppo_token_loss, tis_weights, token_weights
from megarl.config import check_config, load_config

HERE = os.path.dirname(__file__)
torch.set_num_threads(1)


def inputs(seed, B=7, T=9):
    """Trainer and engine log-probs that differ by up to a few nats, right-padded rows, one
    all-padding row, and padding holding -inf / nan (never read)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lens[:, None]
    mask[3] = False
    rollout = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5 - 0.01
    train = rollout + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8
    train[~mask] = float("-inf")
    rollout[~mask] = float("nan")
    return train, rollout, mask


def valid_tokens(train, rollout, mask):
    """[(row, log rho)] of the valid tokens, row by row."""
    return [[train[b][t] - rollout[b][t] for t in range(len(mask[b])) if mask[b][t]] for b in range(len(mask))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mismatch_metrics_against_loops(seed):
    train, rollout, mask = inputs(seed)
    cap = 1.7
    pairs, abs_max = mismatch_metrics(train, rollout, mask, cap)
    rows = valid_tokens(train.tolist(), rollout.tolist(), mask.tolist())
    toks = [d for r in rows for d in r]
    assert pairs["logp_abs_diff_mean"][0] / pairs["logp_abs_diff_mean"][1] == pytest.approx(
        sum(abs(d) for d in toks) / len(toks), rel=1e-12)
    assert abs_max.item() == pytest.approx(max(abs(d) for d in toks), rel=1e-15)
    out = sum(1 for d in toks if not 1 / cap <= math.exp(d) <= cap)
    assert 0 < out < len(toks)                                   # both sides of the threshold exercised
    assert pairs["ratio_out_fraction"].tolist() == [out, len(toks)]
    seq = [sum(math.exp(d) - 1 - d for d in r) for r in rows if r]
    assert pairs["seq_kl"][1].item() == len(seq) == mask.shape[0] - 1   # the all-padding row is no sequence
    assert pairs["seq_kl"][0].item() == pytest.approx(sum(seq), rel=1e-12)
    with pytest.raises(ValueError, match="must be > 1"):
        mismatch_metrics(train, rollout, mask, 1.0)


@pytest.mark.parametrize("seed", [3, 4])
def test_tis_weights_and_mis_rows_against_loops(seed):
    train, rollout, mask = inputs(seed)
    cap = 2.0
    w = tis_weights(train, rollout, mask, cap)
    assert w.dtype == train.dtype and not w.requires_grad
    tl, rl, ml = train.tolist(), rollout.tolist(), mask.tolist()
    capped = 0
    for b in range(len(ml)):
        for t in range(len(ml[b])):
            want = min(math.exp(tl[b][t] - rl[b][t]), cap) if ml[b][t] else 0.0
            capped += ml[b][t] and want == cap
            assert w[b, t].item() == pytest.approx(want, rel=1e-12, abs=0)
    assert capped > 0 and bool((w[mask] < cap).any())
    lo, hi = 0.8, 1.25
    keep = mis_keep(train, rollout, mask, lo, hi)
    rows = valid_tokens(tl, rl, ml)
    want = [not r or lo <= math.exp(sum(r) / len(r)) <= hi for r in rows]
    assert keep.tolist() == want
    assert 0 < sum(want) < len(want) - 1                         # some rows kept, some dropped
    with pytest.raises(ValueError, match="0 < lo <= 1 <= hi"):
        mis_keep(train, rollout, mask, 1.1, 2.0)


def test_is_weight_multiplies_the_policy_gradient_term_only():
    """ppo_policy_loss(is_weight=w): sum_t w_t max(-A r, -A clip(r)) + the entropy and KL terms
    unweighted, against a float64 loop; the fused head's per-token form gives the same."""
    g = torch.Generator().manual_seed(11)
    train, rollout, mask = inputs(5)
    old = torch.where(mask, train, torch.zeros(()))
    logp = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(old.shape, generator=g, dtype=torch.float64)
    ent = torch.rand(old.shape, generator=g, dtype=torch.float64)
    ref = old + torch.randn(old.shape, generator=g, dtype=torch.float64) * 0.1
    w = tis_weights(train, rollout, mask, 2.0)
    kw = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, kl_coef=0.04)
    lp = logp.clone().requires_grad_(True)
    loss_sum, count, _ = ppo_policy_loss(lp, old, adv, mask, entropy=ent, ref_logp=ref, is_weight=w, **kw)
    want, n = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            r, a = math.exp(logp[b, t].item() - old[b, t].item()), adv[b, t].item()
            d = ref[b, t].item() - logp[b, t].item()
            want += (w[b, t].item() * max(-a * r, -a * min(max(r, 0.8), 1.28)) - 0.01 * ent[b, t].item()
                     + 0.04 * (math.exp(d) - d - 1))
            n += 1
    assert count.item() == n and loss_sum.item() == pytest.approx(want, rel=1e-12)
    m = mask.bool()
    per_token, _ = ppo_token_loss(logp[m], old[m], adv[m], entropy=ent[m], ref_logp=ref[m], is_weight=w[m], **kw)
    folded = (per_token * token_weights(mask, dtype=torch.float64)[m]).sum()
    assert folded.item() == pytest.approx(loss_sum.item(), rel=1e-12)


@pytest.mark.parametrize("overrides,expect", [
    (["rl.rollout_correction=tis", "rl.old_logprobs=rollout"], "rl.rollout_correction=tis weighs pi_old / pi_rollout"),
    (["rl.rollout_correction=mis", "rl.old_logprobs=rollout"], "rl.rollout_correction=mis weighs pi_old / pi_rollout"),
    (["rl.rollout_correction_c=1"], "rl.rollout_correction_c must be > 1"),
    (["rl.rollout_correction_lo=1.02"], "need 0 < lo <= 1 <= hi"),
    (["rl.rollout_correction_hi=0.9"], "need 0 < lo <= 1 <= hi"),
])
def test_config_rules(overrides, expect):
    errs = check_config(load_config(os.path.join(HERE, "..", "configs", "tiny_grpo.yaml"), overrides),
                        world_size=1, cuda=False, stage="rl")
    assert [e for e in errs if expect in e] and all("\n" not in e for e in errs), errs
    ok = check_config(load_config(os.path.join(HERE, "..", "configs", "tiny_grpo.yaml"), ["rl.rollout_correction=tis"]),
                      world_size=1, cuda=False, stage="rl")
    assert ok == []


# ------------------------------------------------------------------------------ in the RL stage


def _stage_body(rank, world_size, run_dir):
    from test_rl import TINY_RL

    from megarl.config import load_config
    from megarl.roles.phases import PhaseClock
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers.rl import RLStage

    cfg = load_config("configs/tiny_grpo.yaml", [f"train.run_dir={run_dir}", *TINY_RL, "rl.prompts_per_step=4",
                                                  "rl.samples_per_prompt=4", "rl.reward_fn=rl_rewards:digits",
                                                  "optim.lr=1e-3", "rl.mini_batches=1", "checkpoint.save_interval=0"])
    init_distributed(1, 1, seed=cfg.train.seed)
    stage = RLStage(cfg, str(run_dir / "rl"))
    step_metrics = stage.step(0)  # what the loop logs
    clock = PhaseClock(stage.phases)
    base, _ = stage.generate(1, clock)
    g = torch.Generator().manual_seed(5)
    base.scores = torch.randn(base.scores.shape, generator=g)  # advantages of both signs in every group
    n = base.tokens.shape[0]
    delta = torch.randn(base.tokens.shape, generator=g) * 0.7   # log(pi_old / pi_rollout), crafted
    m = base.mask.float()
    even = (torch.arange(n) % 2 == 0)[:, None]
    delta = torch.where(even, delta - (delta * m).sum(1, keepdim=True) / m.sum(1, keepdim=True), delta)
    out = {}
    for corr, fused in (("none", True), ("tis", True), ("mis", True), ("tis", False), ("mis", False)):
        stage.cfg.rl.rollout_correction = corr
        exp = base.rows(list(range(n)))
        groups = stage.score(exp, clock)                        # old log-probs of the current weights
        exp.rollout_logp = exp.old_logp - delta * exp.mask
        metrics = stage.advantages(exp, groups, clock)
        train = stage._train(stage.actor, exp, stage._policy_loss(), 1, "actor", hidden=fused)  # False: logits
        out[corr, fused] = dict(metrics=metrics, loss=train["actor/loss"], sampled=base.mask.clone(), delta=delta,
                         advantages=exp.advantages.clone(), mask=exp.mask.clone())
    return step_metrics, out


def test_metrics_in_a_grpo_step_and_corrections_change_the_loss(tmp_path, monkeypatch):
    from dist_helpers import run_distributed

    monkeypatch.chdir(os.path.dirname(HERE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    (step, out), = run_distributed(_stage_body, 1, tmp_path)
    # one fp32 model samples and scores: the engine's log-probs are the trainer's up to rounding
    names = {"mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max", "mismatch/seq_kl",
             "mismatch/ratio_out_fraction"}
    assert names <= step.keys(), sorted(step)
    assert 0 <= step["mismatch/logp_abs_diff_mean"] <= step["mismatch/logp_abs_diff_max"] < 1e-4
    assert step["mismatch/ratio_out_fraction"] == 0 and 0 <= step["mismatch/seq_kl"] < 1e-6

    cap, lo, hi = 2.0, 0.99, 1.01                               # the defaults
    losses = {}
    for (corr, fused), o in out.items():
        sampled, delta = o["sampled"].tolist(), o["delta"].double().tolist()
        adv = o["advantages"].double().tolist()
        toks = [delta[b][t] for b in range(len(sampled)) for t in range(len(sampled[b])) if sampled[b][t]]
        got = o["metrics"]
        assert got["mismatch/logp_abs_diff_mean"] == pytest.approx(sum(map(abs, toks)) / len(toks), rel=1e-5)
        assert got["mismatch/ratio_out_fraction"] == pytest.approx(
            sum(abs(d) > math.log(cap) for d in toks) / len(toks), abs=1e-12)
        # the first mini-batch's ratio is 1 (old log-probs of these weights): the token-mean loss
        # is -sum(w A) / tokens over the rows in the loss
        num = den = 0.0
        kept_rows = 0
        for b in range(len(sampled)):
            row = [t for t in range(len(sampled[b])) if sampled[b][t]]
            if corr == "mis" and not lo <= math.exp(sum(delta[b][t] for t in row) / len(row)) <= hi:
                continue
            kept_rows += 1
            for t in row:
                w = min(math.exp(delta[b][t]), cap) if corr == "tis" else 1.0
                num -= w * adv[b][t]
                den += 1
        assert o["loss"] == pytest.approx(num / den, rel=1e-4, abs=1e-6), (corr, fused)
        losses[corr, fused] = o["loss"]
        if corr == "mis":
            assert 0 < kept_rows < len(sampled)
            assert got["mismatch/mis_masked_fraction"] == pytest.approx(1 - kept_rows / len(sampled))
            assert o["mask"].sum() == den
        if corr == "tis":
            assert 0 < got["mismatch/ratio_out_fraction"] < 1
    none = losses["none", True]
    assert abs(losses["tis", True] - none) > 1e-3 and abs(losses["mis", True] - none) > 1e-3, losses
