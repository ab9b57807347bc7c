"""Transparent huge pages for a large CPU tensor that decode steps stream whole (Linux).

At a few rows a decode step is bound by reading memory: megarl._cpu.wide_linear reads the LM
head's whole weight (155 MB at 152k x 256 fp32) every step. Over 4 KiB pages that stream keeps
missing the TLB; over 2 MiB pages the kernel took 0.75-0.95x of its time at 2-16 rows on an
Intel Xeon, 0.6-0.85x at 2-32 rows on an AMD EPYC (docs/benchmarks.md). The weight was allocated
and written long before (it is a parameter), so asking for huge pages at allocation is too late:
`collapse(t)` madvises t's memory
MADV_HUGEPAGE and then MADV_COLLAPSE (Linux >= 6.1), which moves the pages already written to
huge pages now, values untouched. Once per tensor's memory: a second call finds them huge and
returns at once (measured: 0.33 s the first time for 146 MB, 0.1 ms after). megarl's CPU
launchers also set glibc.malloc.hugetlb=1 (launchers/lib.sh), which gives large allocations huge
pages from the start; this covers any process (the Python API, or that setting off).

Only the whole 2 MiB pages inside the tensor are advised (its edges may share pages with other
allocations). Best effort: False where nothing was done (not Linux, an older kernel, THP set to
"never", a tensor without a whole huge page, not contiguous, or on a GPU), never an error.
"""
from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 1 << 21  # 2 MiB: x86-64's transparent huge page
MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25


@functools.cache
def _madvise():
    """libc's madvise(addr, length, advice) -> int, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _aligned_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(start, length) of the whole 2 MiB pages inside contiguous t's memory, or None (none, not
    contiguous, not on the CPU). t's own bytes, not its storage's: a parameter may be a view into
    a buffer of all the model's parameters."""
    if t.device.type != "cpu" or not t.is_contiguous():
        return None
    begin, n = t.data_ptr(), t.numel() * t.element_size()
    lo = -(-begin // HUGE_PAGE) * HUGE_PAGE
    hi = (begin + n) // HUGE_PAGE * HUGE_PAGE
    return (lo, hi - lo) if begin and hi > lo else None


def collapse(t: torch.Tensor) -> bool:
    """Back t's memory with huge pages now, values kept; True when the kernel did (module docstring)."""
    fn, span = _madvise(), _aligned_span(t)
    if fn is None or span is None:
        return False
    return fn(span[0], span[1], MADV_HUGEPAGE) == 0 and fn(span[0], span[1], MADV_COLLAPSE) == 0
