"""Periodic system metrics (host memory/CPU via psutil, GPU memory via torch.cuda).

Sampled on a daemon thread so a training step never pays for it; values go through the normal
`Tracker.log_metrics` path under the `system/` prefix, stamped with the latest training step.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import psutil


def sample_system_metrics(process=None) -> dict[str, float]:
    """One sample (psutil is a dependency); GPU keys only when CUDA is in use (torch is never
    imported just for this)."""
    proc = process or psutil.Process()
    out: dict[str, float] = {
        "system/cpu_rss_gib": proc.memory_info().rss / 2**30,
        "system/process_cpu_percent": proc.cpu_percent(interval=None),
        "system/host_cpu_percent": psutil.cpu_percent(interval=None),
        "system/host_memory_percent": psutil.virtual_memory().percent,
    }
    torch = sys.modules.get("torch")  # never import torch just for this
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        dev = torch.cuda.current_device()
        out["system/gpu_mem_allocated_gib"] = torch.cuda.memory_allocated(dev) / 2**30
        out["system/gpu_mem_reserved_gib"] = torch.cuda.memory_reserved(dev) / 2**30
        out["system/gpu_mem_max_allocated_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        try:
            out["system/gpu_utilization_percent"] = float(torch.cuda.utilization(dev))
        except Exception:  # noqa: BLE001 - needs pynvml; optional
            pass
    return out


class SystemSampler:
    """Calls `sink(metrics, step)` every `interval` seconds until stopped."""

    def __init__(self, sink: Callable[[dict, int], None], step: Callable[[], int], interval: float):
        self._sink, self._step, self._interval = sink, step, float(interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-tracking-system", daemon=True)
        self._process = psutil.Process()
        self._process.cpu_percent(interval=None)  # prime: the first call always returns 0.0

    def start(self) -> "SystemSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._sink(sample_system_metrics(self._process), self._step())
            except Exception:  # noqa: BLE001 - monitoring must never take the run down
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
