"""RL algorithms against float64 references written here with plain Python loops."""
import math

import pytest
import torch
from dist_helpers import run_distributed

from megarl.algorithms import (AGG_MODES, AdaptiveKLController, FixedKLController, broadcast_to_tokens,
                               clip_rewards, explained_variance, gae_advantages, grpo_advantages, kl_estimate,
                               ppo_policy_loss, ppo_token_loss, reinforce_advantages, reinforce_pp_returns,
                               rloo_advantages, sequence_reward, token_rewards, token_weights, value_loss, whiten)

torch.set_num_threads(1)


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def right_padded_mask(B, T, g, min_len=1):
    lens = torch.randint(min_len, T + 1, (B,), generator=g)
    return torch.arange(T)[None, :] < lens[:, None]


# ------------------------------------------------------------------------------ reading a reward model

def test_sequence_reward_last_and_mean_against_loops():
    g = gen(11)
    N, L = 7, 12
    values = torch.randn(N, L, generator=g, dtype=torch.float64)
    first = torch.randint(0, 6, (N,), generator=g)
    last = first + torch.randint(0, L - 6, (N,), generator=g)
    last[0] = first[0]  # a one-token response
    got_last = sequence_reward(values.float(), first, last, "last")
    got_mean = sequence_reward(values.float(), first, last, "mean")
    for i in range(N):
        f, e = int(first[i]), int(last[i])
        assert got_last[i].item() == values[i, e].float().item()
        ref = sum(float(values[i, t]) for t in range(f, e + 1)) / (e - f + 1)
        assert abs(got_mean[i].item() - ref) < 1e-6
    # columns outside [first, last] (prompt, padding) do not move the mean
    noisy = values.clone()
    noisy[:, :1] += 100.0 * (first[:, None] > 0)
    torch.testing.assert_close(sequence_reward(noisy, first, last, "mean"), sequence_reward(values, first, last, "mean"))
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        sequence_reward(values, first, last, "max")
    assert torch.equal(sequence_reward(values, None, last, "last"), values[torch.arange(N), last])
    with pytest.raises(ValueError, match="needs each row's first response column"):
        sequence_reward(values, None, last, "mean")
    with pytest.raises(ValueError, match="no response token"):
        sequence_reward(values, last + 1, last, "mean")


# ------------------------------------------------------------------------------ sequence advantages

def ref_group_stats(scores, G):
    out = []
    for start in range(0, len(scores), G):
        grp = [float(x) for x in scores[start:start + G]]
        mean = sum(grp) / G
        var = sum((x - mean) ** 2 for x in grp) / (G - 1) if G > 1 else 0.0
        out.append((grp, mean, math.sqrt(var)))
    return out


@pytest.mark.parametrize("G", [2, 4, 5])
def test_grpo_rloo_reinforce_against_loops(G):
    g = gen(G)
    scores = torch.randn(3 * G, generator=g)
    scores[G:2 * G] = torch.randint(0, 2, (G,), generator=g).float()   # a 0/1 group like a rule reward
    grpo, drgrpo = grpo_advantages(scores, G), grpo_advantages(scores, G, scale_by_std=False)
    rloo, rf = rloo_advantages(scores, G), reinforce_advantages(scores, G)
    i = 0
    for grp, mean, std in ref_group_stats(scores.tolist(), G):
        for k, x in enumerate(grp):
            others = [y for j, y in enumerate(grp) if j != k]
            assert grpo[i].item() == pytest.approx((x - mean) / (std + 1e-6), rel=1e-5, abs=1e-6)
            assert drgrpo[i].item() == pytest.approx(x - mean, abs=1e-6)
            assert rloo[i].item() == pytest.approx(x - sum(others) / len(others), abs=1e-6)
            assert rf[i].item() == pytest.approx(x - mean, abs=1e-6)
            i += 1
    assert grpo.dtype == torch.float32 and grpo.shape == scores.shape


def test_group_errors_and_degenerate_groups():
    with pytest.raises(ValueError, match="cannot be split into groups of 4"):
        grpo_advantages(torch.randn(6), 4)
    with pytest.raises(ValueError, match="RLOO needs at least 2 samples"):
        rloo_advantages(torch.randn(4), 1)
    same = torch.full((4,), 0.7)                                # all-equal group: no signal, no NaN
    assert torch.equal(grpo_advantages(same, 4), torch.zeros(4))
    assert torch.equal(grpo_advantages(torch.randn(3), 1), torch.zeros(3))


