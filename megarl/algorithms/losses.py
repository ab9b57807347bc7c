"""Losses in the Role loss contract: (loss_sum, count, {name: [sum, count]}).

Sums, not means: megatron-core divides gradients by the count summed over microbatches and
data-parallel ranks, so each step optimises the mean over the whole global batch.
"""
from __future__ import annotations

import torch


def _metric(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.stack([total.detach().double(), count.double()])


def masked_nll(token_logprobs: torch.Tensor, loss_mask: torch.Tensor):
    """Next-token negative log-likelihood over masked-in tokens.

    token_logprobs: [b, s] fp32 log p(label_t); loss_mask: [b, s] (1 = train on this token).
    """
    mask = loss_mask.to(token_logprobs.dtype)
    loss_sum = -(token_logprobs * mask).sum()
    count = mask.sum().to(torch.int)
    return loss_sum, count, {"loss": _metric(loss_sum, count)}


REWARD_POOLING = ("last", "mean")


def sequence_reward(values: torch.Tensor, first: torch.Tensor | None, last: torch.Tensor, pooling: str = "last"):
    """A reward model's per-token values [N, L] -> one reward per sequence [N].

    first, last: [N] columns of each row's first and last response token (inclusive); "last"
    reads no first column (None is fine there).
    "last": the value at the last token, the usual reading (it has attended to everything).
    "mean": the mean over the response tokens; every response position reports what it sees
    locally, so evidence that sits at one token (a misread quantity in line 1 of 3) reaches the
    reward without being carried to the end by attention first.
    """
    rows = torch.arange(values.shape[0], device=values.device)
    if pooling == "last":
        return values[rows, last]
    if pooling != "mean":
        raise ValueError(f"pooling must be one of {', '.join(REWARD_POOLING)}, got {pooling!r}")
    if first is None:
        raise ValueError("sequence_reward: pooling=mean needs each row's first response column")
    cols = torch.arange(values.shape[1], device=values.device)
    inside = (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])  # [N, L]
    n = inside.sum(1)
    if (n == 0).any():
        raise ValueError("sequence_reward: a row has no response token (first > last)")
    return (values * inside.to(values.dtype)).sum(1) / n.to(values.dtype)


def bradley_terry(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0, center_coef: float = 0.0):
    """Pairwise reward-model loss: -log sigmoid(r_c - r_r - margin) [+ coef * (r_c + r_r)^2].

    r_chosen, r_rejected: [n] rewards read at the last token of each prompt+response. The
    centring term (Eisenstein et al., 2023) pins the free additive constant of the rewards near 0.
    """
    diff = r_chosen.float() - r_rejected.float()
    per_pair = -torch.nn.functional.logsigmoid(diff - margin)
    if center_coef:
        per_pair = per_pair + center_coef * (r_chosen.float() + r_rejected.float()) ** 2
    loss_sum = per_pair.sum()
    n = torch.tensor(diff.numel(), dtype=torch.int)
    return loss_sum, n, {
        "loss": _metric(loss_sum, n),
        "accuracy": _metric((diff > 0).float().sum(), n),
        "reward_gap": _metric(diff.sum(), n),
        "reward_chosen": _metric(r_chosen.float().sum(), n),
        "reward_rejected": _metric(r_rejected.float().sum(), n),
    }
