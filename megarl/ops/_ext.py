"""Lazy handle on the compiled CUDA kernels (megarl._C).

The extension is imported on first use, not at `import megarl`, and when it cannot be used the
reason is logged once on the `megarl.ops` logger (a warning on a GPU machine; on CPU, where it is
expected, at debug level); every op then runs its torch path. Setting
MEGARL_DISABLE_KERNELS=1 forces the torch path (for A/B checks on a GPU machine).
"""
import logging

import torch

from megarl.utils.imports import import_kernels

logger = logging.getLogger("megarl.ops")

_UNLOADED = object()
_ext = _UNLOADED  # the only mutable module state: the extension module, or None when unavailable


def _import():
    """(module or None, reason it is unavailable)."""
    if not torch.version.cuda:
        return None, f"torch {torch.__version__} is a CPU build"
    mod, reason = import_kernels("megarl._C")
    if mod is not None and not torch.cuda.is_available():
        return None, "no CUDA device is visible"
    return mod, reason


def load():
    """The megarl._C module, or None (logged once) when the kernels cannot run here."""
    global _ext
    if _ext is _UNLOADED:
        _ext, reason = _import()
        if _ext is None:
            # Only a GPU machine without kernels deserves a line; on CPU it is expected, and
            # `megarl doctor` reports the kernels' state.
            level = logging.WARNING if torch.cuda.is_available() else logging.DEBUG
            logger.log(level, "megarl: CUDA kernels unavailable (%s); using the torch path", reason)
    return _ext


def use_kernels(t: torch.Tensor) -> bool:
    """True when `t` lives on a GPU and the kernels are loaded (logs the fallback once)."""
    ext = load()
    return ext is not None and t.is_cuda


def kernel_backend() -> str:
    """'cuda' when the compiled kernels serve CUDA tensors, else 'torch'."""
    return "cuda" if load() is not None else "torch"


def stream_of(t: torch.Tensor) -> int:
    """Handle of the current stream on t's device, for the launchers."""
    return torch.cuda.current_stream(t.device).cuda_stream
