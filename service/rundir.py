"""Read-only views of a run directory, as the trainer writes it.

    <runs>/<id>/submitted.toml                            (written by the service)
                config.toml manifest.json metrics.jsonl events.jsonl stdout.log
                checkpoints/latest checkpoints/step-N/
                service/attempt-N.log service/attempt-N.exit     (written by the service)
                service/attempt-N/       attempt N's trainer files, moved aside before a later attempt
                                         started over without a checkpoint

JSONL files are followed incrementally (byte offset + partial line), and
the small files (config.toml, checkpoints/latest) are parsed again only when
their size or modification time changed, so a request or a scrape costs a few
stat calls per run plus what was appended since the last one.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import Counter, deque
from pathlib import Path
from typing import Any, Callable

import tomli

from titan_k3.values import is_number

SERVICE_NAMES = ("submitted.toml", "service")
"""What the service itself keeps at the top of a run directory: the TOML as submitted, and the attempts' records."""

HISTORY_POINTS = 4000
RECENT_EVENTS = 20


class JsonlFollower:
    """Parses complete lines appended to a JSONL file since the last poll.

    NOTE: the offset stays at the end of the last complete line: the bytes of a line still being written are read
    again at the next poll rather than kept. A trainer resumed after a kill inside a write drops that cut-short line
    before it appends (titan_k3/metrics/events.py, JsonLines), so the next record starts where the fragment did.
    """

    def __init__(self, path: Path):
        self.path = path
        self._offset = 0

    def poll(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:  # rewritten from scratch: start over
            self._offset = 0
        if size == self._offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1
        self._offset += end
        out = []
        for line in data[:end].split(b"\n"):
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


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The int/float entries of a metrics record (bools, strings and lists dropped)."""
    return {k: float(v) for k, v in record.items() if is_number(v)}


def vectors(record: dict[str, Any]) -> dict[str, list[float]]:
    """The list-of-number entries of a metrics record (e.g. per-expert load shares)."""
    return {k: [float(x) for x in v] for k, v in record.items()
            if isinstance(v, list) and v and all(is_number(x) for x in v)}


class StatCache:
    """`parse(path)` of a small file, parsed again only when its (mtime, size) changes; None while it is absent."""

    def __init__(self, path: Path, parse: Callable[[Path], Any]):
        self.path, self._parse = path, parse
        self._key: tuple[int, int] | None = None
        self._value: Any = None

    def get(self) -> Any:
        try:
            st = self.path.stat()
        except OSError:
            self._key, self._value = None, None
            return None
        key = (st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._value, self._key = self._parse(self.path), key
        return self._value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomli.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomli.TOMLDecodeError):
        return {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def tally_events(path: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Events by kind and invariant violations by check in an events.jsonl file (empty when it is absent)."""
    kinds: Counter[str] = Counter()
    checks: Counter[str] = Counter()
    for ev in JsonlFollower(path).poll():
        _count(ev, kinds, checks)
    return dict(kinds), dict(checks)


def _count(ev: dict[str, Any], kinds: Counter[str], checks: Counter[str]) -> bool:
    """Count one event by kind (and by check when it is an invariant violation); whether it was one."""
    kind = str(ev.get("kind", "unknown"))
    kinds[kind] += 1
    if kind == "invariant_violation":
        checks[str(ev.get("check", "unknown"))] += 1
        return True
    return False


Carried = Callable[[str], "tuple[dict[str, int], dict[str, int]]"]
"""run id -> (events by kind, violations by check) of its attempts whose events.jsonl moved aside."""


class RunFiles:
    """Cached, incremental reads of one run directory.

    Event and violation counts start from `carried` (what earlier attempts' events.jsonl counted before it moved
    to service/attempt-<n>/) and add the current events.jsonl: they count the whole run, and never go down.
    """

    def __init__(self, run_dir: Path, carried: tuple[dict[str, int], dict[str, int]] = ({}, {})):
        self.dir = run_dir
        self._lock = threading.Lock()
        self._config = StatCache(run_dir / "config.toml", _read_toml)
        self._latest_name: StatCache | None = None
        self._max_event_step = 0
        self._metrics = JsonlFollower(run_dir / "metrics.jsonl")
        self._events = JsonlFollower(run_dir / "events.jsonl")
        self._history: deque[dict[str, float]] = deque(maxlen=HISTORY_POINTS)
        self._latest: dict[str, float] = {}
        self._keys: set[str] = set()
        self._latest_vectors: dict[str, list[float]] = {}
        self._event_counts: Counter[str] = Counter(carried[0])
        self._violations: Counter[str] = Counter(carried[1])
        self._recent_events: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)
        self._recent_violations: deque[dict[str, Any]] = deque(maxlen=RECENT_EVENTS)

    def refresh(self) -> None:
        with self._lock:
            for rec in self._metrics.poll():
                values = numeric(rec)
                if values:
                    self._history.append(values)
                    self._keys.update(values)
                    self._latest = values
                    self._latest_vectors = vectors(rec)
            for ev in self._events.poll():
                step = ev.get("step")
                if is_number(step, finite=True):
                    self._max_event_step = max(self._max_event_step, int(step))
                self._recent_events.append(ev)
                if _count(ev, self._event_counts, self._violations):
                    self._recent_violations.append(ev)

    def latest_metrics(self) -> dict[str, float]:
        self.refresh()
        with self._lock:
            return dict(self._latest)

    def latest_vectors(self) -> dict[str, list[float]]:
        self.refresh()
        with self._lock:
            return dict(self._latest_vectors)

    def recorded_keys(self) -> set[str]:
        """Every numeric key some metrics record of the run has held."""
        self.refresh()
        with self._lock:
            return set(self._keys)

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
        with self._lock:
            table = self._config.get() or {}
        values = table.get(section)
        return values.get(key) if isinstance(values, dict) else None

    def checkpoint_folder(self) -> Path:
        """checkpoint.folder from the resolved config.toml (relative: the service refuses others)."""
        folder = self.config_value("checkpoint", "folder")
        if not isinstance(folder, str) or not folder or Path(folder).is_absolute() or ".." in Path(folder).parts:
            folder = "checkpoints"
        return self.dir / folder

    def latest_checkpoint(self) -> str | None:
        """The step directory named by <checkpoint folder>/latest, when it exists."""
        latest = self.checkpoint_folder() / "latest"
        with self._lock:
            if self._latest_name is None or self._latest_name.path != latest:
                self._latest_name = StatCache(latest, _read_text)
            name = self._latest_name.get()
        if not name or "/" in name or name.startswith("."):
            return None
        return name if (latest.parent / name).is_dir() else None

    def checkpoint_step(self) -> int | None:
        """The update the latest checkpoint holds ('step-N' -> N), None without one."""
        name = self.latest_checkpoint()
        digits = name.removeprefix("step-") if name else ""
        return int(digits) if digits.isdigit() else None

    def progress_step(self) -> int:
        """The furthest update any file of the run directory records (metrics, events, checkpoint); 0 for none."""
        latest = self.latest_metrics().get("step", 0.0)
        with self._lock:
            events = self._max_event_step
        return max(int(latest) if math.isfinite(latest) else 0, events, self.checkpoint_step() or 0)

    def step(self, attempt_started_at: float | None) -> int:
        """Updates done as the run directory shows them for the current attempt (started at the given time).

        The latest checkpoint's update, or the last logged one when the attempt has logged since it started
        (a relaunched attempt resumes from the checkpoint; one without a checkpoint starts over at 0).
        """
        ckpt = self.checkpoint_step() or 0
        logged = self.latest_metrics().get("step", 0.0)
        try:
            written = os.stat(self.dir / "metrics.jsonl").st_mtime
        except OSError:
            return ckpt
        if attempt_started_at is not None and written < attempt_started_at:
            return ckpt
        return max(ckpt, int(logged) if math.isfinite(logged) else 0)


