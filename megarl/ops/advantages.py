"""GAE on the GPU: the chunked-scan CUDA kernel of csrc/gae.cu.

The maths, and the torch path every other device runs, is `megarl.algorithms.gae`; this is the
same recurrence as one kernel launch for CUDA tensors (tests/test_ops_gae.py holds both to a
float64 loop, and tests/test_csrc.py the kernel's arithmetic on the host).
"""
import torch

from . import _ext


def gae(rewards, values, mask, gamma, lam):
    """(advantages, returns) [B, T] of `megarl.algorithms.gae`, by the CUDA kernel. rewards,
    values: [B, T] CUDA tensors; mask: [B, T] bool or 0/1. Raises where the kernel cannot run."""
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    dt = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    r, v = rewards.to(dt).contiguous(), values.to(dt).contiguous()
    if not _ext.use_kernels(r):
        raise RuntimeError("megarl.ops.gae runs the CUDA kernel (CUDA tensors, megarl._C built); "
                           "megarl.algorithms.gae is the torch path")
    m = mask.to(device=r.device, dtype=torch.bool).contiguous()
    with torch.no_grad(), torch.cuda.device(r.device):
        return _ext.load().gae(r, v, m, None, float(gamma), float(lam), _ext.stream_of(r))
