"""A guard that fails on anything in a block that a CUDA graph could not capture, for the
graph-safe decode step's contract.

On a GPU each of these waits for the device (a host synchronisation) or copies host memory to it,
and cannot be captured in a CUDA graph; on a CPU they are silent, so the contract test runs the
step under this guard. Two layers, because a CPU run hides different things from each:
- Python calls (TorchFunctionMode): `.item()`, `.tolist()`, `.numpy()`, `bool(t)` / `int(t)` /
  `float(t)`, a copy to the host (`.cpu()`, `.to("cpu")`), data-dependent shapes (`nonzero`,
  `masked_select`, `unique`, reading or writing through a boolean index, `repeat_interleave`
  by a tensor), `isin` (on CUDA, beyond a few test ids it sorts through `unique`, whose size
  the host reads), and a tensor made without a device (a factory call such as
  `torch.arange(n)`): on a GPU it lands in host memory, and using it copies it to the device.
- aten ops (TorchDispatchMode), which also sees what composite functions and megatron-core call
  underneath: `_local_scalar_dense` (every scalar read), `nonzero`, `masked_select`, the
  `unique` family, `equal`, `is_nonzero`, `bincount`, `histc`, `repeat_interleave`, indexing
  and index_put with a boolean mask, and `lift_fresh` (a tensor made from Python data: host
  memory, copied to the device).
And the torch.cuda calls that wait for the device or move RNG state (`synchronize`,
`set_rng_state`, ...), which no torch mode sees.
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu}
_DATA_SHAPES = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
                torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere}
# factories whose result is on the default (host) device unless `device=` is given
_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}
_ATEN_SYNCS = {"_local_scalar_dense": "a scalar read (item, bool, int, float)", "nonzero": "nonzero",
               "masked_select": "masked_select", "_unique": "unique", "_unique2": "unique", "unique_dim": "unique",
               "unique_consecutive": "unique", "equal": "torch.equal", "is_nonzero": "is_nonzero",
               "bincount": "bincount (its size read on CUDA)", "histc": "histc (a host read on CUDA)",
               "repeat_interleave": "repeat_interleave (a data-dependent shape)",
               "lift_fresh": "a tensor made from Python data (a host-to-device copy)"}


# torch.cuda calls no graph can hold: they wait for the device or copy state between it and the host
_CUDA_CALLS = {"synchronize": "waits for the device", "set_rng_state": "a host-to-device copy",
               "get_rng_state": "a device-to-host copy", "empty_cache": "frees device memory",
               "manual_seed": "sets the generators' state from the host"}


class HostSyncError(AssertionError):
    pass


class HostSyncGuard:
    """Raises HostSyncError on the first host read (or host-made tensor) inside the block;
    `reads` lists them when `strict=False` (then nothing raises). `calls` counts the torch calls
    it saw, so that a test can tell a clean block from one the guard could not see into."""

    def __init__(self, strict: bool = True):
        self.strict, self.reads, self.calls = strict, [], 0
        # torch function handling back on first: the rollout runs under megarl's
        # cpu_compat.suspended() (DisableTorchFunction), which would hide every call from a mode
        self._modes = (torch._C._EnableTorchFunction(), _FunctionGuard(self), _DispatchGuard(self))

    def flag(self, what: str):
        self.reads.append(what)
        if self.strict:
            raise HostSyncError(f"host read inside the graph-safe decode step: {what}")

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        self._saved = {name: getattr(torch.cuda, name) for name in _CUDA_CALLS}
        for name in _CUDA_CALLS:
            setattr(torch.cuda, name, self._cuda_call(name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(torch.cuda, name, fn)
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False

    def _cuda_call(self, name):
        def call(*args, **kwargs):
            self.flag(f"torch.cuda.{name} ({_CUDA_CALLS[name]})")
            return self._saved[name](*args, **kwargs)
        return call


class _FunctionGuard(TorchFunctionMode):
    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        flag = self.guard.flag
        self.guard.calls += 1
        if func in _READS:
            flag(name)
        elif func in _DATA_SHAPES:
            flag(f"{name} (a data-dependent shape)")
        elif func is torch.isin:
            flag("isin (on CUDA, beyond a few test ids, a sort through unique, whose size the host reads)")
        elif func in _FACTORIES and kwargs.get("device") is None:
            flag(f"torch.{name} without a device (made in host memory)")
        elif func is torch.Tensor.to and _to_host(args, kwargs):
            flag("Tensor.to(cpu) of a device tensor" if args[0].device.type != "cpu" else "Tensor.to('cpu')")
        elif func is torch.Tensor.repeat_interleave and len(args) > 1 and torch.is_tensor(args[1]):
            flag("repeat_interleave by a tensor (a data-dependent shape)")
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _bool_index(args[1] if len(args) > 1 else None):
            flag("indexing with a boolean tensor (its nonzeros counted on the host)")
        return func(*args, **kwargs)


class _DispatchGuard(TorchDispatchMode):
    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func._schema.name.split("::")[-1]
        what = _ATEN_SYNCS.get(op)
        if what is None and op in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1 \
                and _bool_index(tuple(args[1])):
            what = "indexing with a boolean tensor (its nonzeros counted on the host)"
        if what is not None:
            self.guard.flag(f"{func._schema.name}: {what}")
        return func(*args, **(kwargs or {}))


def _to_host(args, kwargs) -> bool:
    dev = kwargs.get("device", args[1] if len(args) > 1 and isinstance(args[1], (str, torch.device)) else None)
    return dev is not None and torch.device(dev).type == "cpu"


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)
