"""Generating responses with a Role's model.

engine.py: the rollout engine (batched KV-cache sampling on the actor's own megatron-core model,
at any TP/PP layout) that RL and evaluation use; sampling.py: its pure sampling maths;
tools.py: tools the policy calls inside a response (calculator, opt-in python, user functions)
and the inline call protocol. (tests/greedy_reference.py is the no-cache greedy reference its
tests compare against.)
"""
from megarl.rollout.engine import MegatronRolloutEngine, Rollout, RolloutEngine
from megarl.rollout.sampling import SamplingParams
from megarl.rollout.tools import Tool, Toolbox, ToolResult, build_tools, make_toolbox

__all__ = ["MegatronRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams", "Tool", "ToolResult", "Toolbox",
           "build_tools", "make_toolbox"]
