"""events.jsonl: invariant violations, non-finite updates, fallbacks, restarts — each also printed loudly."""

from __future__ import annotations

import json
import time
from pathlib import Path


class JsonLines:
    """A JSON-lines file this process appends records to, one line each (metrics.jsonl, events.jsonl).

    NOTE: a process killed inside a write (a record of 176 experts' loads per layer takes several write calls) or a
    full disk leaves the file's last line cut short, without its newline. The first append drops that fragment,
    which is no record, so the next record starts a line of its own instead of being glued onto it (one unreadable
    line in the middle, and the record lost with it).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tail_checked = False

    def append(self, record: dict, **dumps_kwargs) -> None:
        if not self._tail_checked:
            drop_cut_short_tail(self.path)
            self._tail_checked = True
        with open(self.path, "a") as f:
            f.write(json.dumps(record, **dumps_kwargs) + "\n")


def drop_cut_short_tail(path: Path) -> int:
    """Truncate `path` after its last newline (the whole file when it has none); returns the bytes dropped."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, 2)
        end = size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            cut = block.rfind(b"\n")
            if cut >= 0:
                keep = start + cut + 1
                break
            end = start
        else:
            keep = 0
        if keep < size:
            f.truncate(keep)
        return size - keep


class EventLog:
    """path: events.jsonl (None: keep no file); echo: also print each event (rank 0 speaks for the run, so
    other ranks' logs do not echo: an event every rank emits, such as a stop, prints once)."""

    def __init__(self, path: Path | None, echo: bool = True):
        self.path = path
        self._file = JsonLines(path) if path is not None else None
        self.echo = echo
        self.counts: dict[str, int] = {}

    def emit(self, kind: str, message: str, step: int = 0, **fields) -> dict:
        record = {"time": time.time(), "step": step, "kind": kind, "message": message, **fields}
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.echo:
            print(f"[{kind}] step {step}: {message}", flush=True)
        if self._file is not None:
            self._file.append(record, default=str)
        return record
