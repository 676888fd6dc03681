"""The supervisor when the registry refuses a write: a lock is waited out, anything else never leaves a run claiming to
run with nothing alive (or something alive that the registry does not hold), and the problem is visible until the
next pass that can write settles the run.

Faults are injected into the registry's SQLite connection (`FlakyDb`): the statements a predicate picks raise (an
SQLite error, or any other). A relaunch that fails otherwise between its start and its record is handled as one the
registry refuses.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import sys
import time
from typing import Callable

import psutil
import pytest
from fastapi.testclient import TestClient

import service.supervisor
from service.app import create_app
from service.registry import Attempt, Registry
from service.rundir import RunFilesCache
from service.settings import Settings
from service.attempts import ATTEMPT_ENV, processes_by_attempt
from service.supervisor import Supervisor
from service_harness import HERE, gone, wait_until

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = {steps}\nseq_len = 64\n[metrics]\nlog_freq = 1\n'
AUTH = {"Authorization": "Bearer x"}


class FlakyDb:
    """The registry's connection, raising `kind(error)` for each statement `refuse(sql)` picks (the first `times`
    only, when given); every other attribute is the connection's."""

    def __init__(self, db: sqlite3.Connection, refuse: Callable[[str], bool], error: str, times: int | None = None,
                 kind: type[Exception] = sqlite3.OperationalError):
        self.db, self.refuse, self.error, self.times, self.kind = db, refuse, error, times, kind
        self.refused = 0

    def execute(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        if self.refuse(sql) and (self.times is None or self.refused < self.times):
            self.refused += 1
            raise self.kind(self.error)
        return self.db.execute(sql, args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


def writes(sql: str) -> bool:
    return not sql.lstrip().upper().startswith("SELECT")


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the fake trainer
    monkeypatch.setenv("FAKE_TRAINER_STEP_SECONDS", "0.05")
    monkeypatch.setattr(service.supervisor, "UNSETTLED_RETRY_S", 0.05)
    (tmp_path / "state").mkdir()
    return Settings(state_dir=tmp_path / "state", token="x", gpus=0, max_running=0, launcher="python",
                    trainer_module="fake_trainer")


def submit(settings: Settings, reg: Registry, run_id: str, steps: int, restart_limit: int = 2,
           crash_at: int | None = None) -> None:
    run_dir = settings.runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "submitted.toml").write_text(INLINE.format(steps=steps))
    overrides = {"debug.crash_at_step": str(crash_at)} if crash_at else {}
    reg.insert_run(run_id, "inline", overrides, 1, 0, restart_limit)


def alive(settings: Settings, run_id: str) -> list[psutil.Process]:
    """Every live process of any attempt of the run."""
    prefix = str(settings.runs_dir / run_id) + os.sep
    return [p for tag, procs in processes_by_attempt().items() if tag.startswith(prefix) for p in procs]


def until(sup: Supervisor, done: Callable[[], object], what: str, timeout: float = 60):
    def check():
        sup.tick()
        return done()
    return wait_until(check, timeout, what, interval=0.05)


@pytest.fixture
def cleanup(settings):
    """Kills whatever a test left of its attempts."""
    yield
    prefix = str(settings.state_dir) + os.sep
    for tag, procs in processes_by_attempt().items():
        if tag.startswith(prefix):
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    p.kill()


def test_a_locked_registry_is_waited_out_within_the_pass(settings, monkeypatch, cleanup):
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "r", steps=3)
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.tick()
        flaky = FlakyDb(reg._db, lambda sql: sql.startswith("UPDATE attempts"), "database is locked", times=2)
        monkeypatch.setattr(reg, "_db", flaky)
        until(sup, lambda: flaky.refused, "the exit to be recorded")
        run = reg.get("r")
        assert run.state == "finished" and [a.exit_code for a in run.attempts] == [0], run.message
        assert flaky.refused == 2 and sup.unsettled() == {}
    finally:
        reg.close()