# ------------------------------------------------------------------------------ token-level pieces

def test_whiten_broadcast_and_token_rewards():
    g = gen(1)
    B, T = 5, 9
    x = torch.randn(B, T, generator=g) * 3 + 2
    mask = right_padded_mask(B, T, g)
    mask[2, 3] = False                                          # a hole
    vals = [x[b, t].item() for b in range(B) for t in range(T) if mask[b, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    w, w_noshift = whiten(x, mask), whiten(x, mask, shift_mean=False)
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                assert w[b, t].item() == pytest.approx((x[b, t].item() - mean) / std, rel=1e-5, abs=1e-6)
                assert w_noshift[b, t].item() == pytest.approx(
                    (x[b, t].item() - mean) / std + mean, rel=1e-5, abs=1e-6)
            else:
                assert w[b, t] == 0 and w_noshift[b, t] == 0

    seq = torch.randn(B, generator=g)
    bt = broadcast_to_tokens(seq, mask)
    assert torch.equal(bt, torch.where(mask, seq[:, None].expand(B, T), torch.zeros(())))

    kl_pen = torch.rand(B, T, generator=g) * 0.1
    tr = token_rewards(seq, mask, kl_pen)
    for b in range(B):
        last = max(t for t in range(T) if mask[b, t])
        for t in range(T):
            want = (seq[b].item() if t == last else 0.0) - (kl_pen[b, t].item() if mask[b, t] else 0.0)
            assert tr[b, t].item() == pytest.approx(want, abs=1e-7)
    assert token_rewards(seq, mask).sum().item() == pytest.approx(seq.sum().item(), abs=1e-6)
    empty = mask.clone()
    empty[3] = False
    with pytest.raises(ValueError, match=r"rows \[3\] have no response token"):
        token_rewards(seq, empty)


def ref_returns(r, mask, gamma):
    """Discounted return-to-go over each row's valid tokens (holes skipped), float64 loops."""
    B, T = r.shape
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        acc = 0.0
        for t in reversed(range(T)):
            if mask[b, t]:
                acc = r[b, t].item() + gamma * acc
                out[b][t] = acc
    return out


def test_reinforce_pp_is_whitened_discounted_return():
    """REINFORCE++ through its spec: the return-to-go, whitened over the batch by default."""
    from megarl.algorithms import ALGORITHMS, AdvantageSettings, compute_advantages

    g = gen(2)
    B, T, gamma = 6, 11, 0.9
    mask = right_padded_mask(B, T, g, min_len=2)
    mask[1, 1] = False
    scores = torch.randn(B, generator=g)
    penalty = torch.rand(B, T, generator=g) * 0.05
    r = token_rewards(scores, mask, penalty)
    adv, _ = compute_advantages(ALGORITHMS["reinforce_pp"], scores, mask, AdvantageSettings(2, gamma=gamma),
                                kl_penalty=penalty)
    ret = ref_returns(r.double(), mask, gamma)
    raw = reinforce_pp_returns(r, mask, gamma)
    for b in range(B):
        for t in range(T):
            assert raw[b, t].item() == pytest.approx(ret[b][t], rel=1e-5, abs=1e-5)
    vals = [ret[b][t] for b in range(B) for t in range(T) if mask[b, t]]
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    for b in range(B):
        for t in range(T):
            want = (ret[b][t] - mean) / std if mask[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_gae_advantages_against_loop():
    g = gen(3)
    B, T, gamma, lam = 4, 13, 0.97, 0.9
    mask = right_padded_mask(B, T, g)
    r, v = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv, ret = gae_advantages(r, v, mask, gamma, lam)
    for b in range(B):
        a_next = v_next = 0.0
        for t in reversed(range(T)):
            if not mask[b, t]:
                assert adv[b, t] == 0 and ret[b, t] == 0
                continue
            delta = r[b, t].item() + gamma * v_next - v[b, t].item()
            a = delta + gamma * lam * a_next
            assert adv[b, t].item() == pytest.approx(a, abs=1e-5)
            assert ret[b, t].item() == pytest.approx(a + v[b, t].item(), abs=1e-5)
            a_next, v_next = a, v[b, t].item()


def test_reward_clipping():
    g = gen(4)
    x = torch.randn(50, generator=g) * 4
    assert torch.equal(clip_rewards(x, 2.0), x.clamp(-2, 2)) and clip_rewards(x, None) is x



# ------------------------------------------------------------------------------ KL

def test_kl_estimators_and_clamp():
    g = gen(5)
    logp, ref = -torch.rand(3, 7, generator=g) * 3, -torch.rand(3, 7, generator=g) * 3
    d = (ref - logp).double()
    assert torch.allclose(kl_estimate(logp, ref, "k1").double(), -d, atol=1e-6)
    assert torch.allclose(kl_estimate(logp, ref, "k2").double(), 0.5 * d ** 2, atol=1e-6)
    assert torch.allclose(kl_estimate(logp, ref, "k3").double(), d.exp() - d - 1, atol=1e-5)
    assert bool((kl_estimate(logp, ref, "k3") >= 0).all())
    far = kl_estimate(torch.tensor([[-100.0]]), torch.tensor([[0.0]]), "k3")   # log-ratio clamped at 20
    assert torch.isfinite(far).all() and far.item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(logp, ref, "k4")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    assert fixed.update(10.0, 64) == 0.05
    ctl = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    coef = 0.2
    for kl, n in [(9.0, 256), (100.0, 256), (1.0, 128), (6.3, 64)]:
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        coef *= 1 + err * n / 10000
        assert ctl.update(kl, n) == pytest.approx(coef, rel=1e-12)
    resumed = AdaptiveKLController(0.2, target=6.0, horizon=10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="expected 'adaptive'"):
        resumed.load_state_dict(fixed.state_dict())


# ------------------------------------------------------------------------------ policy / value losses

def ref_ppo(logp, old, adv, mask, clip_low, clip_high, dual, agg, ent, ent_coef, ref, kl_coef, max_len):
    """Float64 per-token PPO loss with plain loops, aggregated by the definitions of the issue."""
    B, T = len(logp), len(logp[0])
    rows = []
    stats = {"clip": 0, "tok": 0, "dual": 0}
    for b in range(B):
        row = []
        for t in range(T):
            if not mask[b][t]:
                continue
            ratio = math.exp(logp[b][t] - old[b][t])
            a = adv[b][t]
            l1, l2 = -a * ratio, -a * min(max(ratio, 1 - clip_low), 1 + clip_high)
            stats["clip"] += l2 > l1
            stats["tok"] += 1
            loss = max(l1, l2)
            if dual is not None and a < 0:
                stats["dual"] += loss > -a * dual
                loss = min(loss, -a * dual)
            loss -= ent_coef * ent[b][t]
            d = ref[b][t] - logp[b][t]
            loss += kl_coef * (math.exp(d) - d - 1)
            row.append(loss)
        if row:
            rows.append(row)
    if agg == "token-mean":
        value = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    elif agg == "seq-mean-token-sum":
        value = sum(sum(r) for r in rows) / len(rows)
    elif agg == "seq-mean-token-mean":
        value = sum(sum(r) / len(r) for r in rows) / len(rows)
    else:
        value = sum(sum(r) / max_len for r in rows) / len(rows)
    return value, stats


def ppo_inputs(B=6, T=10, seed=6):
    g = gen(seed)
    mask = right_padded_mask(B, T, g)
    mask[4] = False                                             # an all-padding row: not a sequence
    mask[2, 4] = False
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3)   # ratios beyond the clip
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1
    logp[~mask] = float("-inf")                                 # padding must never be read
    return logp, old, adv, mask, ent, ref


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("dual", [None, 1.3])
def test_ppo_loss_against_reference(agg, dual):
    logp, old, adv, mask, ent, ref = ppo_inputs()
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual, agg=agg, entropy_coef=0.01, kl_coef=0.04,
              max_len=16)
    lp = logp.clone().requires_grad_(True)
    loss_sum, count, metrics = ppo_policy_loss(lp, old, adv, mask, entropy=ent, ref_logp=ref, **kw)
    want, stats = ref_ppo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28, dual, agg,
                          ent.tolist(), 0.01, ref.tolist(), 0.04, 16)
    assert (loss_sum / count).item() == pytest.approx(want, rel=1e-9)
    assert count.item() == (stats["tok"] if agg == "token-mean" else 5)
    assert count.dtype == torch.int
    assert metrics["clip_fraction"].tolist() == [stats["clip"], stats["tok"]]
    assert 0 < stats["clip"] < stats["tok"]                     # the clip is exercised both ways
    if dual is not None:
        assert 0 < stats["dual"] == metrics["dual_clip_fraction"][0].item()
    assert metrics["loss"].tolist() == pytest.approx([loss_sum.item(), count.item()])
    loss_sum.backward()
    assert torch.isfinite(lp.grad).all() and bool((lp.grad[~mask] == 0).all())


