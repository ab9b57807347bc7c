"""Rollout-training mismatch: its metrics, and the corrections of the policy loss for it.

The rollout engine and the trainer can give the same weights different probabilities (bf16
against fp32, other kernels, FP8 or a separate inference engine). The samples then come from
pi_rollout while the PPO ratio is anchored at pi_old, the trainer's log-probs of the same weights
(recomputed before the update), and every token is off-policy by rho = pi_old / pi_rollout.
Decoupled PPO (Hilton et al. 2021, as verl and slime use it) keeps the ratio pi / pi_old and
corrects for rho outside it:
  tis  each token's policy-gradient loss times min(rho_t, C), a constant (Yao et al. 2025):
       the truncation bounds the variance a token the engine found unlikely adds, at some bias;
  mis  rows whose geometric-mean ratio exp(mean_t log rho_t) leaves [lo, hi] leave the loss.
       The geometric mean rather than the product: the product compounds over a response's
       tokens, so one pair of bounds would reject long responses for their length alone, while
       the geometric mean is a per-token drift at any length (verl's and slime's "geometric").
Masked entries of the inputs are never read (they may hold anything).
"""
from __future__ import annotations

import math

import torch

from .losses import _metric

ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


def _log_rho(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if train_logp.shape != rollout_logp.shape or train_logp.shape != mask.shape or train_logp.dim() != 2:
        raise ValueError(f"expected log-probs and mask of one shape [B, T]; got {tuple(train_logp.shape)}, "
                         f"{tuple(rollout_logp.shape)} and {tuple(mask.shape)}")
    d = train_logp.detach().double() - rollout_logp.detach().double()
    return torch.where(mask.to(torch.bool), d, torch.zeros((), dtype=d.dtype, device=d.device))


def mismatch_metrics(train_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                     cap: float) -> tuple[dict, torch.Tensor]:
    """How far the trainer's log-probs are from the engine's on the sampled tokens (mask True).

    Returns ({name: [sum, count]}, largest |log pi_train - log pi_rollout|, a float64 scalar,
    0 without tokens). The pairs: logp_abs_diff_mean (per token); ratio_out_fraction, the share
    of tokens whose rho = pi_train / pi_rollout is outside [1/cap, cap]; seq_kl, KL(pi_rollout ||
    pi_train) of whole responses, estimated per row by k3 = rho - 1 - log rho summed over its
    tokens (the samples are pi_rollout's; k3 is unbiased and >= 0 where log rho summed, k1, can
    go negative), counted over rows with at least one token.
    """
    if not cap > 1:
        raise ValueError(f"the mismatch threshold must be > 1, got {cap}")
    m = mask.to(torch.bool)
    d = _log_rho(train_logp, rollout_logp, m)
    n_tok = m.sum()
    k3 = torch.expm1(d) - d                                     # 0 off the mask (d = 0 there)
    out = (d.abs() > math.log(cap)) & m
    pairs = {"logp_abs_diff_mean": _metric(d.abs().sum(), n_tok),
             "ratio_out_fraction": _metric(out.sum().double(), n_tok),
             "seq_kl": _metric(k3.sum(), (m.sum(1) > 0).sum())}
    return pairs, d.abs().max() if d.numel() else torch.zeros((), dtype=torch.float64)


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap) per token [B, T] in old_logp's dtype, 0 off the mask; no
    gradient (the weight corrects the sampling distribution; it is not optimised)."""
    if not cap > 1:
        raise ValueError(f"the TIS cap must be > 1, got {cap}")
    d = _log_rho(old_logp, rollout_logp, mask)
    w = torch.exp(d.clamp(max=math.log(cap)))                 # = min(rho, cap), and exp cannot overflow
    return torch.where(mask.to(torch.bool), w, torch.zeros((), dtype=w.dtype)).to(old_logp.dtype)


def mis_keep(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, lo: float,
             hi: float) -> torch.Tensor:
    """[B] bool: rows whose geometric-mean ratio exp(mean over its tokens of log(pi_old /
    pi_rollout)) lies in [lo, hi] (rows without tokens are kept: they have no loss anyway)."""
    if not 0 < lo <= 1 <= hi:
        raise ValueError(f"the MIS bounds need 0 < lo <= 1 <= hi, got lo={lo}, hi={hi}")
    m = mask.to(torch.bool)
    d = _log_rho(old_logp, rollout_logp, m)
    mean = d.sum(1) / m.sum(1).clamp(min=1).to(d.dtype)
    return (mean >= math.log(lo)) & (mean <= math.log(hi))
