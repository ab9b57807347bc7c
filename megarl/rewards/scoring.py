"""Loading reward functions by name or dotted path, and scoring a batch with error isolation."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from megarl.utils.imports import import_user_module

from .rules import BUILTINS, RewardFn, weighted_sum

log = logging.getLogger("megarl.rewards")

_SHOW = 200  # characters of a prompt/response shown in a failure report


class RewardError(RuntimeError):
    """Too many samples of a batch failed to score; the message is one line, ready to print."""


def load_reward_fn(spec) -> RewardFn:
    """A reward function from a built-in name, "module:function", "path/to/file.py:function",
    a callable, or a list of [spec, weight] pairs / {"fn": spec, "weight": w} dicts (weighted sum).

    Built-in names: final_answer, gsm8k, exact_match, format. Raises ValueError naming what is wrong.
    """
    if callable(spec):
        return spec
    if isinstance(spec, (list, tuple)):
        terms = []
        for i, term in enumerate(spec):
            if isinstance(term, dict) and set(term) <= {"fn", "name", "weight"} and ("fn" in term or "name" in term):
                sub, weight = term.get("fn", term.get("name")), term.get("weight", 1.0)
            elif isinstance(term, (list, tuple)) and len(term) == 2:
                sub, weight = term
            else:
                raise ValueError(f"reward term {i} must be [name_or_path, weight] or "
                                 f"{{fn: name_or_path, weight: w}}, got {term!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"reward term {i}: weight must be a number, got {weight!r}")
            terms.append((load_reward_fn(sub), float(weight)))
        return weighted_sum(terms)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward function must be a built-in name or 'module:function', got {spec!r}")
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown reward function {spec!r}: expected a built-in "
                         f"({', '.join(sorted(BUILTINS))}) or 'module:function'")
    module = _import(module_name, spec)
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"reward function {spec!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable (it is a {type(fn).__name__})")
    return fn


def _import(module_name: str, spec: str):
    return import_user_module(module_name, f"reward function {spec!r}", "megarl_user_reward_")


@dataclass
class RewardFailure:
    index: int            # position in the batch
    error: str            # "ExceptionType: message" (one line)
    prompt: str           # truncated
    response: str         # truncated

    def describe(self) -> str:
        return f"sample {self.index}: {self.error} (prompt {self.prompt!r}, response {self.response!r})"


@dataclass
class ScoreResult:
    scores: list[float]                                  # one per sample; failed samples score 0.0
    failures: list[RewardFailure] = field(default_factory=list)

    @property
    def n_failed(self) -> int:
        return len(self.failures)


def score_batch(fn: RewardFn, prompts: list[str], responses: list[str], answers: list, *,
                max_fail_fraction: float = 0.1, name: str | None = None) -> ScoreResult:
    """Score a batch; a sample the function fails on scores 0, is counted and reported.

    fn is first called on the whole batch. If it raises, returns the wrong number of scores, or
    a score that is not a finite number, it is called again one sample at a time to find the
    samples that fail (each logged with its prompt and response, truncated). When more than
    max_fail_fraction of the batch fails, RewardError (one line, with the first failure).
    """
    n = len(responses)
    if len(prompts) != n or len(answers) != n:
        raise ValueError(f"score_batch: {len(prompts)} prompts, {n} responses and {len(answers)} answers "
                         f"must be as many")
    if not 0.0 <= max_fail_fraction <= 1.0:
        raise ValueError(f"max_fail_fraction must be in [0, 1], got {max_fail_fraction}")
    name = name or getattr(fn, "__name__", type(fn).__name__)
    try:
        scores = _check_scores(fn(list(prompts), list(responses), list(answers)), n)
        return ScoreResult(scores)
    except Exception:                                    # isolate the culprits one by one
        pass
    scores, failures = [], []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers)):
        try:
            scores.extend(_check_scores(fn([p], [r], [a]), 1))
        except Exception as e:
            msg = f"{type(e).__name__}: {e}".replace("\n", " ")
            failures.append(RewardFailure(i, msg[:_SHOW], _cut(p), _cut(r)))
            scores.append(0.0)
    for f in failures[:3]:
        log.warning("reward function '%s' failed on %s", name, f.describe())
    if len(failures) > 3:
        log.warning("reward function '%s' failed on %d more samples of this batch", name, len(failures) - 3)
    if len(failures) > max_fail_fraction * n:
        raise RewardError(f"reward function '{name}' failed on {len(failures)} of {n} samples "
                          f"(more than max_fail_fraction={max_fail_fraction:g}); first: {failures[0].describe()}")
    return ScoreResult(scores, failures)


def _check_scores(scores, n: int) -> list[float]:
    try:
        scores = list(scores)
    except TypeError:
        raise TypeError(f"returned {type(scores).__name__}, expected a list of {n} floats") from None
    if len(scores) != n:
        raise ValueError(f"returned {len(scores)} scores for {n} samples")
    out = []
    for s in scores:
        if not isinstance(s, (int, float)) and not hasattr(s, "__float__"):  # bool counts as 0/1
            raise TypeError(f"returned a score of type {type(s).__name__}, expected a number")
        v = float(s)
        if not math.isfinite(v):
            raise ValueError(f"returned a non-finite score {v}")
        out.append(v)
    return out


def _cut(text) -> str:
    text = str(text)
    return text if len(text) <= _SHOW else text[:_SHOW] + "..."
