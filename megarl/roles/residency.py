"""Who holds the accelerator: a residency ledger of the roles' bytes (the scheduler: phases.py).

RL runs four roles in the same processes; they take turns on the device. The ledger keeps, per
role, the bytes of params/grads/optimizer state on the device and on the host, updated by every
move (`megarl.roles.offload` reports to it), with the peak of the device total overall and per
phase; on CUDA it also records `torch.cuda.memory_allocated` and the allocator's peak per phase.
"""
from __future__ import annotations


import torch

KINDS = ("params", "grads", "optimizer")


class ResidencyLedger:
    """Bytes per role and kind on the device and the host; peaks overall and per phase."""

    def __init__(self):
        self.roles: dict[str, dict] = {}  # role -> kind -> {"device": bytes, "host": bytes}
        self.phase: str | None = None
        self.peak_device_bytes = 0  # since construction or reset_peak()
        self.phase_peak_bytes: dict[str, int] = {}  # phase -> peak ledger device bytes in it
        self.cuda: dict[str, dict] = {}  # phase -> {"allocated": bytes at exit, "peak": bytes}
        self.events: list[tuple] = []  # (phase, role, event, device total after it)
        self.workspaces: dict[str, int] = {}  # "role/name" -> device bytes built on a role's weights

    def record(self, role: str, residency: dict, event: str = "") -> None:
        self.roles[role] = {k: dict(v) for k, v in residency.items()}
        self.events.append((self.phase, role, event, self._track_peak()))
        del self.events[:-1000]  # a bounded trail

    def record_workspace(self, name: str, nbytes: int) -> None:
        """Device bytes of a workspace ("role/name", e.g. the rollout's KV cache and graphs)."""
        self.workspaces[name] = int(nbytes)
        self._track_peak()

    def _track_peak(self) -> int:
        """The device total now, folded into the peaks (overall and the phase's); returns it."""
        total = self.device_bytes()
        self.peak_device_bytes = max(self.peak_device_bytes, total)
        if self.phase is not None:
            self.phase_peak_bytes[self.phase] = max(self.phase_peak_bytes.get(self.phase, 0), total)
        return total

    def device_bytes(self, role: str | None = None, kind: str | None = None) -> int:
        """Params, grads and optimizer state (`kind`), and with kind None the workspaces too."""
        ws = 0 if kind is not None else sum(b for n, b in self.workspaces.items()
                                            if role is None or n.split("/")[0] == role)
        return self._sum("device", role, kind) + ws

    def host_bytes(self, role: str | None = None, kind: str | None = None) -> int:
        return self._sum("host", role, kind)

    def _sum(self, where, role, kind) -> int:
        names = [role] if role is not None else list(self.roles)
        return sum(self.roles[n][k][where] for n in names if n in self.roles
                   for k in ([kind] if kind is not None else KINDS))

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes()

    def begin_phase(self, phase: str) -> None:
        """Close the current phase (CUDA: its allocator peak) and start counting `phase`."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            if self.phase is not None:
                self.cuda[self.phase] = {"allocated": torch.cuda.memory_allocated(),
                                         "peak": torch.cuda.max_memory_allocated()}
            torch.cuda.reset_peak_memory_stats()
        self.phase = phase
        self.phase_peak_bytes[phase] = max(self.phase_peak_bytes.get(phase, 0), self.device_bytes())

    def snapshot(self) -> dict:
        """A loggable view: per-role bytes, totals, peaks."""
        return {"phase": self.phase, "roles": {n: {k: dict(v) for k, v in r.items()} for n, r in self.roles.items()},
                "device_bytes": self.device_bytes(), "host_bytes": self.host_bytes(),
                "workspaces": dict(self.workspaces),
                "peak_device_bytes": self.peak_device_bytes, "phase_peak_bytes": dict(self.phase_peak_bytes),
                "cuda": {p: dict(v) for p, v in self.cuda.items()}}

    def metrics(self, prefix: str = "residency/") -> dict:
        """Flat float metrics (GiB) for a tracker."""
        gib = float(2**30)
        out = {f"{prefix}device_gib": self.device_bytes() / gib, f"{prefix}host_gib": self.host_bytes() / gib,
               f"{prefix}peak_device_gib": self.peak_device_bytes / gib}
        for n in self.roles:
            out[f"{prefix}{n}/device_gib"] = self.device_bytes(n) / gib
        for n, b in self.workspaces.items():
            out[f"{prefix}{n}_gib"] = b / gib
        return out


_default = ResidencyLedger()


def default_ledger() -> ResidencyLedger:
    return _default


def _kinds(spec, where: str) -> tuple:
    if spec == "all":
        return KINDS
    if isinstance(spec, str):
        spec = (spec,)
    bad = [k for k in spec if k not in KINDS]
    if bad:
        raise ValueError(f"{where}: unknown state kind(s) {bad}; expected 'all' or some of {list(KINDS)}")
    return tuple(k for k in KINDS if k in spec)
