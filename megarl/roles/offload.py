"""Offload and onload a role's parameters, gradients and optimizer state, at the storage level.

Why storages: a role's tensors are mostly views (DDP bucket views and `main_grad` into
`grad_data`; with the distributed optimizer `param.data` and the fp32 shards into `param_data`;
tied weights; the optimizer's references to the same parameters). Copying each *storage* to a
host buffer and `untyped_storage().resize_(0)` frees the device memory while every view, every
optimizer reference and every hook stays valid; onload `resize_`s and copies back, bit-exact.
megatron-core's own helpers do not fit (measured on megatron-core 0.16: DDP's restore zeroes the grads,
`_ParamAndGradBuffer.offload_to_cpu` needs `param_data`, the optimizer's acts on CUDA only).

Three kinds, claimed in this order (a storage shared by two kinds belongs to the first):
  params     model parameters and buffers, DDP `param_data` (distributed optimizer)
  grads      DDP `grad_data`, every `main_grad` / `.grad`, incl. the main params' grads
  optimizer  the optimizer's own tensors: fp32 main params (bf16/fp16, distributed shards),
             Adam moments and step counters
A tensor whose storage has been freed must never be touched (CPU kernels would read freed
memory). Guards installed on offload make the role's entry points raise `OffloadedError`
instead: a forward (params offloaded, or grads offloaded in a training forward), the DDP
gradient methods, and the optimizer's step / zero_grad / state dicts.

On CUDA the copies run on a side stream (pinned host buffers, events); on CPU the same code runs
without streams. Every move reports the role's residency to a `ResidencyLedger`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass, field

import torch

from megarl.roles.residency import KINDS, ResidencyLedger, default_ledger


class OffloadedError(RuntimeError):
    """A role was used while (part of) its state is offloaded."""


@dataclass
class _Entry:
    storage: torch.UntypedStorage  # the (now empty) storage; keeps its identity alive
    nbytes: int
    host: torch.Tensor  # uint8 [nbytes]


@dataclass
class _RoleState:
    ledger: ResidencyLedger
    offloaded: dict = field(default_factory=lambda: {k: {} for k in KINDS})  # kind -> {key: _Entry}
    pool: dict = field(default_factory=dict)  # nbytes -> [free host buffers], reused across cycles
    guards: list = field(default_factory=list)  # removable hooks / shadowed methods
    pending: object = None  # CUDA event of an onload still copying
    workspaces: dict = field(default_factory=dict)  # name -> WeakSet of objects with release(), nbytes()


def _state(role, ledger: ResidencyLedger | None = None) -> _RoleState:
    st = role.__dict__.get("_offload_state")
    if st is None:
        st = _RoleState(ledger or default_ledger())
        role.__dict__["_offload_state"] = st
    elif ledger is not None:
        st.ledger = ledger
    return st


def attach(role, ledger: ResidencyLedger) -> None:
    """Report this role's moves to `ledger` (default: the process-wide ledger)."""
    _state(role, ledger)
    _record(role, "attach")
    report_workspaces(role)


def register_workspace(role, name: str, workspace) -> None:
    """Device memory built on the role's parameters (the rollout engine's KV cache and CUDA
    graphs, which read the weights where they are): released before the parameters leave the
    device, counted in the ledger as `<role>/<name>` (all of that name together: several engines
    may sample from one role). workspace: release(), nbytes(); held weakly."""
    _state(role).workspaces.setdefault(name, weakref.WeakSet()).add(workspace)


def report_workspaces(role) -> None:
    """The role's workspaces' bytes into its ledger (after they grew or were released)."""
    st = _state(role)
    for name, kept in st.workspaces.items():
        st.ledger.record_workspace(f"{role.name}/{name}", sum(ws.nbytes() for ws in kept))


# ---------------------------------------------------------------------------------------------
# Which storages a role holds


def _key(st: torch.UntypedStorage) -> int:
    return st._cdata  # the StorageImpl: one per storage however many views/wrappers exist


def _optimizers(role) -> list:
    opt = role.optimizer
    if opt is None:
        return []
    return list(getattr(opt, "chained_optimizers", [opt]))


def _tensor_groups(obj) -> list:
    """Tensors in a megatron optimizer's `*_groups` attributes (main params, shards, model params)."""
    out = []
    for name, value in vars(obj).items():
        if not name.endswith("_groups") or not isinstance(value, (list, tuple)):
            continue
        for group in value:
            if isinstance(group, (list, tuple)):
                out.extend(t for t in group if isinstance(t, torch.Tensor))
    return out


