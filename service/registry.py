"""SQLite registry (WAL) of runs and their attempts.

One connection guarded by a lock: FastAPI's worker threads and the
supervisor thread share it, and every write is one short transaction.
Reads are answered from a snapshot of the tables taken as each write ends
(every write goes through this class), so a busy API costs no query per
request. `list` and `get` read it under the lock: they wait for a
check-then-act sequence that holds it (a supervisor pass holds it throughout)
and never see one half done; `runs_if_free` reads it as they would when no
one holds the lock, and says so when one does. `snapshot()` reads it without
the lock: the state as of the last committed write, for what must answer
during a pass (/healthz, /metrics, the carried counts a run's file view
starts from).

Run states:
  queued -> running -> finished | failed | stopped
  running -> stopping -> stopped          (POST stop)
  running -> running (next attempt)       (crash within the restart limit, also one while the service was down)
  running/stopping -> lost                (service restarted, process gone, no exit record)
  queued -> running | finished | lost     (service restarted after it recorded an attempt but before it marked
                                           the run running: the attempt is re-adopted or settled, never relaunched)
  stopped | failed | lost -> queued       (POST resume; refused when the run trained and kept no checkpoint)
  any -> (gone)                           (DELETE; an active run's processes are killed first)

Writes: every write is one transaction, and `batch()` makes several one (an attempt's end and what follows it: the
next attempt's record, the run's new state), so no failure leaves a run between two of its records. A transaction
the database refuses as locked or busy is tried again (WRITE_TRIES, each waiting up to BUSY_TIMEOUT_S for the lock);
any other error, or a lock held past the last try, is raised to the caller.

Counts that must never go down (Prometheus reads a drop as a counter reset) are rows here, not memory:
  runs.restarts_total             relaunches after a crash (runs.restarts, the one the limit reads, resets on resume)
  attempts                        one row per attempt launched
  carried                         what an attempt's events.jsonl counted (events by kind, invariant violations by
                                  check) once that file moved to service/attempt-<n>/ (the next attempt started
                                  over): the run's counts are these plus its current events.jsonl
  totals['deleted_restarts']      restarts_total of the runs DELETE forgot (the service-wide total keeps them)
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("service.registry")

BUSY_TIMEOUT_S = 10.0
"""How long one try of a write waits for a lock another connection holds (SQLite's busy timeout)."""
WRITE_TRIES = 3
"""Tries of a write refused as locked or busy: a write fails after about WRITE_TRIES * BUSY_TIMEOUT_S of contention."""

STATES = ("queued", "running", "stopping", "stopped", "finished", "failed", "lost")
ACTIVE = ("running", "stopping")
TERMINAL = ("stopped", "finished", "failed", "lost")
RESUMABLE = ("stopped", "failed", "lost")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    recipe TEXT NOT NULL,
    overrides TEXT NOT NULL,
    nproc_per_node INTEGER NOT NULL,
    gpus INTEGER NOT NULL,
    assigned_gpus TEXT NOT NULL DEFAULT '[]',
    restart_limit INTEGER NOT NULL,
    restarts INTEGER NOT NULL DEFAULT 0,
    restarts_total INTEGER NOT NULL DEFAULT 0,
    stop_requested_at REAL,
    message TEXT NOT NULL DEFAULT '',
    prometheus_port INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
    run_id TEXT NOT NULL REFERENCES runs(id),
    n INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    pid_start_time REAL NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    exit_code INTEGER,
    assigned_gpus TEXT NOT NULL,
    log_path TEXT NOT NULL,
    exit_path TEXT NOT NULL,
    PRIMARY KEY (run_id, n)
);
CREATE TABLE IF NOT EXISTS carried (
    run_id TEXT NOT NULL REFERENCES runs(id),
    attempt INTEGER NOT NULL,
    events TEXT NOT NULL,
    violations TEXT NOT NULL,
    PRIMARY KEY (run_id, attempt)
);
CREATE TABLE IF NOT EXISTS totals (
    name TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""


@dataclass
class Attempt:
    run_id: str
    n: int
    pid: int
    pid_start_time: float
    started_at: float
    ended_at: float | None
    exit_code: int | None
    assigned_gpus: list[int]
    log_path: str
    exit_path: str


@dataclass
class Run:
    id: str
    seq: int
    state: str
    recipe: str
    overrides: dict[str, str]
    nproc_per_node: int
    gpus: int
    assigned_gpus: list[int]
    restart_limit: int
    restarts: int
    restarts_total: int
    stop_requested_at: float | None
    message: str
    created_at: float
    updated_at: float
    prometheus_port: int = 0
    """metrics.prometheus_port of the resolved config (0: none): no two live runs may claim one."""
    attempts: list[Attempt] = field(default_factory=list)
    carried_attempts: frozenset[int] = frozenset()
    """Attempts whose events.jsonl the registry has counted (`Registry.carry`)."""

    @property
    def last_attempt(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


@dataclass(frozen=True)
class Snapshot:
    """The registry as a committed write left it (shared: readers must not change it)."""

    runs: list[Run]
    """Every run, in creation order."""
    deleted_restarts: int
    """Relaunches after a crash of the runs DELETE forgot."""
    carried: dict[str, tuple[dict[str, int], dict[str, int]]]
    """run id -> events by kind and invariant violations by check of its attempts set aside, summed (runs with any)."""


class DuplicateRun(Exception):
    """A run with this name already exists (the API answers 409)."""


class Registry:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.RLock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        self._db.row_factory = sqlite3.Row
        self._snapshot: Snapshot | None = None
        """The tables as the last write left them; None when selecting them after it failed (the next read selects)."""
        self._pending: list[tuple[str, tuple[Any, ...]]] | None = None
        try:
            with self._lock:
                self._db.execute("PRAGMA journal_mode=WAL")
                self._db.execute("PRAGMA synchronous=NORMAL")
                self._db.execute("PRAGMA foreign_keys=ON")
                self._db.executescript(_SCHEMA)
                columns = {r["name"] for r in self._db.execute("PRAGMA table_info(runs)")}
                if "prometheus_port" not in columns:  # a registry written before the column existed
                    self._db.execute("ALTER TABLE runs ADD COLUMN prometheus_port INTEGER NOT NULL DEFAULT 0")
                self._snapshot = self._select()
        except sqlite3.Error as e:  # not a database, damaged, read-only, a full disk
            self._db.close()
            raise ValueError(f"registry {path}: cannot open it ({e})") from None

    @property
    def lock(self) -> threading.RLock:
        """Held across check-then-act sequences (create, stop, schedule)."""
        return self._lock

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _write(self, sql: str, args: tuple[Any, ...]) -> None:
        with self._lock:
            if self._pending is not None:
                self._pending.append((sql, args))
            else:
                self._commit([(sql, args)])

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The writes made inside the block are committed together when it ends, in one transaction; none of them
        when it raises (or when the commit fails: the error is raised). Reads inside do not see them yet."""
        with self._lock:
            if self._pending is not None:  # inside another batch: part of it
                yield
                return
            self._pending = []
            try:
                yield
                ops = self._pending
            finally:
                self._pending = None
            if ops:
                self._commit(ops)

    def _commit(self, ops: list[tuple[str, tuple[Any, ...]]]) -> None:
        """Run `ops` in one transaction, tried again while the database answers locked or busy; the snapshot is
        taken again before it returns or raises."""
        with self._lock:
            try:
                for tries in range(1, WRITE_TRIES + 1):
                    try:
                        self._transaction(ops)
                        return
                    except sqlite3.OperationalError as e:
                        if not is_transient(e) or tries == WRITE_TRIES:
                            raise
                        log.warning("registry write refused (%s); try %d of %d", e, tries + 1, WRITE_TRIES)
                        time.sleep(0.05 * tries)
            finally:
                self._take_snapshot()

    def _transaction(self, ops: list[tuple[str, tuple[Any, ...]]]) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            for sql, args in ops:
                self._db.execute(sql, args)
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                with contextlib.suppress(sqlite3.Error):  # the error that got us here is the one to raise
                    self._db.execute("ROLLBACK")
            raise

    def _take_snapshot(self) -> None:
        """Select the tables into the snapshot as a write ends.

        NOTE: at once, not at the next read: `snapshot()` readers never wait for a read under the lock, and must never
        see less than a write that returned (a run's file view built after a set-aside from counts that miss it would
        send its event counters down). A select that fails leaves no snapshot: the next read selects, under the lock.
        Its error is not the write's (which committed, or raises its own).
        """
        try:
            self._snapshot = self._select()
        except sqlite3.Error as e:
            self._snapshot = None
            log.warning("registry: reading the tables back after a write failed (%s); the next read tries again", e)

    def insert_run(self, run_id: str, recipe: str, overrides: dict[str, str], nproc_per_node: int,
                   gpus: int, restart_limit: int, prometheus_port: int = 0) -> None:
        now = time.time()
        try:
            self._write(
                "INSERT INTO runs (id, state, recipe, overrides, nproc_per_node, gpus, restart_limit, created_at,"
                " updated_at, prometheus_port) VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, recipe, json.dumps(overrides), nproc_per_node, gpus, restart_limit, now, now, prometheus_port),
            )
        except sqlite3.IntegrityError:
            raise DuplicateRun(run_id) from None

    def update_run(self, run_id: str, **fields: Any) -> None:
        if "assigned_gpus" in fields:
            fields["assigned_gpus"] = json.dumps(fields["assigned_gpus"])
        fields["updated_at"] = time.time()
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._write(f"UPDATE runs SET {cols} WHERE id = ?", (*fields.values(), run_id))

    def delete_run(self, run_id: str) -> None:
        """Forget a run and its attempts (one transaction)."""
        with self.batch():
            self._write(
                "INSERT INTO totals (name, value) SELECT 'deleted_restarts', restarts_total FROM runs WHERE id = ?"
                " ON CONFLICT (name) DO UPDATE SET value = value + excluded.value", (run_id,))
            self._write("DELETE FROM carried WHERE run_id = ?", (run_id,))
            self._write("DELETE FROM attempts WHERE run_id = ?", (run_id,))
            self._write("DELETE FROM runs WHERE id = ?", (run_id,))

    def add_attempt(self, a: Attempt) -> None:
        self._write(
            "INSERT INTO attempts (run_id, n, pid, pid_start_time, started_at, assigned_gpus, log_path, exit_path)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (a.run_id, a.n, a.pid, a.pid_start_time, a.started_at, json.dumps(a.assigned_gpus), a.log_path, a.exit_path),
        )

    def end_attempt(self, run_id: str, n: int, exit_code: int | None) -> None:
        """Record attempt `n`'s end (again: its first end time stays)."""
        self._write("UPDATE attempts SET ended_at = COALESCE(ended_at, ?), exit_code = ? WHERE run_id = ? AND n = ?",
                    (time.time(), exit_code, run_id, n))

    def carry(self, run_id: str, attempt: int, events: dict[str, int], violations: dict[str, int]) -> None:
        """Record what attempt `attempt`'s events.jsonl counted, now that it moved aside (again: the same counts)."""
        self._write("INSERT OR REPLACE INTO carried (run_id, attempt, events, violations) VALUES (?, ?, ?, ?)",
                    (run_id, attempt, json.dumps(events), json.dumps(violations)))

    def carried(self, run_id: str) -> tuple[dict[str, int], dict[str, int]]:
        """Events by kind and invariant violations by check of the run's attempts set aside, summed (from
        `snapshot()`: without waiting for the lock)."""
        events, violations = self.snapshot().carried.get(run_id, ({}, {}))
        return dict(events), dict(violations)

    def snapshot(self) -> Snapshot:
        """The registry as its last committed write left it, without waiting for the lock (a supervisor pass holds it
        throughout, up to WRITE_TRIES x BUSY_TIMEOUT_S on one write that SQLite's lock holds up). Under the lock only
        when reading the tables back after a write failed."""
        snapshot = self._snapshot
        if snapshot is not None:
            return snapshot
        with self._lock:
            return self._current()

    def get(self, run_id: str) -> Run | None:
        return next((r for r in self._all() if r.id == run_id), None)

    def runs_if_free(self) -> list[Run] | None:
        """What `list()` returns, without waiting: None while another thread holds the lock (a supervisor pass, a
        create), whose writes `list()` and `get()` wait for, or while the snapshot must be selected again (a disk
        read). Cheap enough for the event loop (shared objects: callers must not change them)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            snapshot = self._snapshot
            return None if snapshot is None else snapshot.runs
        finally:
            self._lock.release()

    def list(self, states: tuple[str, ...] | None = None) -> list[Run]:
        """Runs in creation order, those in `states` only when given (shared objects: callers must not change them)."""
        runs = self._all()
        return list(runs) if states is None else [r for r in runs if r.state in states]

    def _all(self) -> list[Run]:
        with self._lock:
            return self._current().runs

    def _current(self) -> Snapshot:
        """The snapshot, selected again when the last try failed (the lock held)."""
        if self._snapshot is None:
            self._snapshot = self._select()
        return self._snapshot

    def _select(self) -> Snapshot:
        rows = self._db.execute("SELECT * FROM runs ORDER BY seq").fetchall()
        attempts: dict[str, list[Attempt]] = {r["id"]: [] for r in rows}
        for a in self._db.execute("SELECT * FROM attempts ORDER BY run_id, n"):
            attempts[a["run_id"]].append(_attempt(a))
        carried_attempts: dict[str, set[int]] = {r["id"]: set() for r in rows}
        carried: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
        for c in self._db.execute("SELECT * FROM carried"):
            carried_attempts[c["run_id"]].add(c["attempt"])
            totals = carried.setdefault(c["run_id"], ({}, {}))
            for total, counts in zip(totals, (json.loads(c["events"]), json.loads(c["violations"]))):
                for key, n in counts.items():
                    total[key] = total.get(key, 0) + n
        total = self._db.execute("SELECT value FROM totals WHERE name = 'deleted_restarts'").fetchone()
        return Snapshot(runs=[_run(r, attempts[r["id"]], frozenset(carried_attempts[r["id"]])) for r in rows],
                        deleted_restarts=total["value"] if total else 0, carried=carried)


def is_transient(e: sqlite3.Error) -> bool:
    """Whether SQLite refused for a lock another connection holds (worth another try), not for the database itself."""
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "is locked" in str(e) or "is busy" in str(e)


def _attempt(r: sqlite3.Row) -> Attempt:
    return Attempt(
        run_id=r["run_id"], n=r["n"], pid=r["pid"], pid_start_time=r["pid_start_time"], started_at=r["started_at"],
        ended_at=r["ended_at"], exit_code=r["exit_code"], assigned_gpus=json.loads(r["assigned_gpus"]),
        log_path=r["log_path"], exit_path=r["exit_path"],
    )


def _run(r: sqlite3.Row, attempts: list[Attempt], carried: frozenset[int]) -> Run:
    return Run(
        id=r["id"], seq=r["seq"], state=r["state"], recipe=r["recipe"], overrides=json.loads(r["overrides"]),
        nproc_per_node=r["nproc_per_node"], gpus=r["gpus"], assigned_gpus=json.loads(r["assigned_gpus"]),
        restart_limit=r["restart_limit"], restarts=r["restarts"], restarts_total=r["restarts_total"],
        stop_requested_at=r["stop_requested_at"], message=r["message"], created_at=r["created_at"],
        updated_at=r["updated_at"], prometheus_port=r["prometheus_port"], attempts=attempts,
        carried_attempts=carried,
    )
