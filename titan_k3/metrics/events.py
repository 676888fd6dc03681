"""events.jsonl: invariant violations, non-finite updates, fallbacks, restarts — each also printed loudly."""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    def __init__(self, path: Path | None):
        self.path = path
        self.counts: dict[str, int] = {}

    def emit(self, kind: str, message: str, step: int = 0, **fields) -> dict:
        record = {"time": time.time(), "step": step, "kind": kind, "message": message, **fields}
        self.counts[kind] = self.counts.get(kind, 0) + 1
        print(f"[{kind}] step {step}: {message}", flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record
