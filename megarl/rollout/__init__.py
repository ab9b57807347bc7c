"""Generating responses with a Role's model.

engine.py: the rollout engine (batched KV-cache sampling on the actor's own megatron-core model,
at any TP/PP layout) that RL and evaluation use; sampling.py: its pure sampling maths;
greedy.py: the no-cache greedy reference the tests compare against.
"""
from megarl.rollout.engine import MegatronRolloutEngine, Rollout, RolloutEngine
from megarl.rollout.sampling import SamplingParams

__all__ = ["MegatronRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams"]
