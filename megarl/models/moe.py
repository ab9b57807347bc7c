"""Mixture-of-experts models on megatron-core's MoE layer (router, token dispatcher, experts).

megarl adds no MoE maths: `gpt.moe_fields` maps `model.moe` onto TransformerConfig and the
layer spec, `layout.py` gives experts canonical (global) names, and this module holds what
megarl needs around megatron-core's layer.
"""
from __future__ import annotations


def patch_megatron() -> None:
    """megatron-core 0.16's router GEMM reads `te_general_gemm`, which its moe_utils defines only
    when Transformer Engine imports: without TE every router forward raises NameError. Defining it
    as None selects the torch GEMM that follows, as intended. Idempotent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
