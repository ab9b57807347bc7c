"""PPO-family policy and value losses in the Role loss contract: (loss_sum, count, metrics).

loss_sum is a differentiable scalar SUM over the micro-batch and count the number of units it
averages over; megatron-core divides the gradient by the count summed over micro-batches and
data-parallel ranks. So every aggregation below is written as (sum of per-unit losses, units):
  token-mean               sum_b,t l / tokens                          count = tokens
  seq-mean-token-sum       sum_b (sum_t l) / sequences                 count = sequences
  seq-mean-token-mean      sum_b (sum_t l / tokens_b) / sequences      count = sequences
  seq-mean-token-sum-norm  sum_b (sum_t l / max_len) / sequences       count = sequences (Dr. GRPO)
A sequence is never split across micro-batches, so any split of a batch gives the same mean.
"Sequences" are rows with at least one valid token (all-padding rows do not count).
Metrics are {name: tensor([sum, count])} with token counts, summed by the trainer.
"""
from __future__ import annotations

import torch

from .advantages import _moments
from .kl import kl_estimate
from .losses import _metric

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# The log of the importance ratio is clamped before exp, so that a token whose probability moved
# by more than e^20 cannot overflow; PPO's clip makes such tokens irrelevant to the gradient anyway.
LOG_RATIO_CLAMP = 20.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) of a per-token loss [B, T] under one of AGG_MODES (see the module docstring).

    Masked entries are never read (they may be inf/nan). max_len: the constant normaliser of
    seq-mean-token-sum-norm (the maximum response length of the run), required there only.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {agg!r}: expected one of {', '.join(AGG_MODES)}")
    m = mask.to(torch.bool)
    masked = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if agg == "token-mean":
        return masked.sum(), m.sum().to(torch.int)
    tok_sum = masked.sum(1)                                     # [B]
    n_tok = m.sum(1)                                            # [B]
    count = (n_tok > 0).sum().to(torch.int)
    if agg == "seq-mean-token-sum":
        return tok_sum.sum(), count
    if agg == "seq-mean-token-mean":
        return (tok_sum / n_tok.clamp(min=1).to(tok_sum.dtype)).sum(), count
    if not max_len or max_len <= 0:
        raise ValueError("loss aggregation 'seq-mean-token-sum-norm' needs max_len > 0 "
                         "(the maximum response length)")
    return tok_sum.sum() / float(max_len), count


def _check_same_shape(**tensors) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1 or any(len(s) != 2 for s in shapes.values()):
        raise ValueError("expected tensors of one shape [B, T]; got "
                         + ", ".join(f"{k} {s}" for k, s in shapes.items()))


def ppo_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, *, clip_low: float = 0.2, clip_high: float = 0.2,
                    dual_clip: float | None = None, agg: str = "token-mean",
                    entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                    ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, kl_kind: str = "k3",
                    max_len: int | None = None, is_weight: torch.Tensor | None = None):
    """PPO clipped surrogate (+ entropy bonus, + KL-to-reference loss term), per token then aggregated.

    logp: [B, T] log pi(a_t) under the current parameters (differentiable); old_logp: the
    behaviour policy's (rollout/recomputed), ref_logp: the reference's, advantages: [B, T]
    (all three treated as constants); mask: [B, T] True on response tokens; entropy: [B, T]
    per-token entropy of pi (differentiable) or None.
    Per token: l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) with r = exp(logp - old_logp)
    (clip_high > clip_low is DAPO's clip-higher); with dual_clip = c > 1 (Ye et al. 2020), tokens
    with A < 0 take min(l, -A c), bounding the loss of a very large ratio. Then
    l - entropy_coef * H + kl_coef * KL_kind(pi || ref) (GRPO's KL as a loss term). is_weight:
    [B, T] constants multiplying the clipped surrogate only (mismatch.tis_weights: the samples'
    own importance weight; the entropy and KL terms are not estimates under the samples).
    Metrics ([sum, tokens]): loss (with the aggregation's count), pg_loss, clip_fraction (tokens
    where the clipped branch is the active one), dual_clip_fraction, ratio (mean r), approx_kl
    (k3 = r - 1 - log r, estimating KL(old || new) from the old policy's samples), entropy
    (when given), kl_loss (mean unscaled KL estimate to the reference, when ref_logp is given).
    """
    _check_same_shape(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask,
                      entropy=entropy, ref_logp=ref_logp, is_weight=is_weight)
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"PPO clip ranges must be >= 0; got clip_low={clip_low}, clip_high={clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")
    if entropy_coef and entropy is None:
        raise ValueError("entropy_coef != 0 needs the per-token entropy")
    if kl_coef and ref_logp is None:
        raise ValueError("kl_coef != 0 needs the reference log-probs (ref_logp)")
    m = mask.to(torch.bool)
    n_tok = m.sum().to(torch.int)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    def valid(x):  # padding may hold -inf/nan; zero it first so no gradient ever meets it
        return None if x is None else torch.where(m, x.to(logp.dtype), zero)

    def tok_metric(x):                                          # [sum over valid tokens, tokens]
        return _metric(torch.where(m, x.detach().to(logp.dtype), zero).sum(), n_tok)

    logp, old_logp, entropy, ref_logp = valid(logp), valid(old_logp), valid(entropy), valid(ref_logp)
    per_token, parts = ppo_token_loss(
        logp, old_logp, valid(advantages.detach()), clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        entropy=entropy, entropy_coef=entropy_coef, ref_logp=ref_logp, kl_coef=kl_coef, kl_kind=kl_kind,
        is_weight=valid(is_weight))
    metrics = {"clip_fraction": tok_metric(parts["clipped"])}
    if dual_clip is not None:
        metrics["dual_clip_fraction"] = tok_metric(parts["dual_clipped"])
    metrics["pg_loss"] = tok_metric(parts["pg"])
    metrics["ratio"] = tok_metric(parts["ratio"])
    metrics["approx_kl"] = tok_metric(parts["ratio"] - 1.0 - parts["log_ratio"])
    if entropy is not None:
        metrics["entropy"] = tok_metric(entropy)
    if ref_logp is not None:
        metrics["kl_loss"] = tok_metric(parts["kl"])
    loss_sum, count = aggregate(per_token, m, agg, max_len)
    metrics["loss"] = _metric(loss_sum, count)
    return loss_sum, count, metrics