def test_a_relaunch_the_registry_cannot_record_is_killed_and_the_run_failed(settings, monkeypatch, cleanup):
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "c", steps=50, crash_at=3)
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.tick()
        assert reg.get("c").state == "running"
        flaky = FlakyDb(reg._db, lambda sql: sql.startswith("INSERT INTO attempts"), "database disk image is malformed")
        monkeypatch.setattr(reg, "_db", flaky)
        run = until(sup, lambda: reg.get("c") if reg.get("c").state != "running" else None, "the crash to settle")
        assert run.state == "failed" and flaky.refused == 1, run.message
        assert run.message == ("attempt 1 exited with code 3; restart 1 of 2, no checkpoint: starts over at update 0; "
                               "attempt 2 could not be recorded, so it was killed (OperationalError: database disk "
                               "image is malformed); resume to try again"), run.message
        assert [(a.n, a.exit_code) for a in run.attempts] == [(1, 3)] and run.restarts == 0
        assert alive(settings, "c") == [] and sup.unsettled() == {}
        assert not (settings.runs_dir / "c" / "service" / "attempt-2.log").exists()
    finally:
        reg.close()


def unreadable_events(monkeypatch, reg: Registry) -> str:
    """Counting the set-aside events.jsonl of the attempt a relaunch follows fails (a disk error)."""
    def tally_events(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(service.supervisor, "tally_events", tally_events)
    return "OSError: [Errno 5] Input/output error: "


def registry_raising_other(monkeypatch, reg: Registry) -> str:
    """The registry's connection raises an error of another kind than SQLite's as the attempt is recorded."""
    monkeypatch.setattr(reg, "_db", FlakyDb(reg._db, lambda sql: sql.startswith("INSERT INTO attempts"),
                                            "Python int too large to convert to SQLite INTEGER", kind=OverflowError))
    return "OverflowError: Python int too large to convert to SQLite INTEGER"


@pytest.mark.parametrize("fault", [unreadable_events, registry_raising_other])
def test_a_relaunch_that_fails_otherwise_before_its_record_is_killed_and_the_run_failed(settings, monkeypatch, cleanup,
                                                                                          fault):
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "c", steps=50, crash_at=3)
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir, reg.carried))
        sup.tick()
        assert reg.get("c").state == "running"
        error = fault(monkeypatch, reg)
        run = until(sup, lambda: reg.get("c") if reg.get("c").state != "running" else None, "the crash to settle")
        assert run.state == "failed" and (f"attempt 2 could not be recorded, so it was killed ({error}") in run.message, \
            run.message
        assert run.message.startswith("attempt 1 exited with code 3; restart 1 of 2, ") and \
            run.message.endswith("; resume to try again"), run.message
        assert [(a.n, a.exit_code) for a in run.attempts] == [(1, 3)] and run.restarts == 0
        assert alive(settings, "c") == [] and sup.unsettled() == {}
        assert not (settings.runs_dir / "c" / "service" / "attempt-2.log").exists()
        for _ in range(3):  # nothing is relaunched beside what ran
            sup.tick()
        assert reg.get("c") == run and alive(settings, "c") == []
    finally:
        reg.close()


def test_a_registry_refusing_every_write_is_reconciled_by_the_next_pass_that_can(settings, monkeypatch, cleanup):
    app = create_app(settings)  # no lifespan: the test drives the supervisor's passes
    svc = app.state.service
    reg, sup = svc.registry, svc.supervisor
    client = TestClient(app, base_url="http://127.0.0.1")
    try:
        submit(settings, reg, "w", steps=50, crash_at=3)
        sup.tick()
        first = reg.get("w").attempts[0]
        flaky = FlakyDb(reg._db, writes, "disk I/O error")
        monkeypatch.setattr(reg, "_db", flaky)
        until(sup, lambda: "w" in sup.unsettled(), "the refused relaunch")
        assert gone(first.pid, 10)
        # the registry still says running (it can record nothing) and the run's attempt ended: what it launched in
        # its place was killed, since the registry does not hold it
        assert reg.get("w").state == "running" and alive(settings, "w") == []
        error = client.get("/v1/runs/w").json()["registry_error"]
        assert error.startswith("the registry refused to record the end of its attempt (OperationalError: disk I/O "
                                "error; "), error
        assert "titan_k3_service_runs_unsettled 1.0" in client.get("/metrics").text
        health = client.get("/healthz").json()
        assert health["status"] == "degraded" and health["problems"] == [f"run w: {error}"]
        r = client.post("/v1/runs/w/stop", headers=AUTH)
        assert r.status_code == 503 and r.json()["detail"] == "stop of run 'w' not recorded: disk I/O error"

        monkeypatch.setattr(reg, "_db", flaky.db)  # the disk is back
        run = until(sup, lambda: reg.get("w") if reg.get("w").state == "failed" else None, "the run to settle", 120)
        assert [(a.n, a.exit_code) for a in run.attempts] == [(1, 3), (2, 3), (3, 3)], run.message
        assert run.restarts_total == 2 and sup.unsettled() == {}
        assert client.get("/v1/runs/w").json()["registry_error"] is None
        assert client.get("/healthz").json() == {"status": "ok", "runs": 1, "gpus_total": 0, "gpus_used": 0,
                                                 "problems": [], "seconds_since_pass": None}  # no watcher thread
    finally:
        svc.trainer_check.close()
        reg.close()
        svc.state_lock.close()


