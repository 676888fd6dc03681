"""Test harness: a real `python -m service` (uvicorn) on loopback, over a temporary state dir.

`ServiceProc` starts the service as a subprocess so tests can kill and restart
it (re-adoption); on teardown every training it launched is killed by pid and
process start time, so no test leaves processes behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from ports import free_port

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKEN = "test-token-0123456789"
DEBUG_OVERRIDES = {"model.flavor": "debug", "training.steps": 6, "training.seq_len": 64}


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class ServiceProc:
    """One `python -m service` process; restartable over the same state dir."""

    def __init__(self, state_dir: Path, *, fake: bool, gpus: int = 0, max_running: int | None = 0,
                 grace_seconds: float = 120.0, step_seconds: float = 0.2, extra_env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None):
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # max_running 0: no limit (tests run several fake trainings at once); None: the service's default
        # (one run per GPU, one at a time without GPUs).
        self.args = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(self.port),
                     "--state-dir", str(state_dir), "--gpus", str(gpus), "--grace-seconds", str(grace_seconds),
                     *(["--max-running", str(max_running)] if max_running is not None else []), *(extra_args or [])]
        self.env = {**os.environ, "K3_SERVICE_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1",
                    "FAKE_TRAINER_STEP_SECONDS": str(step_seconds), "OMP_NUM_THREADS": "1",
                    **(extra_env or {})}
        if fake:
            self.args += ["--launcher", "python", "--trainer-module", "fake_trainer"]
            self.env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), self.env.get("PYTHONPATH", "")])
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30)
        self.auth = {"Authorization": f"Bearer {TOKEN}"}

    def start(self) -> "ServiceProc":
        log = open(self.state_dir.parent / f"service-{self.port}-{time.monotonic_ns()}.log", "wb")
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.log_path = Path(log.name)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"service exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                return self.client.get("/healthz").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 120, "the service to answer /healthz")  # minutes on a loaded 2-core CI host
        return self

    def kill(self) -> None:
        """SIGKILL the service alone (its trainings live on in their own sessions)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def create(self, **body) -> httpx.Response:
        return self.client.post("/v1/runs", json=body, headers=self.auth)

    def run(self, run_id: str) -> dict:
        r = self.client.get(f"/v1/runs/{run_id}", headers=self.auth)  # reads may need the token too
        assert r.status_code == 200, r.text
        return r.json()

    def wait_state(self, run_id: str, states: tuple[str, ...], timeout: float = 60) -> dict:
        def check():
            run = self.run(run_id)
            return run if run["state"] in states else None

        try:
            return wait_until(check, timeout, f"run {run_id} to reach {states}", interval=0.2)
        except AssertionError:
            logs = self.client.get(f"/v1/runs/{run_id}/logs", params={"tail": 60}, headers=self.auth).text
            raise AssertionError(f"run {run_id} is {self.run(run_id)['state']}, wanted {states}; logs:\n{logs}") from None

    def metrics_text(self) -> str:
        return self.client.get("/metrics").text

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.client.close()
        kill_recorded_attempts(self.state_dir)


def kill_recorded_attempts(state_dir: Path) -> None:
    """Kill every attempt the registry knows of (matching pid and start time) and its descendants."""
    db = state_dir / "registry.sqlite3"
    if not db.exists():
        return
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT pid, pid_start_time FROM attempts WHERE ended_at IS NULL").fetchall()
    for pid, start in rows:
        with contextlib.suppress(psutil.Error):  # already gone
            p = psutil.Process(pid)
            if abs(p.create_time() - start) > 0.05:
                continue
            for child in p.children(recursive=True) + [p]:
                child.kill()


def pid_check(argv: list[str], toml_text: str) -> None:
    """A stand-in for the trainer's configuration check (`TrainerCheck(check=...)`): writes the checker process's
    pid to the file named by toml_text and accepts the run."""
    Path(toml_text).write_text(str(os.getpid()))


def hang_check(argv: list[str], toml_text: str) -> None:
    """A configuration check that never returns (after writing its pid, as `pid_check`)."""
    pid_check(argv, toml_text)
    time.sleep(3600)


def gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` has exited (or is a zombie no one reaped) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False