@pytest.mark.parametrize("agg", AGG_MODES)
def test_token_loss_with_weights_is_the_aggregated_loss(agg):
    """The fused head's form of the loss (ppo_token_loss on valid tokens, weighted by
    token_weights, summed) equals ppo_policy_loss's, value and gradient, for every aggregation."""
    logp, old, adv, mask, ent, ref = ppo_inputs(seed=3)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=1.3, entropy_coef=0.01, kl_coef=0.04)
    lp = logp.clone().requires_grad_(True)
    loss_sum, _, _ = ppo_policy_loss(lp, old, adv, mask, entropy=ent, ref_logp=ref, agg=agg, max_len=16, **kw)
    loss_sum.backward()
    m = mask.bool()
    lp_valid = logp[m].clone().requires_grad_(True)
    per_token, parts = ppo_token_loss(lp_valid, old[m], adv[m], entropy=ent[m], ref_logp=ref[m], **kw)
    folded = (per_token * token_weights(mask, agg, max_len=16, dtype=torch.float64)[m]).sum()
    folded.backward()
    assert folded.item() == pytest.approx(loss_sum.item(), rel=1e-12)
    torch.testing.assert_close(lp_valid.grad, lp.grad[m], rtol=1e-12, atol=1e-15)
    assert {"ratio", "log_ratio", "pg", "clipped", "dual_clipped", "kl"} <= parts.keys()
    assert token_weights(mask, agg, max_len=16)[~m].abs().sum() == 0
    with pytest.raises(ValueError, match="needs max_len"):
        token_weights(mask, "seq-mean-token-sum-norm")


