"""The learning rules as pure functions: tensors in, tensors out (see losses.py); each RL
algorithm is defined once in spec.py."""
from .advantages import (broadcast_to_tokens, clip_rewards, gae, gae_advantages, grpo_advantages, reinforce_advantages,
                         reinforce_pp_returns, rloo_advantages, token_rewards, whiten)
from .dapo import groups_with_signal, overlong_penalty
from .kl import KL_KINDS, AdaptiveKLController, FixedKLController, kl_estimate
from .losses import REWARD_POOLING, bradley_terry, masked_nll, sequence_reward
from .mismatch import ROLLOUT_CORRECTIONS, mis_keep, mismatch_metrics, tis_weights
from .preference import PREFERENCE_LOSSES, REFERENCE_FREE, preference_loss
from .policy import AGG_MODES, aggregate, explained_variance, ppo_policy_loss, ppo_token_loss, token_weights, value_loss
from .spec import (ALGORITHMS, FIELD_USERS, AdvantageSettings, AlgorithmSpec, algorithm, compute_advantages,
                   config_errors, needed_roles)

__all__ = [
    "AGG_MODES", "ALGORITHMS", "REWARD_POOLING", "ROLLOUT_CORRECTIONS", "FIELD_USERS", "KL_KINDS", "AdaptiveKLController", "AdvantageSettings",
    "AlgorithmSpec", "FixedKLController", "PREFERENCE_LOSSES", "REFERENCE_FREE", "aggregate", "algorithm", "bradley_terry", "broadcast_to_tokens",
    "clip_rewards", "compute_advantages", "config_errors", "explained_variance", "gae", "gae_advantages", "groups_with_signal",
    "grpo_advantages", "kl_estimate", "masked_nll", "mis_keep", "mismatch_metrics", "needed_roles", "overlong_penalty", "ppo_policy_loss",
    "ppo_token_loss", "preference_loss", "reinforce_advantages", "reinforce_pp_returns", "rloo_advantages", "sequence_reward",
    "tis_weights", "token_rewards", "token_weights", "value_loss", "whiten",
]
