"""pass@k and mean@k over n samples per prompt.

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating LLMs trained on code"): with
n samples of which c are correct, the chance that k samples drawn without replacement contain a
correct one, 1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge
binomials). Averaged over prompts it estimates the pass rate of k independent samples with less
variance than using only k samples per prompt.
"""
from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples, c of them correct (needs 0 <= c <= n, 1 <= k <= n)."""
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"pass_at_k: {name} must be an int, got {v!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over prompts; correct[p] lists prompt p's samples as correct or not."""
    if not correct:
        raise ValueError("mean_pass_at_k: no prompts")
    return sum(pass_at_k(len(s), sum(bool(x) for x in s), k) for s in correct) / len(correct)


def mean_at_k(scores: Sequence[Sequence[float]], k: int | None = None) -> float:
    """mean@k: the expected score of one sample, averaged over prompts, from k samples per prompt.

    The mean of all n samples of a prompt is the unbiased estimate (it is what averaging over
    every k-subset gives), so k only checks that each prompt has at least k samples (None: any).
    """
    if not scores:
        raise ValueError("mean_at_k: no prompts")
    total = 0.0
    for p, s in enumerate(scores):
        if not s or (k is not None and len(s) < k):
            raise ValueError(f"mean_at_k: prompt {p} has {len(s)} samples, needs at least {k or 1}")
        total += sum(float(x) for x in s) / len(s)
    return total / len(scores)
