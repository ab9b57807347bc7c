"""Offline preference losses on sequence log-probs: DPO, IPO and SimPO, in the Role loss contract.

Inputs are per pair: the summed log-probs of the chosen and rejected response tokens under the
policy (and the frozen reference), and each response's token count. A loss needs only these
sums, so the trainer reduces each row to them and nothing here sees a vocabulary.

- `sigmoid` (DPO, Rafailov et al. 2023): h = beta * [(log pi - log ref)(chosen) - (same)(rejected)],
  loss = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h); eps > 0 is conservative DPO's label
  smoothing (labels flipped with probability eps).
- `ipo` (Azar et al. 2023): loss = (d - 1 / (2 beta))^2 with beta as the paper's tau, on the
  length-averaged log-ratios d (per token): the squared loss would otherwise grow with the
  response length; TRL's DPOTrainer averages too, a choice the IPO authors confirmed to TRL.
- `simpo` (Meng et al. 2024): reference-free, on the length-averaged policy log-probs,
  loss = -log sigmoid(beta * (avg log pi(chosen) - avg log pi(rejected)) - gamma), gamma the
  target margin in reward units (TRL's CPOTrainer: simpo_gamma).

Implicit rewards: beta * (log pi - log ref), summed over the response (DPO and IPO, as TRL logs
them), and beta * avg log pi for SimPO (its own reward). Accuracy: the chosen reward above the
rejected one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.algorithms.losses import _metric

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")
REFERENCE_FREE = ("simpo",)


def preference_loss(kind: str, logp_chosen: torch.Tensor, logp_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor | None, ref_rejected: torch.Tensor | None,
                    len_chosen: torch.Tensor, len_rejected: torch.Tensor, *, beta: float,
                    label_smoothing: float = 0.0, gamma: float = 0.0):
    """(loss_sum, count, metrics) over n pairs; every tensor is [n].

    logp_*: summed policy log-probs of the response tokens; ref_*: the reference's (None for the
    reference-free `simpo`); len_*: response token counts (>= 1).
    """
    if kind not in PREFERENCE_LOSSES:
        raise ValueError(f"preference loss must be one of {', '.join(PREFERENCE_LOSSES)}, got {kind!r}")
    lc, lr = logp_chosen.float(), logp_rejected.float()
    nc, nr = len_chosen.to(lc.dtype).clamp(min=1), len_rejected.to(lc.dtype).clamp(min=1)
    if kind == "simpo":
        reward_c, reward_r = beta * lc / nc, beta * lr / nr
        per_pair = -F.logsigmoid(reward_c - reward_r - gamma)
    else:
        if ref_chosen is None or ref_rejected is None:
            raise ValueError(f"preference loss {kind!r} needs the reference's log-probs")
        ratio_c, ratio_r = lc - ref_chosen.float(), lr - ref_rejected.float()
        reward_c, reward_r = beta * ratio_c, beta * ratio_r
        if kind == "sigmoid":
            h = reward_c - reward_r
            per_pair = -(1 - label_smoothing) * F.logsigmoid(h) - label_smoothing * F.logsigmoid(-h)
        else:
            per_pair = (ratio_c / nc - ratio_r / nr - 1 / (2 * beta)) ** 2
    loss_sum = per_pair.sum()
    n = torch.tensor(lc.numel(), dtype=torch.int)
    with torch.no_grad():
        margin = reward_c - reward_r
        return loss_sum, n, {
            "loss": _metric(loss_sum, n),
            "reward_chosen": _metric(reward_c.sum(), n),
            "reward_rejected": _metric(reward_r.sum(), n),
            "reward_margin": _metric(margin.sum(), n),
            "reward_accuracy": _metric((margin > 0).float().sum(), n),
            "logp_chosen": _metric(lc.sum(), n),
            "logp_rejected": _metric(lr.sum(), n),
            # the policy alone prefers the chosen response (summed log-probs): comparable with a
            # model that has no reference, e.g. the SFT model DPO starts from
            "likelihood_accuracy": _metric((lc > lr).float().sum(), n),
        }
