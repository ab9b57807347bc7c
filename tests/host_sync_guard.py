"""A guard that fails on any host read of tensor data, for the graph-safe decode step's contract.

On a GPU each of these waits for the device (a host synchronisation) and cannot be captured in
a CUDA graph; on a CPU they are silent, so the contract test runs the step under this guard:
`.item()`, `.tolist()`, `.numpy()`, `bool(t)` / `int(t)` / `float(t)`, a copy to the host
(`.cpu()`, `.to("cpu")`), and data-dependent shapes (`nonzero`, `masked_select`, `unique`,
indexing with a boolean tensor, `repeat_interleave` by a tensor).
"""
import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu}
_DATA_SHAPES = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique,
                torch.Tensor.unique, torch.argwhere, torch.Tensor.argwhere}


class HostSyncError(AssertionError):
    pass


class HostSyncGuard(TorchFunctionMode):
    """Raises HostSyncError on the first host read inside the block; `reads` lists them when
    `strict=False` (then nothing raises)."""

    def __init__(self, strict: bool = True):
        super().__init__()
        self.strict, self.reads = strict, []

    def _flag(self, what: str):
        self.reads.append(what)
        if self.strict:
            raise HostSyncError(f"host read inside the graph-safe decode step: {what}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in _READS:
            self._flag(name)
        elif func in _DATA_SHAPES:
            self._flag(f"{name} (a data-dependent shape)")
        elif func is torch.Tensor.to and _to_host(args, kwargs):
            self._flag("Tensor.to(cpu) of a device tensor" if args[0].device.type != "cpu" else "Tensor.to('cpu')")
        elif func is torch.Tensor.repeat_interleave and len(args) > 1 and torch.is_tensor(args[1]):
            self._flag("repeat_interleave by a tensor (a data-dependent shape)")
        elif func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None):
            self._flag("indexing with a boolean tensor (a data-dependent shape)")
        return func(*args, **kwargs)


def _to_host(args, kwargs) -> bool:
    dev = kwargs.get("device", args[1] if len(args) > 1 and isinstance(args[1], (str, torch.device)) else None)
    return dev is not None and torch.device(dev).type == "cpu"


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)
