"""Attention of one new token per row over the KV cache (a decode step), on a CPU.

torch's SDPA on a CPU runs each (row, head) block of a decode step as separate small GEMM
calls and reads the cache at 6-10 GB/s (docs/benchmarks.md); csrc/cpu_decode_attention.cpp
(`megarl._cpu`, built by setup.py when a C++ compiler is there) reads each cached key and
value once per KV head, for every query head that shares it. `decode_attention` uses it for
CPU fp32/bf16 tensors outside autograd, and SDPA everywhere else (GPUs, a missing build,
MEGARL_DISABLE_KERNELS=1). Same maths as SDPA up to fp32 summation order and exp rounding.
"""
from __future__ import annotations

import importlib
import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger("megarl.models")

_UNLOADED = object()
_op = _UNLOADED  # torch.ops.megarl_cpu.decode_attention, or None when it cannot be used here


def cpu_kernel():
    """The compiled op, or None (the reason logged once at INFO)."""
    global _op
    if _op is _UNLOADED:
        reason = ""
        if os.environ.get("MEGARL_DISABLE_KERNELS", "") not in ("", "0"):
            reason = "MEGARL_DISABLE_KERNELS is set"
        else:
            try:
                importlib.import_module("megarl._cpu")  # registers torch.ops.megarl_cpu
            except ImportError as exc:
                reason = f"megarl._cpu is not built: {exc}"
        _op = None if reason else torch.ops.megarl_cpu.decode_attention
        if reason:
            logger.info("megarl: CPU decode attention kernel unavailable (%s); using SDPA", reason)
    return _op


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *, scale: float) -> Tensor:
    """query [b, n, 1, d]; key, value [b, g, sk, d] (views of the cache: unit stride over d);
    mask: None or bool broadcastable to [b, 1, 1, sk], True = masked (megatron's convention).
    -> [b, n, 1, d]. Heads share KV heads as SDPA's enable_gqa does (head h reads h // (n // g))."""
    op = cpu_kernel() if query.device.type == "cpu" else None
    usable = (op is not None and (mask is None or mask.dtype == torch.bool) and query.dtype in (torch.float32, torch.bfloat16) and key.dtype == query.dtype
              and value.dtype == query.dtype and query.shape[2] == 1 and query.stride(-1) == 1
              and key.stride(-1) == 1 and value.stride(-1) == 1 and key.stride(2) == value.stride(2)
              and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)))
    if not usable:
        gqa = query.shape[1] != key.shape[1]
        attn_mask = None if mask is None else ~mask
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    b, sk = query.shape[0], key.shape[2]
    masked = None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]  # [b, sk], a view
    return op(query[:, :, 0], key, value, masked, scale).unsqueeze(2)
