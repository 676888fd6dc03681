"""A supervisor pass holds the registry's lock throughout (a write it makes may wait 30 s for SQLite's): the requests
that read the registry wait for it, in worker threads, and nothing else does. They waited on the event loop, which
paused every request and every log stream with them.

The lock is held here from another thread, as a slow pass holds it; requests go through the ASGI app in this test's
event loop (no lifespan: no supervisor thread). /healthz and /metrics do not wait for it: they answer from the
registry's last committed write, in worker threads of their own, and /healthz names a pass that has run too long.
List and get answer on the event loop, without a worker thread, when the lock is free and their views are cached.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
from anyio import to_thread
from fastapi.testclient import TestClient

import service.app
from service.app import _follow, create_app
from service.registry import Attempt, Registry
from service.settings import Settings
from service_harness import wait_until

PASS_S = 3.0
"""How long the slow pass holds the registry's lock."""
ANSWER_S = 1.0
"""What a request that does not read the registry may take meanwhile (a loaded 2-core host included)."""


@pytest.fixture
def app(tmp_path):
    a = create_app(Settings(state_dir=tmp_path / "state", token="x", gpus=0))
    yield a
    svc = a.state.service
    svc.trainer_check.close()
    svc.registry.close()
    svc.state_lock.close()


def add_run(svc, run_id: str, state: str) -> Path:
    """A run in `state` whose one attempt logged a line; its log's path."""
    log = svc.settings.runs_dir / run_id / "service" / "attempt-1.log"
    log.parent.mkdir(parents=True)
    log.write_text("step 1\n")
    svc.registry.insert_run(run_id, "inline", {}, 1, 0, 0)
    svc.registry.add_attempt(Attempt(run_id, 1, 1, 0.0, time.time(), None, None, [], str(log), str(log) + ".exit"))
    svc.registry.update_run(run_id, state=state, message=state)
    return log


def slow_pass(registry: Registry) -> threading.Thread:
    """A thread that holds the registry's lock for PASS_S seconds, started and holding it."""
    taken = threading.Event()

    def hold() -> None:
        with registry.lock:
            taken.set()
            time.sleep(PASS_S)

    thread = threading.Thread(target=hold, name="slow-pass", daemon=True)
    thread.start()
    assert taken.wait(10)
    return thread


async def answer_time(client: httpx.AsyncClient, since: float) -> float:
    """Seconds from `since` until the web page, which reads no registry, is answered."""
    page = await client.get("/")
    assert page.status_code == 200
    return time.monotonic() - since


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=60)


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/r", "/v1/runs/r/logs/stream"],
                         ids=["list", "get", "stream-open"])
def test_a_request_waiting_for_the_registry_lock_pauses_no_other(app, path):
    add_run(app.state.service, "r", "finished")

    async def scenario() -> tuple[float, bool, httpx.Response]:
        async with client_of(app) as client:
            held = slow_pass(app.state.service.registry)
            since = time.monotonic()
            waiting = asyncio.ensure_future(client.get(path))
            await asyncio.sleep(0.2)  # it is at the registry's lock
            answered = await answer_time(client, since)
            waited = not waiting.done()
            reply = await waiting
            await asyncio.to_thread(held.join)
            return answered, waited, reply

    answered, waited, reply = asyncio.run(scenario())
    assert answered < ANSWER_S, f"the page took {answered:.1f} s while {path} waited for the registry's lock"
    assert waited, f"{path} did not wait for the lock (the test shows nothing)"
    assert reply.status_code == 200 and '"finished"' in reply.text, reply.text  # answered once the lock is free