class RunFilesCache:
    """One RunFiles per run id, shared by the API and the exporter; `carried` gives each its earlier attempts'
    counts when it is made (after a set-aside, `forget` makes the next one read them again)."""

    def __init__(self, runs_dir: Path, carried: Carried | None = None):
        self.runs_dir = runs_dir
        self._carried = carried
        self._lock = threading.Lock()
        self._files: dict[str, RunFiles] = {}
        self._forgotten: dict[str, int] = {}
        """run id -> how many times `forget` dropped it: a `get` that read the carried counts across a forget reads again."""

    def get(self, run_id: str) -> RunFiles:
        # NOTE: the carried counts are read from the registry without this cache's lock held: the supervisor holds
        # the registry's lock while it calls `forget`, so taking the two in the other order here deadlocked every
        # request that needed either (the service stopped answering).
        while True:
            with self._lock:
                files = self._files.get(run_id)
                if files is not None:
                    return files
                seen = self._forgotten.get(run_id, 0)
            carried = self._carried(run_id) if self._carried is not None else ({}, {})
            with self._lock:
                if self._forgotten.get(run_id, 0) != seen:
                    continue  # a set-aside carried more counts meanwhile: read them again
                files = self._files.get(run_id)
                if files is None:
                    files = self._files[run_id] = RunFiles(self.runs_dir / run_id, carried)
                return files

    def forget(self, run_id: str) -> None:
        """Drop a run's cached reads (a deleted run, or one whose attempt was set aside: the next `get` reads the
        carried counts again; a new run of the same name starts afresh)."""
        with self._lock:
            self._files.pop(run_id, None)
            self._forgotten[run_id] = self._forgotten.get(run_id, 0) + 1


