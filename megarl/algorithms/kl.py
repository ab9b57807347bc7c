"""KL to the reference policy: per-token estimators and the coefficient controllers.

The estimators (Schulman, "Approximating KL divergence", 2020) estimate KL(pi || ref) from
tokens sampled from pi, with log r = ref_logp - logp:
  k1 = -log r = logp - ref_logp               unbiased, high variance, can be negative
  k2 = 0.5 (log r)^2                          biased, low variance, >= 0
  k3 = r - 1 - log r                          unbiased, low variance, >= 0
The KL is used either as a per-token reward penalty (PPO: coef from a controller below) or as a
loss term (GRPO: see policy.ppo_policy_loss(ref_logp=..., kl_coef=...)).
"""
from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3")

# k3 exponentiates the log-ratio: clamped to +-K3_LOG_RATIO_CLAMP (exp(20) ~ 5e8, finite in fp32)
# so that one token far from the reference cannot overflow to inf. Beyond the clamp the estimate
# (and its gradient) saturates.
K3_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL(pi || ref) estimate; logp, ref_logp: [B, T] -> [B, T] (differentiable in both).

    k3 clamps the log-ratio to +-K3_LOG_RATIO_CLAMP before exponentiating (see above).
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp and ref_logp must have the same shape; got {tuple(logp.shape)} "
                         f"and {tuple(ref_logp.shape)}")
    log_ratio = ref_logp - logp                       # log(ref / pi)
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        log_ratio = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}: expected one of {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient (same interface as AdaptiveKLController)."""

    def __init__(self, coef: float):
        if coef < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {coef}")
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict:
        return {"kind": "fixed", "value": self.value}

    def load_state_dict(self, state: dict) -> None:
        _check_kind(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-tuning LMs from human preferences").

    After each step with measured KL, e_t = clip(KL / target - 1, -0.2, 0.2) and
    coef <- coef * (1 + e_t * n_steps / horizon): the coefficient grows when the policy drifts
    beyond `target` nats and shrinks when it stays closer, at a rate set by `horizon` (samples).
    """

    def __init__(self, init_coef: float, target: float, horizon: float):
        if init_coef <= 0:
            raise ValueError(f"adaptive KL: init_coef must be > 0, got {init_coef}")
        if target <= 0:
            raise ValueError(f"adaptive KL: target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"adaptive KL: horizon must be > 0, got {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """current_kl: the batch's mean KL (a float); n_steps: samples in the batch. Returns the new coef."""
        current_kl = float(current_kl)
        if current_kl != current_kl:  # NaN: keep the coefficient rather than poison it
            return self.value
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"kind": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """Restores the coefficient; target and horizon come from the config (they may be changed on resume)."""
        _check_kind(state, "adaptive")
        self.value = float(state["value"])


def _check_kind(state: dict, kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind or "value" not in state:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"KL controller state is for {got!r}, expected {kind!r} (was kl.adaptive changed?)")