def test_a_running_run_with_no_live_attempt_is_settled_and_strays_killed(settings, cleanup):
    """What a pass finds when an earlier one was cut short between its records: the registry says running, its last
    attempt ended, and a process of an attempt it never recorded runs."""
    reg = Registry(settings.state_dir / "registry.sqlite3")
    stray = None
    try:
        submit(settings, reg, "s", steps=3)
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        log_path, exit_path = sup.attempt_files("s", 1)
        log_path.parent.mkdir(parents=True)
        reg.add_attempt(Attempt("s", 1, 1, 0.0, time.time(), None, None, [], str(log_path), str(exit_path)))
        reg.end_attempt("s", 1, 0)
        reg.update_run("s", state="running")
        _, next_exit = sup.attempt_files("s", 2)
        stray = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**os.environ, ATTEMPT_ENV: str(next_exit)})
        wait_until(lambda: alive(settings, "s"), 10, "the stray to carry its tag")
        sup.tick()
        run = reg.get("s")
        assert run.state == "finished" and [a.n for a in run.attempts] == [1], run.message
        assert gone(stray.pid, 10)
    finally:
        if stray is not None and stray.poll() is None:
            stray.kill()
        reg.close()


def test_a_delete_the_registry_refuses_leaves_the_killed_run_stopped_not_relaunched(settings, monkeypatch, cleanup):
    app = create_app(settings)
    svc = app.state.service
    reg, sup = svc.registry, svc.supervisor
    client = TestClient(app, base_url="http://127.0.0.1")
    try:
        submit(settings, reg, "d", steps=200)
        sup.tick()
        pid = reg.get("d").attempts[0].pid
        monkeypatch.setattr(reg, "_db", FlakyDb(reg._db, lambda sql: sql.startswith("DELETE FROM"), "disk I/O error"))
        r = client.delete("/v1/runs/d", headers=AUTH)
        assert r.status_code == 503 and r.json()["detail"] == "DELETE of run 'd' not recorded: disk I/O error"
        assert gone(pid, 10)
        sup.tick()
        run = reg.get("d")
        assert run.state == "stopped" and len(run.attempts) == 1 and alive(settings, "d") == [], run.message
    finally:
        svc.trainer_check.close()
        reg.close()
        svc.state_lock.close()


def test_a_write_whose_read_back_fails_still_returns_and_the_next_read_selects_again(settings, monkeypatch):
    """The snapshot `snapshot()` readers see is taken as each write ends: a write that committed is not reported as
    failed when that select fails, and no reader is served the state from before it."""
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "r", steps=3)
        flaky = FlakyDb(reg._db, lambda sql: sql.startswith("SELECT * FROM runs"), "disk I/O error", times=1)
        monkeypatch.setattr(reg, "_db", flaky)
        reg.update_run("r", restarts_total=4)
        assert flaky.refused == 1
        assert reg.snapshot().runs[0].restarts_total == 4 and reg.get("r").restarts_total == 4
    finally:
        reg.close()
