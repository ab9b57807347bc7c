"""Advantage estimators, rewards per token, whitening and reward clipping.

Which estimator an algorithm uses, and its whitening, is said once in spec.py.

Sequence-level estimators (GRPO, RLOO, REINFORCE) take one score per response, laid out group
by group: scores[g * group_size + i] is sample i of prompt g, the order the rollout returns.
Token-level estimators (GAE, REINFORCE++) take per-token rewards [B, T] and a mask [B, T] that is
True on response tokens. Everything here is a pure function without gradients.
"""
from __future__ import annotations

import torch
import torch.distributed as dist



def _moments(values: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(count, mean, sum of squared deviations) of 1-D float64 values, over every rank of `group`
    when one is given (e.g. the data-parallel group, so that statistics are the global batch's
    at any layout), else over this tensor. Two all-reduces; the result is the same on all ranks."""
    stats = torch.stack([torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
                         values.sum()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    count, total = stats[0], stats[1]
    mean = total / count.clamp(min=1.0)
    m2 = (values - mean).square().sum()
    if group is not None:
        dist.all_reduce(m2, group=group)
    return count, mean, m2


def _groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] -> [N / group_size, group_size] (float64 for the statistics, cast back by the caller)."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be [N], got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{scores.numel()} scores cannot be split into groups of {group_size} "
                         f"(n_samples per prompt)")
    return scores.detach().double().view(-1, group_size)


def grpo_advantages(scores: torch.Tensor, group_size: int, *, scale_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); scores [N] -> [N].

    std is the unbiased (n-1) sample std, as in DeepSeekMath/TRL. scale_by_std=False is Dr. GRPO
    (Liu et al. 2025): dividing by std over-weights groups that are nearly all right or all wrong.
    A group of one sample has advantage 0.
    """
    g = _groups(scores, group_size)                             # [G, n]
    adv = g - g.mean(1, keepdim=True)
    if scale_by_std and group_size > 1:
        adv = adv / (g.std(1, keepdim=True) + eps)
    return adv.view(-1).to(_float(scores))


def rloo_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): r_i minus the mean of the other samples of its group; [N] -> [N].

    Equal to n/(n-1) (r_i - group mean); needs group_size >= 2.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt, got group_size={group_size}")
    g = _groups(scores, group_size)
    baseline = (g.sum(1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).view(-1).to(_float(scores))


def reinforce_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE with the group mean as baseline (nanochat's chat_rl): r - mean(group); [N] -> [N]."""
    g = _groups(scores, group_size)
    return (g - g.mean(1, keepdim=True)).view(-1).to(_float(scores))


def reinforce_pp_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): the discounted return-to-go per token, [B, T], 0 where masked.

    token_rewards, mask: [B, T] (rewards typically from token_rewards(): score at the last token
    minus the KL penalty). The return is GAE with values 0 and lambda 1 (`gae`), so a
    hole in the mask is skipped, not an end. REINFORCE++ then whitens it over the global batch
    (spec.py applies whitening for every algorithm alike).
    """
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)
    return returns


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [B, T] responses, walking each row's valid tokens
    backwards: delta_t = r_t + gamma V_next - v_t, A_t = delta_t + gamma lam A_next, R_t = A_t + v_t,
    where "next" is the next valid token and V_next = A_next = 0 after the last one, so nothing
    leaks past a response. A masked token inside a response (a tool observation) is skipped, not
    an end. Returns (advantages, returns), fp32 (fp64 for fp64 inputs), 0 where masked; no
    gradient. One step per column: GAE is a few ms of an RL step. (On CUDA tensors
    `megarl.ops.gae` runs the same recurrence as one kernel.)"""
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    dt = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    m = mask.to(device=rewards.device, dtype=torch.bool)
    with torch.no_grad():
        r = torch.where(m, rewards.to(dt), 0.0)
        v = torch.where(m, values.to(dt), 0.0)
        adv = torch.zeros_like(r)
        next_value = r.new_zeros(r.shape[0])
        next_adv = r.new_zeros(r.shape[0])
        for t in reversed(range(r.shape[1])):
            mt = m[:, t]
            a = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
            adv[:, t] = torch.where(mt, a, 0.0)
            next_value = torch.where(mt, v[:, t], next_value)
            next_adv = torch.where(mt, a, next_adv)
        return adv, adv + v


def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                   gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE (Schulman et al. 2016): (advantages, returns), each [B, T], 0 where masked.

    The advantages are not whitened here; call whiten() on them (PPO usually does).
    """
    return gae(token_rewards.detach(), values.detach(), mask, gamma, lam)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8, *,
           group=None) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the entries where mask is True; 0 where masked.

    var is the unbiased (n-1) variance of the masked entries (as verl/OpenRLHF). shift_mean=False
    adds the mean back (scales only), keeping the sign of a batch that is all positive.
    Fewer than 2 valid entries: no scaling (variance taken as 1).
    group: a process group (the data-parallel group) to take the statistics over all its ranks'
    entries, so that the result does not depend on how the batch is split; None: this tensor only.
    """
    if x.shape != mask.shape:
        raise ValueError(f"x and mask must have the same shape; got {tuple(x.shape)} and {tuple(mask.shape)}")
    m = mask.to(torch.bool)
    x64 = x.detach().double()
    count, mean, m2 = _moments(x64[m], group)
    n = int(count)
    var = m2 / (n - 1) if n > 1 else x64.new_ones(())           # unbiased; 1 (no scaling) below 2 entries
    out = (x64 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros((), dtype=out.dtype)).to(_float(x))


def broadcast_to_tokens(seq_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence [N] -> the same value on each of its valid tokens [N, T] (0 elsewhere)."""
    if seq_advantages.dim() != 1 or mask.dim() != 2 or mask.shape[0] != seq_advantages.shape[0]:
        raise ValueError(f"expected seq_advantages [N] and mask [N, T]; got {tuple(seq_advantages.shape)} "
                         f"and {tuple(mask.shape)}")
    return seq_advantages.detach()[:, None] * mask.to(seq_advantages.dtype)


def token_rewards(scores: torch.Tensor, response_mask: torch.Tensor,
                  kl_penalty: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token rewards for PPO/REINFORCE++: each row's score on its last valid token, minus kl_penalty.

    scores: [N]; response_mask: [N, T] (True on response tokens; every row needs one);
    kl_penalty: [N, T] already multiplied by the KL coefficient (e.g. coef * kl_estimate(...)),
    or None. Returns [N, T] fp32 (fp64 if scores are), 0 where masked.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(f"expected scores [N] and response_mask [N, T]; got {tuple(scores.shape)} "
                         f"and {tuple(response_mask.shape)}")
    m = response_mask.to(torch.bool)
    has_token = m.any(1)
    if not bool(has_token.all()):
        rows = torch.nonzero(~has_token).flatten().tolist()
        raise ValueError(f"response_mask rows {rows[:8]} have no response token to put the score on")
    T = m.shape[1]
    last = T - 1 - m.flip(1).to(torch.int8).argmax(1)           # [N] index of the last True
    dtype = _float(scores)
    out = torch.zeros(m.shape, dtype=dtype, device=scores.device)
    out[torch.arange(m.shape[0], device=scores.device), last] = scores.detach().to(dtype)
    if kl_penalty is not None:
        if kl_penalty.shape != m.shape:
            raise ValueError(f"kl_penalty must be [N, T] like response_mask; got {tuple(kl_penalty.shape)}")
        out = out - torch.where(m, kl_penalty.detach().to(dtype), torch.zeros((), dtype=dtype))
    return out


# ------------------------------------------------------------------ reward clipping

def clip_rewards(x: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Clamp rewards to [-clip, clip]; None or 0 leaves them unchanged."""
    if not clip:
        return x
    if clip < 0:
        raise ValueError(f"reward clip must be > 0, got {clip}")
    return x.clamp(-clip, clip)


def _float(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32