LINE_BYTES = 64 << 10
"""What a log read keeps of one line: its last this many bytes (a progress bar redrawn with '\\r' for hours, a
binary blob, is one line); `--log-line-bytes`."""
READ_BYTES = 8 << 20
"""What one request reads of the logs at most, scanning back from their end; `--log-read-bytes`."""


def cut_note(cut: int) -> str:
    """The mark put before what is left of a line cut to its last LINE_BYTES bytes."""
    return f"[line cut: its first {cut} bytes not shown] "


def budget_note(limit: int) -> str:
    """The line put before the earliest line of a read stopped by its READ_BYTES budget."""
    return f"[log cut: at most {limit} bytes are read per request; earlier output not shown]"


class LineCap:
    """Assembles one line from pieces, keeping only its last `limit` bytes; `cut` counts the bytes dropped."""

    def __init__(self, limit: int):
        self.limit = limit
        self.parts: list[bytes] = []
        self.size = 0
        self.cut = 0

    def prepend(self, piece: bytes) -> None:
        """Add bytes that come before what the line holds (a backwards read)."""
        room = self.limit - self.size
        if len(piece) > room:
            self.cut += len(piece) - room
            piece = piece[len(piece) - room:] if room > 0 else b""
        if piece:
            self.parts.insert(0, piece)
            self.size += len(piece)

    def append(self, piece: bytes) -> None:
        """Add bytes that come after what the line holds (a forward read); its oldest bytes go past the limit."""
        self.parts.append(piece)
        self.size += len(piece)
        if self.size > self.limit:
            data = b"".join(self.parts)
            drop = len(data) - self.limit
            self.cut += drop
            self.parts, self.size = [data[drop:]], self.limit

    def __bool__(self) -> bool:
        return self.size > 0 or self.cut > 0

    def text(self, cut_before: bool = False) -> list[str]:
        """The line as display lines (split at '\\r' and the other line breaks, as str.splitlines does), the cut
        mark before the first; `cut_before`: bytes of it before those read are not shown either (a budget's end)."""
        lines = b"".join(self.parts).decode("utf-8", errors="replace").splitlines() or [""]
        if self.cut or cut_before:
            lines[0] = (cut_note(self.cut) if not cut_before else "[line cut: its earlier bytes not shown] ") + lines[0]
        return lines


def read_tail(path: Path, n: int, *, end: int | None = None, line_bytes: int = LINE_BYTES,
              max_bytes: int = READ_BYTES, block: int = 65536) -> tuple[list[str], int, bool]:
    """The last `n` lines of a text file (of its first `end` bytes when given), read backwards in blocks.

    Each line keeps its last `line_bytes` bytes (the cut ones are named in a mark before it), and at most `max_bytes`
    bytes are read: (lines, bytes read, whether the budget stopped the read before the file's start or the n-th line).
    A line holding '\\r' or another line break besides '\\n' is shown as several, each counted.
    """
    if n <= 0:
        return [], 0, False
    try:
        f = open(path, "rb")
    except OSError:  # absent or unreadable: the supervisor reads exits through it and must not stop on one
        return [], 0, False
    with f:
        size = f.seek(0, 2)
        pos = stop = size if end is None else min(end, size)
        if pos > 0:
            f.seek(pos - 1)
            if f.read(1) == b"\n":
                pos -= 1  # the file's final newline ends its last line; it starts no empty one
        out: list[str] = []  # newest first
        line = LineCap(line_bytes)
        read = 0
        while pos > 0 and len(out) < n:
            if read >= max_bytes:
                if line:
                    out.extend(reversed(line.text(cut_before=True)))
                return list(reversed(out[:n])), read, True
            step = min(block, pos, max_bytes - read)
            pos -= step
            f.seek(pos)
            data = f.read(step)
            read += step
            pieces = data.split(b"\n")
            for i in range(len(pieces) - 1, -1, -1):
                line.prepend(pieces[i])
                if i > 0:  # a newline comes before this piece: the line is whole
                    out.extend(reversed(line.text()))
                    line = LineCap(line_bytes)
                    if len(out) >= n:
                        break
        if pos == 0 and len(out) < n and stop > 0:  # the first line, from the file's start (it may be empty)
            out.extend(reversed(line.text()))
        return list(reversed(out[:n])), read, False


def tail_lines(path: Path, n: int) -> list[str]:
    """The last `n` lines of a text file, each cut to its last LINE_BYTES bytes, at most READ_BYTES read."""
    return read_tail(path, n)[0]