def test_a_log_stream_following_a_run_pauses_nothing_while_the_registry_lock_is_held(app):
    svc = app.state.service
    log = add_run(svc, "s", "running")

    async def scenario() -> tuple[float, list[bytes]]:
        chunks: list[bytes] = []

        async def follow() -> None:
            async for chunk in _follow(svc, svc.registry.get("s"), 0):
                chunks.append(chunk)

        stream = asyncio.ensure_future(follow())
        await asyncio.sleep(0.5)  # past its opening: it reads the registry every 0.25 s
        async with client_of(app) as client:
            held = slow_pass(svc.registry)
            answered = await answer_time(client, time.monotonic())
        await asyncio.to_thread(held.join)
        log.open("a").write("step 2\n")
        await asyncio.to_thread(svc.registry.update_run, "s", state="finished", message="finished")
        await asyncio.wait_for(stream, 10)
        return answered, chunks

    answered, chunks = asyncio.run(scenario())
    assert answered < ANSWER_S, f"the page took {answered:.1f} s while a log stream waited for the registry's lock"
    assert chunks[0] == b"data: step 2\n\n" and chunks[-1].startswith(b"event: end\n"), chunks


def test_list_and_get_of_cached_views_answer_without_a_worker_thread(tmp_path):
    """With the registry's lock free and the views cached, list and get answer on the event loop, the bytes the thread
    pool answers: every worker thread of the shared pool is taken here (as by slow file reads), and they still answer.
    Reads need the token (--read-auth on): its check took a worker thread too."""
    app = create_app(Settings(state_dir=tmp_path / "state", token="x", gpus=0, read_auth="on"))
    svc = app.state.service
    add_run(svc, "r", "finished")
    auth = {"Authorization": "Bearer x"}

    async def scenario() -> tuple[dict[str, bytes], dict[str, bytes]]:
        async with client_of(app) as client:
            paths = ("/v1/runs", "/v1/runs/r", "/v1/runs?state=finished")
            first = {p: (await client.get(p, headers=auth)).content for p in paths}  # views built, in the pool
            release = threading.Event()
            limiter = to_thread.current_default_thread_limiter()
            busy = [asyncio.ensure_future(to_thread.run_sync(release.wait)) for _ in range(int(limiter.total_tokens))]
            await asyncio.sleep(0.2)  # every worker thread waits
            try:
                again = {p: (await asyncio.wait_for(client.get(p, headers=auth), ANSWER_S)).content for p in paths}
            finally:
                release.set()
                await asyncio.gather(*busy)
            return first, again

    try:
        first, again = asyncio.run(scenario())
    finally:
        svc.trainer_check.close()
        svc.registry.close()
        svc.state_lock.close()
    assert again == first and b'"finished"' in first["/v1/runs/r"], (first, again)


class HeldLock:
    """The registry's lock held from another thread, as a slow supervisor pass holds it: `write()` runs `writes` there
    (still holding it), `release()` lets it go. Each step goes on by itself after HOLD_S (a probe waiting for the lock
    could not ask it to)."""

    HOLD_S = 3.0

    def __init__(self, registry: Registry, writes):
        self.go_write, self.written, self.go_release = threading.Event(), threading.Event(), threading.Event()
        taken = threading.Event()

        def hold() -> None:
            with registry.lock:
                taken.set()
                self.go_write.wait(self.HOLD_S)
                writes()
                self.written.set()
                self.go_release.wait(self.HOLD_S)

        self.thread = threading.Thread(target=hold, name="slow-pass", daemon=True)
        self.thread.start()
        assert taken.wait(10)

    def write(self) -> None:
        self.go_write.set()
        assert self.written.wait(10)

    def release(self) -> None:
        self.go_release.set()
        self.thread.join(10)


def timed(client: TestClient, path: str) -> tuple[float, httpx.Response]:
    since = time.monotonic()
    reply = client.get(path)
    assert reply.status_code == 200, reply.text
    return time.monotonic() - since, reply