def role_storages(role) -> dict:
    """kind -> {storage key: UntypedStorage} of every tensor the role holds on its device.

    Tensors elsewhere (e.g. Adam's CPU step counters on a CUDA run) are not the device's
    memory and are left out.
    """
    device = _device(role)
    claimed: dict[int, str] = {}
    found = {k: {} for k in KINDS}

    def claim(kind, tensors):
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor) or t.device != device:
                continue
            st = t.untyped_storage()
            k = _key(st)
            if k not in claimed:
                claimed[k] = kind
                found[kind][k] = st

    params, grads, optim = [], [], []
    for chunk in role.chunks:
        params += list(chunk.parameters()) + list(torch.nn.Module.buffers(chunk))  # DDP's `buffers` is a list
        for buf in _ddp_buffers(chunk):
            params.append(getattr(buf, "param_data", None))
            grads.append(getattr(buf, "grad_data", None))
        for p in chunk.parameters():
            grads += [getattr(p, "main_grad", None), p.grad]
    for o in _optimizers(role):
        group_tensors, state_tensors = _tensor_groups(o), []
        inner = getattr(o, "optimizer", None)
        if inner is not None:
            ordered = [p for g in inner.param_groups for p in g["params"]]  # stable across a state load
            group_tensors += ordered
            seen = {id(p) for p in ordered}
            states = [inner.state[p] for p in ordered if p in inner.state]
            states += [s for p, s in inner.state.items() if id(p) not in seen]
            for s in states:
                state_tensors += [s[name] for name in sorted(s) if isinstance(s[name], torch.Tensor)]
        optim += group_tensors + state_tensors  # main params, then Adam's moments and steps
        grads += [t.grad for t in group_tensors] + [getattr(t, "main_grad", None) for t in group_tensors]
    claim("params", params)
    claim("grads", grads)
    claim("optimizer", optim)
    return found


def _ddp_buffers(chunk) -> list:
    """DDP's _ParamAndGradBuffers (absent on a frozen role's bare module)."""
    own = chunk.__dict__
    return list(own.get("buffers") or []) + list(own.get("expert_parallel_buffers") or [])


def _device(role) -> torch.device:
    return next(role.chunks[0].parameters()).device


def residency(role, found: dict | None = None) -> dict:
    """kind -> {"device": bytes, "host": bytes} as it is now (`found`: role_storages(role),
    when the caller has it)."""
    st = _state(role)
    found = role_storages(role) if found is None else found
    out = {}
    for kind in KINDS:
        off = st.offloaded[kind]
        device = sum(s.nbytes() for k, s in found[kind].items() if k not in off)
        out[kind] = {"device": device, "host": sum(e.nbytes for e in off.values())}
    return out


def offloaded_kinds(role) -> tuple:
    st = role.__dict__.get("_offload_state")
    return tuple(k for k in KINDS if st is not None and st.offloaded[k])


def _record(role, event: str, found: dict | None = None) -> dict:
    res = residency(role, found)
    _state(role).ledger.record(role.name, res, event)
    return res


# ---------------------------------------------------------------------------------------------
# Moves


def _byte_view(st: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (nbytes,), (1,))


def _host_buffer(st: _RoleState, nbytes: int, pin: bool) -> torch.Tensor:
    free = st.pool.get(nbytes)
    if free:
        return free.pop()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


_streams: dict = {}


def _side_stream(device: torch.device):
    if device.type != "cuda":
        return None
    if device not in _streams:
        _streams[device] = torch.cuda.Stream(device)
    return _streams[device]


def _wait_pending(st: _RoleState) -> None:
    if st.pending is not None:
        torch.cuda.current_stream().wait_event(st.pending)
        st.pending = None


