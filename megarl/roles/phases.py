"""Phases of an RL step and which roles' states are resident in each.

`PhaseScheduler` makes "these roles' states are resident in this phase" true, moving only what
changes, offloading before onloading so that the peak is the largest phase, not the sum of the
roles. `PhaseClock` is one step's view of it: `with clock.phase("score_reward"):` makes that
phase's residency true and times the block; `with clock.timed("advantages"):` only times.
"""
from __future__ import annotations

import contextlib
import logging
import time

from megarl.roles import offload
from megarl.roles.residency import KINDS, ResidencyLedger, _kinds

log = logging.getLogger(__name__)


class PhaseScheduler:
    """For each phase, which roles' states are resident; everything else is offloaded.

    roles:  {name: Role}
    phases: {phase: {role name: "all" | kinds}}, e.g.
            {"generate": {"actor": ["params"]},
             "score": {"reference": ["params"], "reward": ["params"], "critic": ["params"]},
             "train": {"actor": "all", "critic": "all"}}
    offloadable: {role name: kinds that may leave the device} (default: all kinds of every role);
            a kind not listed stays resident in every phase (e.g. a role configured not to offload).
    """

    def __init__(self, roles: dict, phases: dict, *, offloadable: dict | None = None,
                 ledger: ResidencyLedger | None = None):
        self.roles = dict(roles)
        self.ledger = ledger or ResidencyLedger()
        self.phases = {}
        for phase, spec in phases.items():
            unknown = sorted(set(spec) - set(self.roles))
            if unknown:
                raise ValueError(f"phase {phase!r}: unknown role(s) {unknown}; roles are {sorted(self.roles)}")
            self.phases[phase] = {n: _kinds(k, f"phase {phase!r}, role {n!r}") for n, k in spec.items()}
        offloadable = offloadable or {}
        unknown = sorted(set(offloadable) - set(self.roles))
        if unknown:
            raise ValueError(f"offloadable: unknown role(s) {unknown}; roles are {sorted(self.roles)}")
        self.offloadable = {n: _kinds(offloadable.get(n, "all"), f"offloadable[{n!r}]") for n in self.roles}
        self.current: str | None = None
        for role in self.roles.values():
            offload.attach(role, self.ledger)

    def wanted(self, phase: str) -> dict:
        """role name -> kinds that must be resident in `phase`."""
        if phase not in self.phases:
            raise ValueError(f"unknown phase {phase!r}; phases are {sorted(self.phases)}")
        spec = self.phases[phase]
        return {n: tuple(k for k in KINDS if k in spec.get(n, ()) or k not in self.offloadable[n])
                for n in self.roles}

    def enter(self, phase: str) -> dict:
        """Make `phase`'s residency true, moving only what changes; returns the ledger snapshot."""
        wanted = self.wanted(phase)
        for name, role in self.roles.items():  # the closing phase's final footprint (lazy Adam state...)
            self.ledger.record(name, offload.residency(role), "refresh")
        for name, role in self.roles.items():  # offload first: the peak is one phase, not two
            have = set(KINDS) - set(offload.offloaded_kinds(role))
            out = [k for k in KINDS if k in have and k not in wanted[name]]
            if out:
                offload.offload(role, **{k: k in out for k in KINDS})
        self.ledger.begin_phase(phase)
        moved = []
        for name, role in self.roles.items():
            back = [k for k in KINDS if k in offload.offloaded_kinds(role) and k in wanted[name]]
            if back:
                offload.onload(role, **{k: k in back for k in KINDS}, wait=False)
                moved.append(role)
        for role in moved:  # all copies enqueued before waiting (CUDA: they overlap each other)
            offload.wait_onload(role)
        self.current = phase
        snap = self.ledger.snapshot()
        log.debug("phase %s: device %.3f GiB, host %.3f GiB, peak %.3f GiB", phase, snap["device_bytes"] / 2**30,
                 snap["host_bytes"] / 2**30, snap["peak_device_bytes"] / 2**30)
        return snap

    def need_bytes(self, phase: str, full: dict) -> int:
        """Device bytes `phase` needs, from each role's fully resident bytes per kind (`full`:
        name -> kind -> bytes, e.g. measured once with everything resident)."""
        return sum(full[n][k] for n, kinds in self.wanted(phase).items() for k in kinds)


class PhaseClock:
    """One step's phases, in the order they ran: seconds and device GiB at entry per phase.

    The step creates one, passes it to each phase and reads `metrics()` at the end; nothing
    else is kept between steps."""

    def __init__(self, scheduler: PhaseScheduler):
        self.scheduler = scheduler
        self.seconds: dict[str, float] = {}
        self.device_gib: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    @contextlib.contextmanager
    def phase(self, name: str):
        self.device_gib[name] = self.scheduler.enter(name)["device_bytes"] / 2**30
        with self.timed(name):
            yield

    def metrics(self) -> dict:
        out = {f"perf/{name}_s": s for name, s in self.seconds.items()}
        out.update({f"memory/{name}_device_gib": g for name, g in self.device_gib.items()})
        return out
