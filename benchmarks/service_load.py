"""Latency of the control service's list and status endpoints under concurrent clients.

    python -m benchmarks.service_load [--runs 50] [--steps 2000] [--clients 50] [--requests 500]

Starts `python -m service` on loopback over a fresh state directory, with the
test suite's fake trainer (tests/service/fake_trainer.py: the run-directory
contract in milliseconds), and fills it with `--runs` finished runs of
`--steps` logged updates each (metrics.jsonl, events.jsonl, checkpoints), then
restarts it (the service re-adopts its state) with trainings that log every
0.1 s and adds one such run, left running through the measurement. `--clients` concurrent clients then send `--requests`
requests in all, alternating GET /v1/runs (every run) and GET /v1/runs/{id}
(a run picked in turn), after one warm-up pass. Prints p50 / p90 / p99 / max
per endpoint in milliseconds, and the host's CPU count: clients and service
share the machine, as they did in the measurement this answers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
TOKEN = "benchmark-token-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(state: Path, port: int, step_seconds: float, service_path: Path | None) -> subprocess.Popen:
    paths = [str(service_path)] if service_path else []
    env = {**os.environ, "K3_SERVICE_TOKEN": TOKEN, "FAKE_TRAINER_STEP_SECONDS": str(step_seconds),
           "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "tests" / "service"), str(REPO)])}
    log = open(state.parent / "service.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port),
                             "--state-dir", str(state), "--gpus", "0", "--max-running", "4",
                             "--launcher", "python", "--trainer-module", "fake_trainer"],
                            cwd=service_path or REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"toml": '[model]\nflavor = "debug"\n[metrics]\nlog_freq = 1\n[checkpoint]\nenable = true\n'}


def fill(client: httpx.Client, runs: int, steps: int) -> list[str]:
    """`runs` finished runs of `steps` logged updates; returns their ids."""
    body = {"toml": BODY["toml"] + f"interval = {max(1, steps // 4)}\n", "overrides": {"training.steps": steps}}
    ids = []
    for i in range(runs):
        r = client.post("/v1/runs", json={**body, "name": f"load-{i:03d}"}, headers=AUTH)
        r.raise_for_status()
        ids.append(r.json()["id"])
    wait_for(lambda: all(r["state"] == "finished" for r in client.get("/v1/runs").json()), 900, "the runs to finish")
    return ids


def add_live(client: httpx.Client) -> str:
    r = client.post("/v1/runs", json={**BODY, "name": "load-live", "overrides": {"training.steps": 10**9}},
                    headers=AUTH)
    r.raise_for_status()
    wait_for(lambda: client.get("/v1/runs/load-live").json()["state"] == "running", 60, "the live run")
    return "load-live"


async def load(url: str, ids: list[str], clients: int, requests: int) -> dict[str, list]:
    """Milliseconds per request, by endpoint, over `requests` requests from `clients` concurrent clients.

    Each client is one keep-alive HTTP/1.1 connection on asyncio streams: a few microseconds of client work per
    request, so the clients (on the same 2 cores) take little from the service they measure.
    """
    latencies: dict[str, list] = {"list": [], "status": [], "errors": []}
    todo = iter(range(requests))
    host, port = url.removeprefix("http://").split(":")

    async def client_loop() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            for i in todo:
                kind = "list" if i % 2 == 0 else "status"
                path = "/v1/runs" if kind == "list" else f"/v1/runs/{ids[i // 2 % len(ids)]}"
                t0 = time.perf_counter()
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
                    await reader.readexactly(length)
                except (OSError, asyncio.IncompleteReadError) as e:  # counted and reported, not retried
                    latencies["errors"].append(f"{path}: {type(e).__name__}")
                    return
                latencies[kind].append((time.perf_counter() - t0) * 1e3)
                status = int(head.split(b" ", 2)[1])
                if status != 200:
                    latencies["errors"].append(f"{path}: HTTP {status}")
        finally:
            writer.close()

    await asyncio.gather(*(client_loop() for _ in range(clients)))
    return latencies


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--keep", type=Path, default=None, help="leave the state directory here (for profiling)")
    p.add_argument("--service-path", type=Path, default=None,
                   help="folder holding another `service` package to measure, e.g. an older commit's "
                        "(git archive COMMIT service | tar -x -C FOLDER)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="k3-service-load-") as tmp:
        state, port = (a.keep or Path(tmp)) / "state", free_port()
        state.mkdir(parents=True)
        url = f"http://127.0.0.1:{port}"
        proc = start_service(state, port, 0, a.service_path)
        try:
            with httpx.Client(base_url=url, timeout=60) as client:
                wait_for(lambda: _up(client), 60, "the service")
                t0 = time.perf_counter()
                ids = fill(client, a.runs, a.steps)
                print(f"filled {len(ids)} runs x {a.steps} logged updates in {time.perf_counter() - t0:.0f} s")
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
            proc = start_service(state, port, 0.1, a.service_path)
            with httpx.Client(base_url=url, timeout=60) as client:
                wait_for(lambda: _up(client), 60, "the service")
                ids.append(add_live(client))
            asyncio.run(load(url, ids, a.clients, a.clients * 2))  # warm-up: every run's files read once
            service, me = psutil.Process(proc.pid), psutil.Process()
            cpu0, mine0, t0 = sum(service.cpu_times()[:2]), sum(me.cpu_times()[:2]), time.perf_counter()
            lat = asyncio.run(load(url, ids, a.clients, a.requests))
            cpu, wall = sum(service.cpu_times()[:2]) - cpu0, time.perf_counter() - t0
            client_cpu = sum(me.cpu_times()[:2]) - mine0
        finally:
            stop_live(url)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    print(f"host: {platform.node()} ({os.cpu_count()} CPUs, {len(os.sched_getaffinity(0))} usable, load average "
          f"{os.getloadavg()[0]:.1f}), {a.clients} clients, {a.requests} requests, {len(ids)} runs of {a.steps} "
          f"logged updates")
    print(f"service CPU: {cpu:.2f} s over {wall:.2f} s wall, {1e3 * cpu / a.requests:.2f} ms per request; "
          f"clients' CPU: {client_cpu:.2f} s")
    print("| endpoint | requests | p50 ms | p90 ms | p99 ms | max ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    errors = lat.pop("errors")
    print(f"transport errors: {len(errors)}" + (f" ({', '.join(sorted(set(errors))[:5])})" if errors else ""))
    for kind, values in lat.items():
        name = "GET /v1/runs (list)" if kind == "list" else "GET /v1/runs/{id} (status)"
        print(f"| {name} | {len(values)} | {percentile(values, 50):.0f} | {percentile(values, 90):.0f} | "
              f"{percentile(values, 99):.0f} | {max(values):.0f} |")


def stop_live(url: str) -> None:
    """Stop the run left running (trainings outlive the service by design)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/runs/load-live/stop", headers={"Authorization": f"Bearer {TOKEN}"})
        if r.status_code == 202:
            wait_for(lambda: client.get("/v1/runs/load-live").json()["state"] == "stopped", 60, "the live run to stop")


def _up(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


if __name__ == "__main__":
    main()
