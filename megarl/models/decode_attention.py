"""Attention of one new token per row over the KV cache (a decode step), on a CPU.

torch's SDPA on a CPU runs each (row, head) block of a decode step as separate small GEMM
calls and reads the cache at 6-10 GB/s (docs/benchmarks.md); csrc/cpu_decode_attention.cpp
(`megarl._cpu`, built by setup.py when a C++ compiler is there) reads each cached key and
value once per KV head, for every query head that shares it. `decode_attention` runs it on
CPU fp32/bf16 tensors outside autograd and returns None everywhere else (GPUs, a missing build,
MEGARL_DISABLE_KERNELS=1), where attention.py runs SDPA. Same maths as SDPA up to fp32
summation order and exp rounding.

The kernel's reads are bound by memory (11-12 GB/s on one core of the benchmarks' CPUs). The
n samples of a prompt hold copies of its keys and values; with `prefix_rows` each row reads those
positions from its group's first row instead, which the rows before it in the same step have just
brought into the L2 cache: the same values, so the same bits (docs/benchmarks.md: 5% of the
default workload's generate phase, 2-3% of the realistic one's at 8 x 8 rows, nothing
measurable at 2 x 8).
"""
from __future__ import annotations

import torch
from torch import Tensor

from megarl.models import cpu_kernels

def cpu_kernel():
    """megarl._cpu.decode_attention, or None (models/cpu_kernels.py loads it once and logs why not)."""
    module = cpu_kernels.load()
    return None if module is None else module.decode_attention


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *,
                     scale: float, prefix_rows: Tensor | None = None, prefix_len: int = 0) -> Tensor | None:
    """query [b, n, 1, d]; key, value [b, g, sk, d] (views of the cache: unit stride over d);
    mask: None or bool broadcastable to [b, 1, 1, sk], True = masked (megatron's convention).
    -> [b, n, 1, d]. Heads share KV heads as SDPA's enable_gqa does (head h reads h // (n // g)).
    prefix_rows: None or long [b]: row i reads its positions < prefix_len from row prefix_rows[i],
    which holds the same keys and values there (the samples of one prompt: the rows of a group
    read the prompt from one row's memory, found in the CPU's cache; the result is the same bits).
    None when the kernel cannot take these inputs: the caller runs SDPA."""
    op = cpu_kernel() if query.device.type == "cpu" else None
    # what the kernel takes; anything else (its own checks never fire from here) is left to SDPA
    b, n, sq, d = query.shape
    usable = (op is not None and query.dtype in (torch.float32, torch.bfloat16) and key.dtype == query.dtype
              and value.dtype == query.dtype and key.device == query.device and value.device == query.device
              and sq == 1 and key.dim() == 4 and key.shape == value.shape and key.shape[0] == b
              and key.shape[3] == d and 0 < key.shape[1] and n % key.shape[1] == 0
              and query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
              and key.stride(2) == value.stride(2)
              and mask_fits(mask, b, key.shape[2])
              and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                                    or value.requires_grad)))
    if not usable:
        return None
    masked, prefix_rows, prefix_len = kernel_mask_and_prefix(mask, b, key.shape[2], prefix_rows, prefix_len)
    if prefix_rows is None:
        return op(query[:, :, 0], key, value, masked, scale).unsqueeze(2)
    return op(query[:, :, 0], key, value, masked, scale, prefix_rows, prefix_len).unsqueeze(2)


def mask_fits(mask: Tensor | None, b: int, sk: int) -> bool:
    """Whether the kernel takes this mask: None, or bool broadcastable to [b, 1, 1, sk] (one mask
    per row, megatron's convention: True = masked)."""
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, b)
                            and mask.shape[1:3] == (1, 1) and mask.shape[3] in (1, sk))


def kernel_mask_and_prefix(mask: Tensor | None, b: int, sk: int, prefix_rows: Tensor | None, prefix_len: int):
    """A fitting mask and the shared-prompt reads as the kernel takes them (here and in
    megarl._cpu.decode_layer): (masked [b, sk] bool view or None, prefix_rows int64 CPU [b] or None,
    prefix_len). The prefix reads are dropped (None, 0) where they do not apply to these rows."""
    masked = None if mask is None else mask.expand(b, 1, 1, sk)[:, 0, 0, :]  # [b, sk], a view
    if prefix_rows is None or not 0 < prefix_len <= sk or prefix_rows.shape != (b,):
        return masked, None, 0
    return masked, prefix_rows.to("cpu", torch.long).contiguous(), prefix_len