def test_ppo_metrics_and_first_step_invariants():
    logp, old, adv, mask, ent, ref = ppo_inputs(seed=7)
    on = old.clone()
    on[~mask] = float("-inf")
    # policy == behaviour == reference: ratio 1, nothing clipped, approx_kl and KL 0 (first step)
    _, _, mt = ppo_policy_loss(on, old, adv, mask, entropy=ent, ref_logp=old, kl_coef=0.1)
    n = int(mask.sum())

    def mean(name):
        s, c = mt[name].tolist()
        assert c == n
        return s / c
    assert mean("ratio") == pytest.approx(1.0) and mean("clip_fraction") == 0
    assert mean("approx_kl") == 0 and mean("kl_loss") == 0
    assert mean("entropy") == pytest.approx(ent[mask].mean().item())
    assert mean("pg_loss") == pytest.approx(-adv[mask].mean().item())
    _, _, mt = ppo_policy_loss(logp, old, adv, mask)
    r = (logp - old)[mask]
    assert mean("approx_kl") == pytest.approx((r.exp() - 1 - r).mean().item(), rel=1e-9)
    assert "entropy" not in mt and "kl_loss" not in mt
    with pytest.raises(ValueError, match="needs max_len"):
        ppo_policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        ppo_policy_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="kl_coef != 0 needs the reference"):
        ppo_policy_loss(logp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match=r"one shape \[B, T\]"):
        ppo_policy_loss(logp, old[:, :-1], adv, mask)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_microbatch_split_reproduces_full_batch_loss_and_grad(agg):
    """The Role contract: sum(loss_sum) / sum(count) over any split equals the full batch, grads too."""
    logp, old, adv, mask, ent, ref = ppo_inputs(B=8, T=12, seed=8)
    kw = dict(clip_high=0.3, dual_clip=1.3, agg=agg, entropy_coef=0.02, kl_coef=0.05, max_len=12)

    def run(splits):
        lp, en = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        sums, counts = [], []
        for sl in splits:
            s, c, _ = ppo_policy_loss(lp[sl], old[sl], adv[sl], mask[sl], entropy=en[sl], ref_logp=ref[sl], **kw)
            sums.append(s)
            counts.append(c)
        total = sum(counts)
        (sum(sums) / total).backward()                          # what megatron does with the counts
        return (sum(sums) / total).item(), lp.grad, en.grad

    full = run([slice(0, 8)])
    for splits in ([slice(0, 3), slice(3, 4), slice(4, 8)], [slice(i, i + 1) for i in range(8)]):
        part = run(splits)
        assert part[0] == pytest.approx(full[0], rel=1e-12)
        assert torch.allclose(part[1], full[1], rtol=1e-12, atol=1e-15)
        assert torch.allclose(part[2], full[2], rtol=1e-12, atol=1e-15)
    # value loss: the same exactness
    g = gen(9)
    v, ov, ret = (torch.randn(8, 12, generator=g, dtype=torch.float64) for _ in range(3))

    def run_v(splits):
        vv = v.clone().requires_grad_(True)
        out = [value_loss(vv[sl], ov[sl], ret[sl], mask[sl], clip=0.2, agg=agg, max_len=12)[:2] for sl in splits]
        loss = sum(s for s, _ in out) / sum(c for _, c in out)
        loss.backward()
        return loss.item(), vv.grad
    fv, pv = run_v([slice(0, 8)]), run_v([slice(0, 5), slice(5, 8)])
    assert pv[0] == pytest.approx(fv[0], rel=1e-12) and torch.allclose(pv[1], fv[1], rtol=1e-12)


