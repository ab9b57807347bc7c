"""DAPO's sampling and shaping (Yu et al. 2025): which prompt groups carry a learning signal, and
the soft penalty for responses that run into the length limit. Pure functions of tensors."""
from __future__ import annotations

import torch


def groups_with_signal(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] scores, laid out group by group -> [N / group_size] bool: True where the group's
    rewards are not all equal. A group whose samples all score alike has zero group-relative
    advantage (GRPO, RLOO, REINFORCE): it only dilutes the batch, so dynamic sampling replaces it."""
    if scores.dim() != 1 or group_size < 1 or scores.numel() % group_size:
        raise ValueError(f"{tuple(scores.shape)} scores cannot be split into groups of {group_size}")
    g = scores.detach().view(-1, group_size)
    return (g != g[:, :1]).any(1)


def overlong_penalty(response_lens: torch.Tensor, max_new_tokens: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment per response, [N] lengths -> [N] fp32 penalties <= 0.

    With L = max_new_tokens and a buffer of B tokens before it, a response of length y gets
        0                            if y <= L - B,
        factor * (L - B - y) / B     if L - B < y <= L   (linear, reaching -factor at y = L),
    added to its reward, so that the model learns to finish before the limit rather than be
    cut. The engine never samples past L, so the third case of the paper (y > L: -1) is y = L.
    """
    if not 0 < buffer <= max_new_tokens:
        raise ValueError(f"overlong buffer must be in [1, max_new_tokens={max_new_tokens}], got {buffer}")
    y = response_lens.double()
    start = float(max_new_tokens - buffer)
    penalty = (start - y).clamp(min=-float(buffer), max=0.0) / buffer
    return (factor * penalty).float()
