"""The queue between the training loop and the delivery thread: bounded memory, nothing lost.

Ops are small JSON-able dicts. They wait in memory (at most `max_items`); when that fills up
(tracking store down for a long time), the oldest half moves to a JSONL *spill file* in the run
directory, and `close()` writes whatever is still undelivered there too. The delivery thread
drains spill files before the in-memory queue, so delivery stays first-in first-out (a later
tag value is never overwritten by an earlier one replayed from disk). Spill files left by a
previous process are replayed the same way by the next Tracker on the same run directory.

Re-delivering an op is harmless (metrics are keyed by (key, step, timestamp, value) in MLflow's
SQL stores, params/tags/artifacts overwrite with the same value), so the rule is "deliver at
least once": an op is removed only after the store accepted it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("megarl.tracking")

SPILL_NAME = "tracking_spill.jsonl"
_REPLAY_GLOB = "tracking_spill.*.replay.jsonl"


class Outbox:
    """Thread-safe FIFO of ops with a disk overflow; `cond` wakes the consumer and flush waiters."""

    def __init__(self, run_dir: Path, max_items: int):
        self.run_dir = Path(run_dir)
        self.spill_path = self.run_dir / SPILL_NAME
        self.max_items = max(2, int(max_items))
        self.cond = threading.Condition()
        self._items: deque[tuple[int, dict]] = deque()
        self._last_seq = 0
        self._overflow_warned = False

    # ----------------------------------------------------------------- producer side
    def put(self, op: dict) -> None:
        with self.cond:
            self._last_seq += 1
            self._items.append((self._last_seq, op))
            if len(self._items) > self.max_items:
                moved = [self._items.popleft()[1] for _ in range(len(self._items) // 2)]
                try:
                    self._append_spill(moved)
                except OSError as exc:  # disk full / read-only: memory stays bounded, data is lost
                    log.warning("megarl.tracking: cannot write %s (%s); dropped %d ops",
                                self.spill_path, exc, len(moved))
                if not self._overflow_warned:
                    self._overflow_warned = True
                    log.warning(
                        "megarl.tracking: %d ops pending in memory; older ones go to %s and are "
                        "delivered when the tracking store is reachable", self.max_items, self.spill_path,
                    )
            self.cond.notify_all()

    def spill_all(self) -> int:
        """Move every op still in memory to the spill file (at close, when delivery timed out);
        returns how many were saved."""
        with self.cond:
            ops = [op for _, op in self._items]
            self._items.clear()
            if ops:
                try:
                    self._append_spill(ops)
                except OSError as exc:
                    log.warning("megarl.tracking: cannot write %s (%s); %d ops lost",
                                self.spill_path, exc, len(ops))
                    ops = []
            self.cond.notify_all()
            return len(ops)

    def _append_spill(self, ops: list[dict]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.spill_path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(op, default=str) + "\n" for op in ops))
            f.flush()
            os.fsync(f.fileno())

    # ----------------------------------------------------------------- consumer side
    def peek(self, n: int) -> list[tuple[int, dict]]:
        with self.cond:
            return [self._items[i] for i in range(min(n, len(self._items)))]

    def ack(self, upto_seq: int) -> None:
        """Drop delivered ops (those with seq <= upto_seq still in memory) and wake waiters."""
        with self.cond:
            while self._items and self._items[0][0] <= upto_seq:
                self._items.popleft()
            self.cond.notify_all()

    def claim_spill(self) -> Path | None:
        """Oldest spill file to replay (renamed, so new overflow starts a fresh file), or None."""
        with self.cond:
            claimed = sorted(self.run_dir.glob(_REPLAY_GLOB))
            if claimed:
                return claimed[0]
            if self.spill_path.exists():
                target = self.run_dir / f"tracking_spill.{time.time_ns()}.replay.jsonl"
                os.replace(self.spill_path, target)
                return target
            return None

    def has_spill(self) -> bool:
        return self.spill_path.exists() or any(self.run_dir.glob(_REPLAY_GLOB))

    def __len__(self) -> int:
        with self.cond:
            return len(self._items)

    @property
    def last_seq(self) -> int:
        with self.cond:
            return self._last_seq

    def delivered_upto(self, seq: int) -> bool:
        """True when no op with sequence number <= seq is still in memory."""
        with self.cond:
            return not self._items or self._items[0][0] > seq


def read_spill(path: Path, batch: int) -> Iterator[list[dict]]:
    """Ops of a spill file in batches; a torn last line (crash mid-write) is skipped."""
    chunk: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                chunk.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("megarl.tracking: skipping unreadable line %d of %s", lineno, path)
                continue
            if len(chunk) >= batch:
                yield chunk
                chunk = []
    if chunk:
        yield chunk