def test_value_loss_clipping_and_explained_variance():
    g = gen(10)
    B, T, c = 5, 8, 0.2
    mask = right_padded_mask(B, T, g)
    v, old, ret = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(3))
    loss_sum, count, mt = value_loss(v, old, ret, mask, clip=c)
    total, clipped, n = 0.0, 0, 0
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                vv, oo, rr = v[b, t].item(), old[b, t].item(), ret[b, t].item()
                e1 = (vv - rr) ** 2
                e2 = (oo + min(max(vv - oo, -c), c) - rr) ** 2
                total += 0.5 * max(e1, e2)
                clipped += e2 > e1
                n += 1
    assert count.item() == n and loss_sum.item() == pytest.approx(total, rel=1e-12)
    assert mt["value_clip_fraction"].tolist() == [clipped, n] and 0 < clipped < n
    assert value_loss(v, old, ret, mask)[0].item() == pytest.approx(
        0.5 * ((v - ret) ** 2)[mask].sum().item(), rel=1e-12)
    ev = explained_variance(v, ret, mask)
    r, d = ret[mask].tolist(), (ret - v)[mask].tolist()

    def var(xs):
        mu = sum(xs) / len(xs)
        return sum((x - mu) ** 2 for x in xs) / len(xs)
    assert ev.item() == pytest.approx(1 - var(d) / var(r), rel=1e-9)
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    assert math.isnan(explained_variance(v, torch.ones_like(ret), mask).item())


# ------------------------------------------------------------------------------ statistics across ranks

def _stats_inputs():
    g = gen(11)
    B, T = 7, 9
    mask = right_padded_mask(B, T, g)
    x, v = torch.randn(B, T, generator=g) * 2 + 1, torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    return x, v, mask, scores


def _dp_body(rank, world_size):
    import torch.distributed as dist
    x, v, mask, scores = _stats_inputs()
    rows = slice(0, 3) if rank == 0 else slice(3, 7)            # uneven split of the batch
    grp = dist.group.WORLD
    out = {"whiten": whiten(x[rows], mask[rows], group=grp),
           "rpp": whiten(reinforce_pp_returns(x[rows], mask[rows], 0.95), mask[rows], group=grp),
           "ev": explained_variance(v[rows], x[rows], mask[rows], group=grp)}
    return out


def test_statistics_over_data_parallel_ranks_equal_the_whole_batch():
    x, v, mask, scores = _stats_inputs()
    full = {"whiten": whiten(x, mask), "rpp": whiten(reinforce_pp_returns(x, mask, 0.95), mask),
            "ev": explained_variance(v, x, mask)}
    local = whiten(x[:3], mask[:3])
    assert not torch.allclose(local, full["whiten"][:3], atol=1e-3)   # a local whitening would differ
    ranks = run_distributed(_dp_body, 2)
    for rank, rows in ((0, slice(0, 3)), (1, slice(3, 7))):
        for key in ("whiten", "rpp"):
            assert torch.allclose(ranks[rank][key], full[key][rows], rtol=1e-6, atol=1e-6), key
        assert ranks[rank]["ev"].item() == pytest.approx(full["ev"].item(), rel=1e-12)
