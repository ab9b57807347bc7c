"""train.fp8 -> megatron-core and Transformer Engine: the one place FP8 settings are translated.

megatron-core (0.16) runs FP8 from `TransformerConfig` alone: each transformer layer enters TE's
`fp8_autocast` with the recipe `fp8_utils.get_fp8_recipe` builds from the config's fields, except
the BF16 first/last layers; `fp8_param` makes TE create the GEMM weights as FP8 tensors, and
DDP's `fp8_param_gather` all-gathers them as FP8. The rules these fields must satisfy (device,
TE version, dimensions) are megarl.config.fp8's.

Generation runs BF16 GEMMs by default (`rollout: bf16`): `generation_precision` switches FP8 off
for a forward with an inference context (the rollout's KV-cache steps); scoring and training
keep it, so the old log-probs are recomputed in the precision the policy is trained in.
"""
from __future__ import annotations

import contextlib
from typing import Optional

from megarl.config.fp8 import fp8_rows
from megarl.config.schema import FP8Config

def enabled(f: Optional[FP8Config]) -> bool:
    return f is not None and f.format is not None


def transformer_config_fields(f: Optional[FP8Config]) -> dict:
    """megatron-core TransformerConfig keyword arguments for train.fp8 (none when FP8 is off, so
    megatron-core's own defaults hold)."""
    if not enabled(f):
        return {}
    bf16_layers = f.bf16_first_layers > 0 or f.bf16_last_layers > 0
    return {
        "fp8": f.format,
        "fp8_recipe": f.recipe,
        "fp8_margin": f.margin,
        "fp8_amax_history_len": f.amax_history_len,
        "fp8_amax_compute_algo": f.amax_compute_algo,
        "fp8_param": f.param_gather,
        "fp8_wgrad": True,  # weight gradients in FP8 too (megatron-core's default, stated)
        "first_last_layers_bf16": bf16_layers,
        "num_layers_at_start_in_bf16": f.bf16_first_layers if bf16_layers else 1,
        "num_layers_at_end_in_bf16": f.bf16_last_layers if bf16_layers else 1,
    }


@contextlib.contextmanager
def fp8_off(config):
    """FP8 switched off on a megatron-core TransformerConfig for the duration (the layers read
    `config.fp8` at every forward to decide whether to enter TE's fp8_autocast)."""
    saved = config.fp8
    config.fp8 = None
    try:
        yield
    finally:
        config.fp8 = saved


def generation_precision(config, rollout: str, generating: bool, tokens: int = 0):
    """The context a forward runs in: BF16 GEMMs for generation unless train.fp8.rollout=fp8, and
    then also for a step whose token count (rows x new tokens: the rollout drops finished rows)
    TE's FP8 GEMMs cannot take (not a multiple of 8, mxfp8: 32)."""
    if not (generating and config.fp8 is not None):
        return contextlib.nullcontext()
    if rollout == "bf16" or tokens % fp8_rows(config.fp8_recipe):
        return fp8_off(config)
    return contextlib.nullcontext()
