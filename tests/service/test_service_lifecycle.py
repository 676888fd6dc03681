"""What a demanding user meets over a run's life: log streams across attempts, a second service over one state
directory, bad flags at start."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import time

import pytest

from service.app import _follow
from service.operations import Service
from service.registry import Attempt
from service.settings import Settings
from service_harness import REPO, wait_until

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


def test_a_log_stream_gives_an_ended_attempts_last_lines_before_the_next_attempt(tmp_path):
    """The lines an attempt writes as it dies (the crash, the traceback) come before the next attempt's header,
    however soon that attempt starts: they were skipped when the relaunch came before the stream's next read."""
    svc = Service(Settings(state_dir=tmp_path, token="x", gpus=0))
    logs = tmp_path / "runs" / "r" / "service"
    logs.mkdir(parents=True)
    try:
        svc.registry.insert_run("r", "inline", {}, 1, 0, 2)
        first, second = logs / "attempt-1.log", logs / "attempt-2.log"
        first.write_text("step 1\n")
        svc.registry.add_attempt(Attempt("r", 1, 1, 0.0, time.time(), None, None, [], str(first), ""))
        svc.registry.update_run("r", state="running")

        async def follow() -> list[str]:
            stream = _follow(svc, svc.get("r"), 0)
            pending = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.05)  # the stream is past its start (it follows attempt 1 from its end) and waits
            first.open("a").write("step 2\n")
            chunks = [await asyncio.wait_for(pending, 10)]
            # attempt 1 dies writing its last words, and attempt 2 starts, all before the stream reads again
            first.open("a").write("Traceback: boom\nexit without a newline")
            svc.registry.end_attempt("r", 1, 3)
            second.write_text("attempt 2 starts\n")
            svc.registry.add_attempt(Attempt("r", 2, 1, 0.0, time.time(), None, None, [], str(second), ""))
            chunks += await asyncio.wait_for(_until_end(stream, svc), 10)
            return [c.decode() for c in chunks]

        got = asyncio.run(follow())
        data = [c.removeprefix("data: ").strip() for c in got if c.startswith("data: ")]
        assert data[:5] == ["step 2", "Traceback: boom", "exit without a newline", "=== attempt 2 ===",
                            "attempt 2 starts"], got
    finally:
        svc.trainer_check.close()
        svc.registry.close()


async def _until_end(stream, svc) -> list[bytes]:
    """The stream's chunks until its end event; the run fails once attempt 2's first line is out."""
    chunks = []
    async for chunk in stream:
        chunks.append(chunk)
        if b"attempt 2 starts" in chunk:
            svc.registry.end_attempt("r", 2, 3)
            svc.registry.update_run("r", state="failed")
        if chunk.startswith(b"event: end"):
            break
    return chunks


