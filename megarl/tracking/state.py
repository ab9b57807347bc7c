"""`<run_dir>/tracking.json`: which MLflow run a run directory belongs to.

It is what makes resume continue the same MLflow run, lets child stages find the store their
parent used, and lets `write_report` find the run without being told the id.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from megarl.utils.atomic import write_atomic

STATE_NAME = "tracking.json"


class RunState:
    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / STATE_NAME
        self._lock = threading.Lock()

    def load(self) -> dict:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def save(self, **fields) -> None:
        """Merge fields into the file atomically (write a temp file, then rename)."""
        with self._lock:
            data = self.load()
            data.update({k: v for k, v in fields.items() if v is not None})
            write_atomic(self.path, json.dumps(data, indent=2, sort_keys=True), durable=False)
