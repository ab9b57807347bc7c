"""Sampling maths for the rollout engine: pure functions, tensors in, tensors out.

Randomness is counter-based: the uniform that picks the token of row r at decode step t is a
hash of (seed, global sample id of r, t), and the token is drawn by inverse CDF over the
vocabulary in id order. So a sample depends only on its own logits and its key, never on the
batch it was generated in, the micro-batching, or the TP/PP layout (up to fp rounding of the
logits), and DP ranks draw different samples by passing different sample ids.

"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SamplingParams:
    n: int = 1                 # samples per prompt
    temperature: float = 1.0
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1.0 = off; top-k and top-p may be combined (top-k first)
    greedy: bool = False
    max_new_tokens: int = 64
    stop_ids: tuple = ()       # any of these ends a sequence (the stop token is kept)
    stop_strings: tuple = ()   # needs a decode function given to the engine
    logprobs: bool = True      # False: skip the per-token log-probs (Rollout.logprobs is all 0)

    def validate(self) -> None:
        """One-line ValueError naming the bad field."""
        if not (isinstance(self.n, int) and self.n >= 1):
            raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingParams.temperature must be > 0, got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1):
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"SamplingParams.stop_strings must be non-empty strings, got {self.stop_strings!r}")


# ---------------------------------------------------------------- counter-based uniforms

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser (Steele et al. 2014) on uint64 arrays; wraps modulo 2^64."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def row_uniforms(seed: int, sample_ids: torch.Tensor, step: int) -> torch.Tensor:
    """U[0, 1) per row, a pure function of (seed, sample id, step): [N] long -> [N] float64.

    40 random bits: u <= 1 - 2^-40, so u * total stays strictly below total in float64 and the
    inverse-CDF search below always lands on a token of positive probability.
    """
    return uniform_table(seed, sample_ids, [step])[:, 0]


def uniform_table(seed: int, sample_ids: torch.Tensor, steps) -> torch.Tensor:
    """row_uniforms for every step at once: [N] sample ids, [S] steps -> [N, S] float64 on the
    host, so that a decode loop looks its uniforms up on the device instead of hashing per step."""
    ids = sample_ids.cpu().numpy().astype(np.uint64)
    h = _splitmix64(np.full(ids.shape, np.uint64(seed & 0xFFFFFFFFFFFFFFFF)))
    h = _splitmix64(h ^ ids)
    steps = np.asarray([int(t) & 0xFFFFFFFFFFFFFFFF for t in steps], dtype=np.uint64)
    h = _splitmix64(h[:, None] ^ steps[None, :])
    return torch.from_numpy((h >> np.uint64(24)).astype(np.float64) * 2.0 ** -40)


# ---------------------------------------------------------------- filtering and drawing

def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The logits of the distribution that is sampled: [N, V] (true vocabulary only) -> [N, V]
    fp32, -inf outside the top-k / top-p support (top-k first, then top-p on the renormalised
    temperature-scaled probabilities, as transformers does). Temperature itself is not applied
    here: the sampled distribution is softmax(filtered / temperature)."""
    z = logits.float()
    vocab = z.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(z, params.top_k, dim=-1).values[:, -1:]  # [N, 1]
        z = z.masked_fill(z < kth, float("-inf"))  # ties at the k-th value stay in
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z / params.temperature, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive prefix sum
        drop_sorted = mass_before >= params.top_p  # the first token always stays (mass 0 before it)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return z  # may be the input itself when nothing is filtered: callers do not write to it


def sample_tokens(filtered: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor | None,
                  with_logprobs: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token ids [N] and their log-probs [N] fp32 (or None) from filtered logits [N, V]; the
    uniforms [N] float64 are on the logits' device.

    Greedy: argmax (lowest id on ties, like torch.argmax). Otherwise inverse CDF in id order:
    the first id whose cumulative probability exceeds u * total, u the row's uniform [N].
    One exp pass serves both the draw and log p(id) = z_id - max z - log sum exp(z - max z),
    z = filtered / temperature (tests check it equals megarl.ops.logprobs_and_entropy).
    """
    if params.greedy and not with_logprobs:
        return filtered.argmax(dim=-1), None
    z = filtered.float() if params.temperature == 1.0 else filtered.float() / params.temperature
    zmax = z.amax(dim=-1, keepdim=True)  # [N, 1]
    e = torch.exp(z - zmax)  # [N, V]; 0 at filtered (-inf) ids
    if params.greedy:
        ids = z.argmax(dim=-1)
        total = e.sum(dim=-1, dtype=torch.float64)
    else:
        ids, total = _inverse_cdf(e, uniforms)
    if not with_logprobs:
        return ids, None
    lp = (z.gather(-1, ids[:, None]) - zmax).squeeze(-1) - torch.log(total).float()
    return ids, lp


_CDF_BLOCK = 2048  # vocabulary ids per block of the two-level inverse CDF


def _inverse_cdf(e: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draw in id order from unnormalised probabilities e [N, V] >= 0: (ids [N], total
    [N] fp64). The first id whose cumulative mass exceeds u * total, found in two levels: the sums of
    blocks of _CDF_BLOCK ids, accumulated in fp64, pick the block; a cumulative sum inside that block
    alone picks the id.
    The same draw as one fp64 cumsum over V up to rounding (the block sums are fp32 sums of at most
    _CDF_BLOCK terms), with a fraction of its memory traffic at a 152k vocabulary.
    Never returns an id of zero mass: the block and the id are each the first whose cumulative
    sum strictly exceeds the target, which the target is kept below. No host read: the draw
    stays on the device."""
    N, V = e.shape
    Bk = _CDF_BLOCK
    full = V // Bk
    # block sums in e's dtype (a sum with dtype=float64 would first copy all of e to float64: 5x the
    # time), accumulated across blocks in float64
    parts = [e[:, : full * Bk].view(N, full, Bk).sum(-1)] if full else []
    if V > full * Bk:
        parts.append(e[:, full * Bk:].sum(-1, keepdim=True))
    block_cdf = torch.cumsum(torch.cat(parts, dim=1).double(), dim=1)  # [N, nb]
    total = block_cdf[:, -1]
    target = uniforms * total  # [N] < total: u <= 1 - 2^-40 (uniforms on e's device)
    block = torch.searchsorted(block_cdf, target[:, None], right=True).squeeze(-1).clamp_(max=block_cdf.shape[1] - 1)
    rows = torch.arange(N, device=e.device)
    before = torch.where(block > 0, block_cdf[rows, (block - 1).clamp(min=0)], torch.zeros_like(total))
    cols = block[:, None] * Bk + torch.arange(Bk, device=e.device)[None, :]  # [N, Bk]
    inside = cols < V
    seg = torch.where(inside, e.gather(1, cols.clamp(max=V - 1)), torch.zeros((), dtype=e.dtype, device=e.device))
    cdf = torch.cumsum(seg, dim=1, dtype=torch.float64)  # [N, Bk] within the block
    # target - before >= 0 exactly; below the block's own last cumulative value so that the id found
    # has positive mass even where the block's sum and its cumsum round differently
    local = torch.minimum(target - before, torch.nextafter(cdf[:, -1], torch.zeros_like(total)))
    k = torch.searchsorted(cdf, local[:, None], right=True).squeeze(-1).clamp_(max=Bk - 1)
    return (block * Bk + k).clamp_(max=V - 1), total