def start_alone(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m service ARGS` run to its exit (these starts must fail)."""
    return subprocess.run([sys.executable, "-m", "service", "--gpus", "0", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_second_service_over_one_state_dir_refuses_to_start(make_service):
    """Two services over one registry would both re-adopt and relaunch the same runs (and each answered from its
    own view of the registry: a run created on one was a 404 on the other)."""
    svc = make_service(fake=True)
    assert svc.create(toml=INLINE, name="mine", overrides={"training.steps": 4000}).status_code == 201
    svc.wait_state("mine", ("running",))
    out = start_alone(["--state-dir", str(svc.state_dir), "--port", "0"])
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"python -m service: error: --state-dir {svc.state_dir}: in use by another service (pid {svc.proc.pid}); "
        "stop it, or give another --state-dir"], out.stderr
    assert svc.run("mine")["state"] == "running" and len(svc.run("mine")["attempts"]) == 1
    svc.kill()  # the lock goes with the process, however it ends
    svc.start()
    assert svc.run("mine")["state"] == "running" and len(svc.run("mine")["attempts"]) == 1


def test_a_token_file_that_cannot_be_read_is_one_line(tmp_path):
    out = start_alone(["--state-dir", str(tmp_path / "state"), "--token-file", str(tmp_path / "absent")])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"python -m service: error: --token-file '{tmp_path / 'absent'}': cannot read it (No such file or directory)")
    assert not (tmp_path / "state").exists()
    latin1 = tmp_path / "token"
    latin1.write_bytes(b"caf\xe9\n")
    out = start_alone(["--state-dir", str(tmp_path / "state"), "--token-file", str(latin1)])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        f"python -m service: error: --token-file '{latin1}': not UTF-8 text (byte 3: invalid continuation byte)")
    assert not (tmp_path / "state").exists()


def test_a_registry_that_is_not_a_database_is_one_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "registry.sqlite3").write_bytes(b"not a database, a file copied over it\n" * 100)
    out = start_alone(["--state-dir", str(state)])
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        f"python -m service: error: registry {state / 'registry.sqlite3'}: cannot open it (file is not a database)"], \
        out.stderr


def test_a_registry_on_a_full_disk_is_507_and_leaves_nothing(tmp_path, monkeypatch):
    """The run directory fits, the registry's write does not (SQLite's own error, not an OSError): it was a 500."""
    from fastapi import HTTPException

    from service.schemas import RunCreate

    svc = Service(Settings(state_dir=tmp_path, token="x", gpus=0))
    svc.trainer_check = lambda sub: None  # the host check is not what this test is about

    def full(*args, **kwargs):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(svc.registry, "insert_run", full)
    try:
        with pytest.raises(HTTPException) as e:
            svc.create(RunCreate(name="full", toml=INLINE))
        assert e.value.status_code == 507
        assert e.value.detail == "cannot record run 'full' in the registry: database or disk is full"
        assert not (tmp_path / "runs" / "full").exists() and svc.registry.get("full") is None
    finally:
        svc.registry.close()
        svc.state_lock.close()


def test_an_attempt_that_crashed_while_the_service_was_down_is_relaunched(make_service):
    """The restart policy outlives a service restart: the crash is relaunched as it would have been with the
    service up (it was settled as lost, waiting for a resume by hand)."""
    svc = make_service(fake=True, step_seconds=1.0)
    body = {"toml": INLINE, "name": "away", "restart_limit": 1, "overrides": {"debug.crash_at_step": 2}}
    assert svc.create(**body).status_code == 201
    svc.wait_state("away", ("running",))
    svc.kill()
    exit_file = svc.state_dir / "runs" / "away" / "service" / "attempt-1.exit"
    wait_until(exit_file.exists, 60, "attempt 1 to crash while the service is down")
    svc.start()
    run = svc.wait_state("away", ("failed",))
    assert run["exit_codes"] == [3, 3] and run["restarts_total"] == 1, run
    assert run["message"] == "attempt 2 exited with code 3; restart limit 1 reached"




def test_a_delete_that_cannot_remove_the_files_keeps_the_run_and_says_so(tmp_path, monkeypatch):
    """DELETE ?files=true answered files_removed: true when the directory stayed (the name then stayed taken, with
    no run left to delete); now the run stays and the answer names what could not go."""
    from fastapi.testclient import TestClient

    import service.supervisor
    from service.app import create_app

    app = create_app(Settings(state_dir=tmp_path, token="x", gpus=0))  # no lifespan: no supervisor thread
    svc = app.state.service
    run_dir = tmp_path / "runs" / "stuck"
    (run_dir / "checkpoints").mkdir(parents=True)
    svc.registry.insert_run("stuck", "inline", {}, 1, 0, 2)
    svc.registry.update_run("stuck", state="failed")

    def busy(path, ignore_errors=False, **kwargs):
        if ignore_errors:
            return
        raise OSError(16, "Device or resource busy", str(run_dir / "checkpoints"))

    monkeypatch.setattr(service.supervisor.shutil, "rmtree", busy)
    try:
        client = TestClient(app, base_url="http://127.0.0.1")
        r = client.delete("/v1/runs/stuck", params={"files": "true"}, headers={"Authorization": "Bearer x"})
        assert r.status_code == 500 and r.json() == {"detail": (
            "DELETE could not remove runs/stuck/checkpoints (Device or resource busy); the run is kept: DELETE again "
            "once it can go, or without files=true")}
        assert svc.registry.get("stuck").state == "failed" and run_dir.is_dir()
        monkeypatch.undo()
        r = client.delete("/v1/runs/stuck", params={"files": "true"}, headers={"Authorization": "Bearer x"})
        assert r.status_code == 200 and r.json() == {"id": "stuck", "files_removed": True}
        assert svc.registry.get("stuck") is None and not run_dir.exists()
    finally:
        svc.trainer_check.close()
        svc.registry.close()
        svc.state_lock.close()
