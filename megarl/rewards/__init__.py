"""Rule rewards, reward-function loading, error-isolated batch scoring, and pass@k.

A reward function has the batch signature
    fn(prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]
(see rules.py). Load one with load_reward_fn("gsm8k" | "module:function" | [[spec, w], ...]) and
score with score_batch(fn, prompts, responses, answers, max_fail_fraction=...). The reward
model's scalar is not here: it needs the model, so the RL trainer computes it.
"""
from .passk import mean_at_k, mean_pass_at_k, pass_at_k
from .rules import BUILTINS, RewardFn, exact_match, final_answer, format_reward, gsm8k, weighted_sum
from .scoring import RewardError, RewardFailure, ScoreResult, load_reward_fn, score_batch

__all__ = [
    "BUILTINS", "RewardError", "RewardFailure", "RewardFn", "ScoreResult", "exact_match", "final_answer",
    "format_reward", "gsm8k", "load_reward_fn", "mean_at_k", "mean_pass_at_k", "pass_at_k", "score_batch",
    "weighted_sum",
]