def test_healthz_and_metrics_answer_from_the_last_committed_write_while_a_pass_holds_the_lock(app):
    svc = app.state.service
    add_run(svc, "r", "running")
    svc.registry.update_run("r", restarts=1, restarts_total=1)
    client = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: no supervisor thread

    def writes() -> None:  # what a pass commits while it holds the lock: a relaunch's set-aside, a new run queued
        svc.registry.update_run("r", restarts=2, restarts_total=2)
        svc.registry.carry("r", 1, {"checkpoint": 3}, {"loss.finite": 1})
        svc.files.forget("r")
        svc.registry.insert_run("q", "inline", {}, 1, 0, 0)

    def answers() -> tuple[dict, str]:
        (health_s, health), (metrics_s, metrics) = timed(client, "/healthz"), timed(client, "/metrics")
        assert health_s < ANSWER_S and metrics_s < ANSWER_S, f"{health_s:.1f} s, {metrics_s:.1f} s"
        return health.json(), metrics.text

    held = HeldLock(svc.registry, writes)
    try:
        health, metrics = answers()
        assert health["status"] == "ok" and health["runs"] == 1, health
        assert "titan_k3_service_restarts_total 1.0" in metrics and "titan_k3_service_queue_length 0.0" in metrics
        held.write()  # committed while the lock is still held: the answers show it
        health, metrics = answers()
        assert health["runs"] == 2, health
        new = ("titan_k3_service_restarts_total 2.0", "titan_k3_service_queue_length 1.0",
               'titan_k3_run_events_total{kind="checkpoint",run="r"} 3.0',
               'titan_k3_run_invariant_violations_total{check="loss.finite",run="r"} 1.0')
        assert all(line in metrics for line in new), metrics
    finally:
        held.release()
    health, metrics = answers()
    assert health["runs"] == 2 and all(line in metrics for line in new), metrics
    assert [r["id"] for r in client.get("/v1/runs").json()] == ["r", "q"]


def test_healthz_and_metrics_keep_threads_of_their_own_while_requests_wait_for_the_lock(app):
    """Requests waiting for the registry's lock take a worker thread each: past the pool's 40, a probe or a scrape
    that needed one waited for the pass too."""
    add_run(app.state.service, "r", "running")

    async def scenario() -> tuple[float, float, list[httpx.Response]]:
        async with client_of(app) as client:
            held = slow_pass(app.state.service.registry)
            waiting = [asyncio.ensure_future(client.get("/v1/runs/r")) for _ in range(48)]
            await asyncio.sleep(0.5)  # they hold every worker thread of the shared pool
            since = time.monotonic()
            health = await client.get("/healthz")
            health_s = time.monotonic() - since
            scrape = await client.get("/metrics")
            metrics_s = time.monotonic() - since - health_s
            assert health.json()["runs"] == 1 and 'titan_k3_service_runs{state="running"} 1.0' in scrape.text
            replies = await asyncio.gather(*waiting)
            await asyncio.to_thread(held.join)
            return health_s, metrics_s, replies

    health_s, metrics_s, replies = asyncio.run(scenario())
    assert health_s < ANSWER_S and metrics_s < ANSWER_S, f"/healthz {health_s:.1f} s, /metrics {metrics_s:.1f} s"
    assert all(r.status_code == 200 for r in replies)


def test_healthz_names_a_supervisor_pass_stuck_on_the_lock(app, monkeypatch):
    monkeypatch.setattr(service.app, "STUCK_PASS_S", 1.0)
    svc = app.state.service
    client = TestClient(app, base_url="http://127.0.0.1")
    svc.supervisor.start()  # the watcher, a pass every 0.25 s
    try:
        assert wait_until(lambda: client.get("/healthz").json()["seconds_since_pass"] is not None, 10, "a pass")
        held = slow_pass(svc.registry)  # the next pass waits for the lock
        health = wait_until(lambda: (h := client.get("/healthz").json())["status"] == "degraded" and h, PASS_S,
                            "/healthz to name the stuck pass", interval=0.2)
        assert health["seconds_since_pass"] >= 1.0, health
        assert health["problems"] == [f"no supervisor pass has ended for {health['seconds_since_pass']:.0f} s (one is "
                                      "most likely waiting for the registry's lock): runs are neither watched nor "
                                      "started meanwhile"], health
        held.join()
        health = wait_until(lambda: (h := client.get("/healthz").json())["status"] == "ok" and h, 10, "a pass")
        assert health["problems"] == [] and health["seconds_since_pass"] < 1.0, health
    finally:
        svc.supervisor.shutdown()
