"""Lazy handle on megarl._cpu, the optional CPU kernels (csrc/cpu_*.cpp, built by setup.py
wherever a C++ compiler is): decode attention over the KV cache (models/decode_attention.py) and
the LM head's GEMM at decode sizes (models/cpu_gemm.py), a whole layer at a decode step
(models/decode_step.py), the decode step's draw
(rollout/sampling.py) and the log-prob/entropy row passes over fp32 logits (ops/logprobs.py).
Imported on first use; when it cannot be used (no build, MEGARL_DISABLE_KERNELS=1) the reason is
logged once and the callers run torch.
"""
from __future__ import annotations

import logging

from megarl.utils.imports import import_kernels

logger = logging.getLogger("megarl.models")

_UNLOADED = object()
_module = _UNLOADED  # megarl._cpu, or None when it cannot be used here
# What this checkout's csrc/cpu_*.cpp bind: a build without one of them is older than the Python
# code calling it (decode_attention's prefix_rows came with sample_rows), and is not used.
_BINDS = ("decode_attention", "wide_linear", "wide_linear_supported", "decode_layer", "sample_rows",
          "logprob_stats", "logprob_grad")


def load():
    """The megarl._cpu module, or None (the reason logged once at INFO)."""
    global _module
    if _module is _UNLOADED:
        _module, reason = import_kernels("megarl._cpu")
        missing = [name for name in _BINDS if _module is not None and not hasattr(_module, name)]
        if missing:
            _module, reason = None, (f"the built megarl._cpu lacks {', '.join(missing)}: older than this checkout "
                                     "(rebuild: pip install --no-build-isolation -e .)")
        if _module is None:
            logger.info("megarl: CPU kernels unavailable (%s); using torch's SDPA, GEMMs, sampling and log-prob ops",
                        reason)
    return _module


def wide_linear():
    """megarl._cpu.wide_linear where this CPU runs it (AVX-512, or AVX2 + FMA), else None."""
    module = load()
    return module.wide_linear if module is not None and module.wide_linear_supported() else None
