"""A supervisor pass holds the registry's lock throughout (a write it makes may wait 30 s for SQLite's): the requests
that read the registry wait for it, in worker threads, and nothing else does. They waited on the event loop, which
paused every request and every log stream with them.

The lock is held here from another thread, as a slow pass holds it; requests go through the ASGI app in this test's
event loop (no lifespan: no supervisor thread).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.app import _follow, create_app
from service.registry import Attempt, Registry
from service.settings import Settings

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
