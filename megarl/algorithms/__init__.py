"""The learning rules as pure functions: tensors in, tensors out (see losses.py)."""
from .advantages import (RunningRewardNorm, broadcast_to_tokens, clip_rewards, gae_advantages,
                         grpo_advantages, normalize_rewards, reinforce_advantages,
                         reinforce_pp_advantages, rloo_advantages, token_rewards, whiten)
from .kl import KL_KINDS, AdaptiveKLController, FixedKLController, kl_estimate
from .losses import bradley_terry, masked_mse, masked_nll
from .policy import AGG_MODES, aggregate, explained_variance, ppo_policy_loss, value_loss

__all__ = [
    "AGG_MODES", "KL_KINDS", "AdaptiveKLController", "FixedKLController", "RunningRewardNorm",
    "aggregate", "bradley_terry", "broadcast_to_tokens", "clip_rewards", "explained_variance",
    "gae_advantages", "grpo_advantages", "kl_estimate", "masked_mse", "masked_nll",
    "normalize_rewards", "ppo_policy_loss", "reinforce_advantages", "reinforce_pp_advantages",
    "rloo_advantages", "token_rewards", "value_loss", "whiten",
]
