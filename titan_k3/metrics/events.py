"""events.jsonl: invariant violations, non-finite updates, fallbacks, restarts — each also printed loudly."""

from __future__ import annotations

import json
import time
from pathlib import Path


class EventLog:
    """path: events.jsonl (None: keep no file); echo: also print each event (rank 0 speaks for the run, so
    other ranks' logs do not echo: an event every rank emits, such as a stop, prints once)."""

    def __init__(self, path: Path | None, echo: bool = True):
        self.path = path
        self.echo = echo
        self.counts: dict[str, int] = {}

    def emit(self, kind: str, message: str, step: int = 0, **fields) -> dict:
        record = {"time": time.time(), "step": step, "kind": kind, "message": message, **fields}
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.echo:
            print(f"[{kind}] step {step}: {message}", flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, default=str) + "\n")
        return record