def offload(role, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
    """Move the chosen kinds of the role's state to host memory; returns its residency.

    Already-offloaded kinds are left as they are. Refuses to move gradients while a gradient
    accumulation is in progress (between a training forward_backward and the optimizer step).
    """
    kinds = [k for k, on in zip(KINDS, (params, grads, optimizer)) if on]
    if "grads" in kinds and getattr(role, "accumulating", False):
        raise OffloadedError(f"role {role.name}: cannot offload gradients during a gradient accumulation "
                             "(after forward_backward, before the optimizer step); step first or pass grads=False")
    st = _state(role)
    _wait_pending(st)
    if "params" in kinds and st.workspaces:  # they read the parameters' memory, which is about to go
        for kept in st.workspaces.values():
            for ws in kept:
                ws.release()
        report_workspaces(role)
    found = role_storages(role)
    moves = [(kind, k, s) for kind in kinds for k, s in found[kind].items()
             if k not in st.offloaded[kind] and s.nbytes() > 0]
    for kind, _, s in moves:
        if not s.resizable():
            raise OffloadedError(f"role {role.name}: a {kind} storage of {s.nbytes()} bytes cannot be resized "
                                 "(shared with numpy or another process?); it cannot be offloaded")
    device = _device(role)
    stream = _side_stream(device)
    entries = []
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # the data's producers first
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        for kind, k, s in moves:
            n = s.nbytes()
            host = _host_buffer(st, n, pin=device.type == "cuda")
            host.copy_(_byte_view(s, n), non_blocking=stream is not None)
            entries.append((kind, k, _Entry(s, n, host)))
    if stream is not None:
        stream.synchronize()  # the copies must be complete before the memory is released
    for kind, k, e in entries:
        e.storage.resize_(0)
        st.offloaded[kind][k] = e
    if entries:
        _install_guards(role, st)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return _record(role, "offload " + ",".join(kinds), found)


def onload(role, params: bool = True, grads: bool = True, optimizer: bool = True, *, wait: bool = True) -> dict:
    """Bring the chosen kinds back to the device, bit-exact; returns the role's residency.

    With wait=False on CUDA the copies are only enqueued on the side stream; the role's next
    use (or `wait_onload`) makes the current stream wait for them.
    """
    kinds = [k for k, on in zip(KINDS, (params, grads, optimizer)) if on]
    st = _state(role)
    device = _device(role)
    stream = _side_stream(device)
    restored = [(kind, k, st.offloaded[kind].pop(k)) for kind in kinds for k in list(st.offloaded[kind])]
    for _, _, e in restored:
        e.storage.resize_(e.nbytes)  # allocated on the current stream
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # after the allocations
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
        for _, _, e in restored:
            _byte_view(e.storage, e.nbytes).copy_(e.host, non_blocking=stream is not None)
    if stream is not None:
        st.pending = stream.record_event()
        if wait:
            _wait_pending(st)
    for _, _, e in restored:  # reusable once the copy is done: the event orders it on CUDA
        st.pool.setdefault(e.nbytes, []).append(e.host)
    if not offloaded_kinds(role):
        _remove_guards(st)
    return _record(role, "onload " + ",".join(kinds))


def wait_onload(role) -> None:
    """Make the current CUDA stream wait for the role's pending onload copies (no-op on CPU)."""
    _wait_pending(_state(role))



def _refuse(role, what: str, needs: tuple):
    off = [k for k in needs if k in offloaded_kinds(role)]
    if off:
        raise OffloadedError(f"role {role.name}: {what} needs its {'/'.join(off)}, which are offloaded; "
                             f"call role.onload() first")


def _install_guards(role, st: _RoleState) -> None:
    if st.guards:
        return

    def unwrap(m):  # DDP / Float16Module -> the model whose forward runs
        while hasattr(m, "module") and isinstance(m.module, torch.nn.Module):
            m = m.module
        return m

    def pre_forward(module, args):
        _refuse(role, "forward", ("params",))
        if torch.is_grad_enabled() and module.training and any(p.requires_grad for p in module.parameters()):
            _refuse(role, "a training forward", ("grads",))

    modules = []
    for chunk in role.chunks:
        for m in (chunk, unwrap(chunk)):
            if all(m is not x for x in modules):
                modules.append(m)
    for m in modules:
        st.guards.append(m.register_forward_pre_hook(pre_forward))

    def shadow(obj, name, needs):
        original = getattr(obj, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def guarded(*a, **kw):
            _refuse(role, f"{type(obj).__name__}.{name}", needs)
            return original(*a, **kw)

        obj.__dict__[name] = guarded
        st.guards.append(_Unshadow(obj, name))

    for chunk in role.chunks:
        for name in ("zero_grad_buffer", "start_grad_sync", "finish_grad_sync", "scale_gradients"):
            shadow(chunk, name, ("grads",))
    if role.optimizer is not None:
        shadow(role.optimizer, "step", KINDS)
        shadow(role.optimizer, "zero_grad", ("grads",))
        for name in ("state_dict", "sharded_state_dict", "load_state_dict"):
            shadow(role.optimizer, name, ("params", "optimizer"))


@dataclass
class _Unshadow:
    obj: object
    name: str

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


def _remove_guards(st: _RoleState) -> None:
    for g in st.guards:
        g.remove()
    st.guards.clear()


# ---------------------------------------------------------------------------------------------
# Temporarily resident (checkpoints)


@contextlib.contextmanager
def resident(roles):
    """Make every state of `roles` resident for the block, then restore each role's residency.

    Re-offloading collects the storages anew, so tensors replaced inside the block (a loaded
    optimizer state) are the ones moved back out.
    """
    roles = list(roles)
    before = [(r, offloaded_kinds(r)) for r in roles]
    for r, kinds in before:
        if kinds:
            onload(r)
    try:
        yield
    finally:
        for r, kinds in before:
            if kinds:
                offload(r, **{k: k in kinds for k in KINDS})


def resident_during(arg: str):
    """Decorator: the roles passed as argument `arg` (a Role or a dict of them) are resident
    while the function runs, and left as they were afterwards."""
    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            value = sig.bind(*args, **kwargs).arguments[arg]
            roles = value.values() if isinstance(value, dict) else [value]
            with resident([r for r in roles if hasattr(r, "chunks")]):
                return fn(*args, **kwargs)
        return wrapper
    return deco