def ppo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                   clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                   entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                   ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0, kl_kind: str = "k3",
                   is_weight: torch.Tensor | None = None):
    """The per-token loss of `ppo_policy_loss` before aggregation, on valid tokens of any shape
    (no mask: every entry counts, none may be nan). Each token's loss depends on that token's
    log-prob and entropy only, which lets the fused output layer take its gradient chunk by chunk
    (`megarl.ops.linear_token_loss`). Returns (per_token, parts) with the parts the metrics
    read: ratio, log_ratio, pg, clipped (bool), dual_clipped (bool, with dual_clip), kl (with
    ref_logp)."""
    log_ratio = (logp - old_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    parts = {"ratio": ratio, "log_ratio": log_ratio, "clipped": pg_clipped > pg_unclipped}
    if dual_clip is not None:
        pg_dual = -adv * dual_clip
        negative = adv < 0
        parts["dual_clipped"] = negative & (pg > pg_dual)
        pg = torch.where(negative, torch.minimum(pg, pg_dual), pg)
    if is_weight is not None:
        pg = pg * is_weight.detach()
    parts["pg"] = pg
    per_token = pg
    if entropy is not None and entropy_coef:
        per_token = per_token - entropy_coef * entropy
    if ref_logp is not None:
        parts["kl"] = kl = kl_estimate(logp, ref_logp.detach(), kl_kind)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    return per_token, parts


def token_weights(mask: torch.Tensor, agg: str = "token-mean", max_len: int | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [B, T] of dtype with sum(w * l) = `aggregate(l, mask, agg, max_len)`'s loss_sum for any
    per-token loss l [B, T] (0 off the mask): every aggregation is linear in the per-token loss.
    The fused output layer weighs each token's gradient with it."""
    aggregate(mask.new_zeros(mask.shape, dtype=torch.float32), mask, agg, max_len)  # checks agg, max_len
    m = mask.to(torch.bool)
    w = m.to(dtype)
    if agg == "seq-mean-token-mean":
        w = w / m.sum(1, keepdim=True).clamp(min=1).to(dtype)
    elif agg == "seq-mean-token-sum-norm":
        w = w / float(max_len)
    return w


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, *, clip: float | None = None, agg: str = "token-mean",
               max_len: int | None = None):
    """Critic loss 0.5 (V - R)^2 per token, with PPO value clipping, in the Role loss contract.

    values: [B, T] (differentiable); old_values: the critic's values at rollout time; returns:
    the targets (e.g. from gae_advantages); mask: [B, T]. With clip = c, per token
    0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2): the critic cannot gain by moving
    further than c from its rollout-time value (Schulman et al.'s PPO implementation).
    Metrics ([sum, tokens]): value_loss, value_clip_fraction (tokens where the clipped error is
    the larger one), value_mean, return_mean; loss with the aggregation's count.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = mask.to(torch.bool)
    n_tok = m.sum().to(torch.int)
    v = values.float() if values.dtype != torch.float64 else values
    zero = torch.zeros((), dtype=v.dtype, device=v.device)

    def tok_metric(x):
        return _metric(torch.where(m, x.detach().to(v.dtype), zero).sum(), n_tok)

    ret = returns.detach().to(v.dtype)
    err = (v - ret).square()
    metrics = {}
    if clip is not None and clip > 0:
        old = old_values.detach().to(v.dtype)
        v_clipped = old + (v - old).clamp(-clip, clip)
        err_clipped = (v_clipped - ret).square()
        metrics["value_clip_fraction"] = tok_metric(err_clipped > err)
        err = torch.maximum(err, err_clipped)
    elif clip is not None and clip < 0:
        raise ValueError(f"value clip must be > 0 (or None), got {clip}")
    per_token = 0.5 * err
    metrics["value_loss"] = tok_metric(per_token)
    metrics["value_mean"] = tok_metric(v)
    metrics["return_mean"] = tok_metric(ret)
    loss_sum, count = aggregate(per_token, m, agg, max_len)
    metrics["loss"] = _metric(loss_sum, count)
    return loss_sum, count, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       group=None) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over valid tokens (1: perfect critic, 0: no better than a constant).

    A float64 scalar; NaN when the returns have no variance (fewer than 2 tokens or all equal).
    Not a [sum, count] pair: compute it on the whole batch, not per micro-batch; group: over all
    ranks of this process group (the data-parallel group).
    """
    _check_same_shape(values=values, returns=returns, mask=mask)
    m = mask.to(torch.bool)
    v, r = values.detach().double()[m], returns.detach().double()[m]
    count, _, m2_r = _moments(r, group)
    _, _, m2_err = _moments(r - v, group)
    if count < 2 or m2_r == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return 1.0 - m2_err / m2_r
