"""Each RL algorithm defined once: the roles it needs, how its advantages are computed, its
defaults and the `rl.*` fields only it reads.

The RL stage, the role list, config validation and the docs all read `ALGORITHMS`; adding an
algorithm is one row here (its estimator a pure function in advantages.py) and one test.

Two families:
  sequence-level (GRPO, RLOO, REINFORCE): one reward per sample, KL penalty summed over the
      sample's tokens, a baseline from the other samples of its prompt, the advantage copied
      onto every response token;
  token-level (PPO, REINFORCE++): the score on the last response token minus the per-token KL
      penalty, then a return per token (GAE with the critic's values, or the discounted
      return-to-go).
Whitening over the global batch follows the row's default unless `rl.whiten_advantages` says
otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .advantages import (broadcast_to_tokens, gae_advantages, grpo_advantages, reinforce_advantages,
                         reinforce_pp_returns, rloo_advantages, token_rewards, whiten)


@dataclass(frozen=True)
class AdvantageSettings:
    """The `rl.*` values an estimator may read."""

    group_size: int          # rl.samples_per_prompt: samples of one prompt are consecutive rows
    gamma: float = 1.0
    lam: float = 0.95
    scale_by_std: bool = True


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    summary: str             # one line, for the docs and --help
    critic: bool             # needs a value model (the critic role)
    group: bool              # compares samples of one prompt: needs rl.samples_per_prompt >= 2
    token_level: bool        # per-token rewards and returns (else one reward per sequence)
    whiten: bool             # the default of rl.whiten_advantages
    fields: tuple            # rl.* fields that only this algorithm (and its family) reads
    # (rewards, mask, values, settings) -> (advantages, returns or None); rewards [N] for a
    # sequence-level algorithm, [N, T] per-token for a token-level one
    estimator: Callable


def _gae(rewards, mask, values, s: AdvantageSettings):
    return gae_advantages(rewards, values, mask, s.gamma, s.lam)


ALGORITHMS: dict[str, AlgorithmSpec] = {spec.name: spec for spec in (
    AlgorithmSpec("grpo", "group-normalised rewards (Shao et al. 2024); scale_by_std=false is Dr. GRPO",
                  critic=False, group=True, token_level=False, whiten=False, fields=("scale_by_std",),
                  estimator=lambda r, m, v, s: (grpo_advantages(r, s.group_size, scale_by_std=s.scale_by_std), None)),
    AlgorithmSpec("rloo", "leave-one-out baseline (Ahmadian et al. 2024)",
                  critic=False, group=True, token_level=False, whiten=False, fields=(),
                  estimator=lambda r, m, v, s: (rloo_advantages(r, s.group_size), None)),
    AlgorithmSpec("reinforce", "REINFORCE with the group mean as baseline (nanochat)",
                  critic=False, group=True, token_level=False, whiten=False, fields=(),
                  estimator=lambda r, m, v, s: (reinforce_advantages(r, s.group_size), None)),
    AlgorithmSpec("ppo", "PPO with a critic and GAE (Schulman et al. 2017, 2016)",
                  critic=True, group=False, token_level=True, whiten=True, fields=("gamma", "lam", "value_clip"),
                  estimator=_gae),
    AlgorithmSpec("reinforce_pp", "REINFORCE++: discounted return-to-go, whitened over the batch (Hu 2025)",
                  critic=False, group=False, token_level=True, whiten=True, fields=("gamma",),
                  estimator=lambda r, m, v, s: (reinforce_pp_returns(r, m, s.gamma), None)),
)}

# rl.* fields that some algorithms do not read: which algorithms read each
FIELD_USERS = {f: tuple(n for n, spec in ALGORITHMS.items() if f in spec.fields)
               for spec in ALGORITHMS.values() for f in spec.fields}


def needed_roles(rl) -> list[str]:
    """The roles an RL run has, from its `rl` section: which exist follows the algorithm (a
    critic), the KL (a reference) and the reward (a reward model)."""
    roles = ["actor"]
    if rl.kl_coef > 0 or rl.kl_target is not None:
        roles.append("reference")
    if algorithm(rl.algorithm).critic:
        roles.append("critic")
    if rl.reward_model_coef > 0:
        roles.append("reward")
    return roles


def config_errors(rl, defaults) -> list[str]:
    """The algorithm's own rules for an `rl` config section, one line each: a known name, groups
    of >= 2 samples where it compares them, no setting that only another algorithm reads (set
    away from its default, it would silently do nothing), dynamic sampling only where groups
    carry the signal. defaults: an `rl` section with every default, to tell what was set."""
    if rl.algorithm not in ALGORITHMS:
        return [f"rl.algorithm: {rl.algorithm!r} is not one of {', '.join(ALGORITHMS)}"]
    spec, errs = ALGORITHMS[rl.algorithm], []
    if spec.group and rl.samples_per_prompt < 2:
        errs.append(f"rl.algorithm={spec.name} compares samples of one prompt: rl.samples_per_prompt must be >= 2")
    for name, users in FIELD_USERS.items():
        if spec.name not in users and getattr(rl, name) != getattr(defaults, name):
            errs.append(f"rl.{name}={getattr(rl, name)} has no effect with rl.algorithm={spec.name} "
                        f"(read only by {', '.join(users)}); remove it")
    if rl.dynamic_sampling and not spec.group:
        errs.append(f"rl.dynamic_sampling keeps prompt groups whose rewards differ; rl.algorithm={spec.name} has "
                    f"no groups (use one of {', '.join(n for n, s in ALGORITHMS.items() if s.group)})")
    return errs


def algorithm(name: str) -> AlgorithmSpec:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown RL algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def compute_advantages(spec: AlgorithmSpec, scores: torch.Tensor, mask: torch.Tensor, settings: AdvantageSettings,
                       *, kl_penalty: torch.Tensor | None = None, values: torch.Tensor | None = None,
                       whiten_advantages: bool | None = None, group=None):
    """(advantages [N, T] fp32, 0 off the mask; returns [N, T] or None) for one step's rows.

    scores: [N] sequence rewards; mask: [N, T] True on the tokens the policy sampled;
    kl_penalty: [N, T] coef x KL per token (a reward penalty) or None; values: [N, T] the
    critic's (token-level algorithms with a critic). whiten_advantages: None takes the
    algorithm's default. group: the data-parallel group, so that batch statistics are the
    global batch's at any layout.
    """
    if spec.critic and values is None:
        raise ValueError(f"{spec.name} needs the critic's values")
    if spec.token_level:
        rewards = token_rewards(scores, mask, kl_penalty)
    else:
        rewards = scores if kl_penalty is None else scores - (kl_penalty * mask).sum(1)
    adv, returns = spec.estimator(rewards, mask, values, settings)
    if not spec.token_level:
        adv = broadcast_to_tokens(adv, mask)
    do_whiten = spec.whiten if whiten_advantages is None else whiten_advantages
    adv = whiten(adv, mask, group=group) if do_whiten else adv * mask
    return adv.float(), returns
