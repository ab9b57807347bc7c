"""Fused ops: per-token log-probs/entropy over vocab-parallel logits (or straight from the hidden
states and the output weight, chunk by chunk: no logits), and GAE.

These are the only place in megarl where these quantities are computed. CUDA tensors use the
kernels of csrc/ (megarl._C) when they are built; everything else, and any machine without
them, uses a frugal torch path with the same semantics (logged once on `megarl.ops`).
"""
from ._ext import kernel_backend
from .advantages import gae
from .fused_head import head_logprobs, head_token_loss, linear_logprobs_and_entropy, linear_token_loss
from .logprobs import IGNORE_INDEX, logprobs_and_entropy

__all__ = ["IGNORE_INDEX", "logprobs_and_entropy", "linear_logprobs_and_entropy", "head_logprobs",
           "linear_token_loss", "head_token_loss", "gae", "kernel_backend"]
