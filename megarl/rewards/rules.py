"""Built-in rule rewards, all with the batch signature of a megarl reward function:

    fn(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]

prompts are the prompt texts as the policy saw them (chat template applied), responses the
decoded responses (special tokens stripped), answers the prompts file's `answer` field (None
when the record had none). One float per sample, same order. A function may raise on a bad
sample: score_batch() isolates it, reports it and scores it 0.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from megarl.data.answers import canonical_number, extract_answer

RewardFn = Callable[[list, list, list], list]


def _need_answer(answer, name: str) -> str:
    if answer is None:
        raise ValueError(f"reward '{name}' needs a reference answer, but this prompt has none "
                         f"(give the prompts file an 'answer' field)")
    return str(answer)


def _gold(answer, name: str) -> str:
    """A reference answer as a canonical number: a bare number, or a solution ending in `#### n`."""
    answer = _need_answer(answer, name)
    gold = extract_answer(answer) if "####" in answer else canonical_number(answer.strip())
    if gold is None:
        raise ValueError(f"reward '{name}' compares numbers, but the reference answer {answer[:50]!r} is not one")
    return gold


def final_answer(prompts: list, responses: list, answers: list) -> list[float]:
    """1.0 when the response's final `#### n` equals the answer numerically (strict: no `####`, no reward).

    Commas, `$`, a trailing `.0` and a minus sign are understood (megarl.data.answers).
    """
    out = []
    for response, answer in zip(responses, answers, strict=True):
        out.append(float(extract_answer(response) == _gold(answer, "final_answer")))
    return out


def gsm8k(prompts: list, responses: list, answers: list) -> list[float]:
    """GSM8K correctness: the final `#### n`, or else the last number in the response, equals the answer."""
    out = []
    for response, answer in zip(responses, answers, strict=True):
        out.append(float(extract_answer(response, fallback_last_number=True) == _gold(answer, "gsm8k")))
    return out


def exact_match(prompts: list, responses: list, answers: list) -> list[float]:
    """1.0 when the response equals the answer after stripping surrounding whitespace."""
    return [float(r.strip() == _need_answer(a, "exact_match").strip())
            for r, a in zip(responses, answers, strict=True)]


def format_reward(prompts: list, responses: list, answers: list) -> list[float]:
    """1.0 when the response ends its reasoning with a parseable `#### n` (answer not needed)."""
    return [float(extract_answer(r) is not None) for r in responses]


def weighted_sum(terms: Sequence[tuple[RewardFn, float]]) -> RewardFn:
    """A reward function returning sum_i w_i fn_i(...), e.g. weighted_sum([(gsm8k, 1.0), (format_reward, 0.1)])."""
    terms = list(terms)
    if not terms:
        raise ValueError("weighted_sum needs at least one (function, weight) pair")
    for i, term in enumerate(terms):
        if not (isinstance(term, tuple) and len(term) == 2 and callable(term[0])
                and isinstance(term[1], (int, float)) and not isinstance(term[1], bool)):
            raise ValueError(f"weighted_sum term {i} must be (function, weight), got {term!r}")

    def combined(prompts: list, responses: list, answers: list) -> list[float]:
        total = [0.0] * len(responses)
        for fn, weight in terms:
            scores = fn(prompts, responses, answers)
            if len(scores) != len(responses):
                raise ValueError(f"reward '{_name(fn)}' returned {len(scores)} scores for "
                                 f"{len(responses)} responses")
            total = [t + weight * float(s) for t, s in zip(total, scores)]
        return total

    combined.__name__ = "weighted_sum(" + ", ".join(f"{_name(f)}*{w:g}" for f, w in terms) + ")"
    return combined


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


BUILTINS: dict[str, RewardFn] = {
    "final_answer": final_answer,
    "gsm8k": gsm8k,
    "exact_match": exact_match,
    "format": format_reward,
}
