"""Make megatron-core run on a machine without CUDA (gloo, CPU tensors).

megatron-core assumes CUDA in a handful of places. `enable()` bridges exactly those, and
does nothing at all when CUDA is available, so GPU runs use megatron-core untouched:

1. `torch.cuda.current_device()` (e.g. GlobalMemoryBuffer) yields the CPU device.
2. Tensor factories called with `device="cuda"`, `torch.device("cuda")` or an integer device
   (e.g. the pipeline schedules' `torch.zeros(..., device="cuda")`) are sent to CPU by a
   TorchFunctionMode, which sees every call however it is spelled.
3. `Tensor.cuda()` returns the tensor; `torch.cuda.synchronize()` is a no-op.
4. The tensor-parallel RNG tracker forks the CPU generator instead of CUDA RNG states, so
   dropout inside TP regions is still seeded per TP rank, as on GPU.
5. `Tensor.type()` names CPU tensors as their CUDA twins ('torch.cuda.FloatTensor'): the
   optimizer and gradient clipping classify parameters by that string; `.type('torch.cuda.X')`
   converts on CPU.
6. Pinned host memory: `Tensor.pin_memory()` returns a host copy (what it returns for an
   unpinned tensor on a GPU machine, minus the page locking, which needs an accelerator), and
   `pin_memory=True` in a factory is dropped. E.g. the distributed optimizer's buffers offload
   with `param_data.cpu().pin_memory()` as the kept copy before freeing `param_data`.
7. CUDA streams and events: the MoE all-to-all token dispatcher copies its split sizes to the
   host on a side stream and waits on an event; on CPU they are one stream and a no-op wait.
   Its split sizes become numpy arrays only when they were on the GPU; on CPU they would stay
   tensors, which gloo's all_to_all_single rejects, so they are converted as on a GPU.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_mode: TorchFunctionMode | None = None  # the process-wide mode once enabled


def _is_cuda_device(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):  # an integer device is a CUDA ordinal
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites any CUDA device argument of a torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type:
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
            out = func(*args, **kwargs)
            if isinstance(out, str) and out.startswith("torch.") and not out.startswith("torch.cuda."):
                out = "torch.cuda." + out[len("torch."):]
            return out
        if func is torch.Tensor.to and len(args) > 1 and isinstance(args[1], (str, torch.device)) and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class CPURNGStatesTracker:
    """Named CPU generator states, forked like megatron's CudaRNGStatesTracker."""

    def __new__(cls):
        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

        class _Tracker(CudaRNGStatesTracker):
            def add(self, name, seed):
                self._is_initialized = True
                if seed in self.seeds_:
                    raise Exception(f"seed {seed} already exists")
                if name in self.states_:
                    raise Exception(f"rng state {name} already exists")
                self.seeds_.add(seed)
                saved = torch.get_rng_state()
                torch.manual_seed(seed)
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

            @contextlib.contextmanager
            def fork(self, name="model-parallel-rng"):
                if name not in self.states_:
                    raise Exception(f"rng state {name} is not added")
                saved = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(saved)

        return _Tracker()


class _HostStream:
    """torch.cuda.Stream's API on the host: everything runs in order, so waits are no-ops."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _HostEvent()

    def synchronize(self):
        pass


class _HostEvent:
    def synchronize(self):
        pass

    def query(self):
        return True


_HOST_STREAM = _HostStream()


def _host_tensor(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's `maybe_move_tensor_to_cpu` for tensors already on the host: the numpy
    array it returns for a GPU tensor (a copy: a live tensor's storage stays resizable)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.detach().clone().numpy()
    return tensor


# Known, harmless warnings on CPU, once per rank per run otherwise: megatron asks for a CUDA
# setting that has no meaning without CUDA; torch deprecates ShardedTensor, which megatron-core's
# dist_checkpointing still uses on every load (reported from this module, as the torch calls go
# through CudaToCpuMode).
KNOWN_WARNINGS = ((UserWarning, r".*CUDA_DEVICE_MAX_CONNECTIONS.*"),
                  (FutureWarning, r".*deprecating ShardedTensor.*"))


def silence_known_warnings() -> None:
    import warnings

    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def enable() -> bool:
    """Install the bridges if CUDA is absent. Idempotent. Returns whether they are active."""
    global _mode
    if torch.cuda.is_available():
        return False
    silence_known_warnings()
    if _mode is not None:
        return True
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()
    torch.cuda.Stream = _HostStream
    torch.cuda.current_stream = lambda *a, **k: _HOST_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()

    from megatron.core.tensor_parallel import random as mp_random

    mp_random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.maybe_move_tensor_to_cpu = _host_tensor
    _mode = CudaToCpuMode()
    _mode.__enter__()
    return True


def is_enabled() -> bool:
    return _mode is not None


def suspended():
    """The shim switched off for a block that asks for no CUDA device (its TorchFunctionMode wraps
    every torch call); a no-op where the shim is off (a GPU)."""
    return torch._C.DisableTorchFunction() if is_enabled() else contextlib.nullcontext()
