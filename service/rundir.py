"""Read-only views of a run directory, as the trainer writes it.

    <runs>/<id>/config.toml manifest.json metrics.jsonl events.jsonl stdout.log
                checkpoints/latest checkpoints/step-N/
                service/attempt-N.log service/attempt-N.exit     (written by the service)

JSONL files are followed incrementally (byte offset + partial line), so a
scrape or a page refresh costs only what was appended since the last one.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter, deque
from pathlib import Path
from typing import Any

import tomli

HISTORY_POINTS = 4000
RECENT_EVENTS = 20


class JsonlFollower:
    """Parses complete lines appended to a JSONL file since the last poll."""

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # rewritten from scratch: start over
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a torn or foreign line never stops the reader
            if isinstance(rec, dict):
                out.append(rec)
        return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The int/float entries of a metrics record (bools, strings and lists dropped)."""
    return {k: float(v) for k, v in record.items() if _is_number(v)}


def vectors(record: dict[str, Any]) -> dict[str, list[float]]:
    """The list-of-number entries of a metrics record (e.g. per-expert load shares)."""
    return {k: [float(x) for x in v] for k, v in record.items()
            if isinstance(v, list) and v and all(_is_number(x) for x in v)}


class RunFiles:
    """Cached, incremental reads of one run directory."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir
        self._lock = threading.Lock()
        self._metrics = JsonlFollower(run_dir / "metrics.jsonl")
        self._events = JsonlFollower(run_dir / "events.jsonl")
        self._history: deque[dict[str, float]] = deque(maxlen=HISTORY_POINTS)
        self._latest: dict[str, float] = {}
        self._latest_vectors: dict[str, list[float]] = {}
        self._event_counts: Counter[str] = Counter()
        self._violations: Counter[str] = Counter()
        self._recent_events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._recent_violations: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)

    def refresh(self) -> None:
        with self._lock:
            for rec in self._metrics.poll():
                values = numeric(rec)
                if values:
                    self._history.append(values)
                    self._latest = values
                    self._latest_vectors = vectors(rec)
            for ev in self._events.poll():
                kind = str(ev.get("kind", "unknown"))
                self._event_counts[kind] += 1
                self._recent_events.append(ev)
                if kind == "invariant_violation":
                    self._violations[str(ev.get("check", "unknown"))] += 1
                    self._recent_violations.append(ev)

    def latest_metrics(self) -> dict[str, float]:
        self.refresh()
        with self._lock:
            return dict(self._latest)

    def latest_vectors(self) -> dict[str, list[float]]:
        self.refresh()
        with self._lock:
            return dict(self._latest_vectors)

    def history(self, tail: int, keys: list[str] | None) -> list[dict[str, float]]:
        self.refresh()
        with self._lock:
            rows = list(self._history)[-tail:] if tail > 0 else []
        if keys:
            rows = [{k: r[k] for k in ("step", *keys) if k in r} for r in rows]
        return [{k: (v if math.isfinite(v) else None) for k, v in r.items()} for r in rows]

    def events(self) -> dict[str, Any]:
        self.refresh()
        with self._lock:
            return {
                "counts": dict(self._event_counts),
                "recent": list(self._recent_events),
                "invariant_violations": {
                    "total": sum(self._violations.values()),
                    "by_check": dict(self._violations),
                    "recent": list(self._recent_violations),
                },
            }

    def violations_by_check(self) -> dict[str, int]:
        self.refresh()
        with self._lock:
            return dict(self._violations)

    def event_counts(self) -> dict[str, int]:
        self.refresh()
        with self._lock:
            return dict(self._event_counts)

    def config_value(self, section: str, key: str) -> Any:
        """A value of the resolved config.toml the trainer wrote; None before it exists."""
        try:
            return tomli.loads((self.dir / "config.toml").read_text()).get(section, {}).get(key)
        except (OSError, tomli.TOMLDecodeError, AttributeError):
            return None

    def checkpoint_folder(self) -> Path:
        """checkpoint.folder from the resolved config.toml (relative: the service refuses others)."""
        folder = self.config_value("checkpoint", "folder")
        if not isinstance(folder, str) or not folder or Path(folder).is_absolute() or ".." in Path(folder).parts:
            folder = "checkpoints"
        return self.dir / folder

    def latest_checkpoint(self) -> str | None:
        """The step directory named by <checkpoint folder>/latest, when it exists."""
        latest = self.checkpoint_folder() / "latest"
        try:
            name = latest.read_text().strip()
        except OSError:
            return None
        if not name or "/" in name or name.startswith("."):
            return None
        return name if (latest.parent / name).is_dir() else None


class RunFilesCache:
    """One RunFiles per run id, shared by the API and the exporter."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = runs_dir
        self._lock = threading.Lock()
        self._files: dict[str, RunFiles] = {}

    def get(self, run_id: str) -> RunFiles:
        with self._lock:
            files = self._files.get(run_id)
            if files is None:
                files = self._files[run_id] = RunFiles(self.runs_dir / run_id)
            return files


def tail_lines(path: Path, n: int, block: int = 65536) -> list[str]:
    """The last `n` lines of a text file, read backwards in blocks."""
    if n <= 0:
        return []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return []
    with f:
        f.seek(0, 2)
        pos = f.tell()
        data = b""
        while pos > 0 and data.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    lines = data.decode("utf-8", errors="replace").splitlines()
    return lines[-n:]
