"""Console logs over REST and SSE: what a huge line costs (it is cut, and the cut is named), and what a stream shows of
the lines written while it opens (each once)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import _follow, create_app
from service.registry import Attempt
from service.rundir import read_tail
from service.settings import Settings, parse_args

HUGE = 20 << 20  # one line of 20 MiB, no newline in it (a progress bar redrawn with '\r' for hours reads the same)


@pytest.fixture
def app(tmp_path):
    apps = []

    def make(**settings):
        a = create_app(Settings(state_dir=tmp_path / "state", token="x", gpus=0, **settings))  # no supervisor thread
        apps.append(a)
        return a

    yield make
    for a in apps:
        svc = a.state.service
        svc.trainer_check.close()
        svc.registry.close()
        svc.state_lock.close()


def add_run(svc, run_id: str, text: bytes, state: str = "finished") -> Path:
    """A run whose one attempt logged `text`; its log's path."""
    log = svc.settings.runs_dir / run_id / "service" / "attempt-1.log"
    log.parent.mkdir(parents=True)
    log.write_bytes(text)
    svc.registry.insert_run(run_id, "inline", {}, 1, 0, 0)
    svc.registry.add_attempt(Attempt(run_id, 1, 1, 0.0, time.time(), time.time(), 0, [], str(log), str(log) + ".exit"))
    svc.registry.update_run(run_id, state=state, message=state)
    return log


def stream(svc, run_id: str, tail: int) -> list[tuple[str | None, str]]:
    """The events of a log stream of the run, as (kind, data), until it ends."""
    async def collect() -> list[bytes]:
        return [chunk async for chunk in _follow(svc, svc.registry.get(run_id), tail)]

    out = []
    for chunk in asyncio.run(collect()):
        kind = None
        data = []
        for line in chunk.decode().split("\n"):
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
            else:
                assert line == "" and "\r" not in chunk.decode(), chunk  # no field but event and data: SSE framing
        out.append((kind, "\n".join(data)))
    return out


def write_during_the_tail_read(monkeypatch, svc, log: Path, text: bytes, before: bool = False) -> None:
    """Append `text` to the log as the stream's opening tail is read: after the read (the race a stream lost), or
    `before` it."""
    real = svc.log_lines

    def racing(*args, **kwargs):
        if before:
            with open(log, "ab") as f:
                f.write(text)
        lines = real(*args, **kwargs)
        if not before:
            with open(log, "ab") as f:
                f.write(text)
        return lines

    monkeypatch.setattr(svc, "log_lines", racing)


@pytest.mark.parametrize("before", [False, True], ids=["after-the-read", "before-the-read"])
def test_a_stream_shows_lines_written_while_it_opens_once(app, monkeypatch, before):
    svc = app().state.service
    log = add_run(svc, "r", b"one\ntwo\n")
    write_during_the_tail_read(monkeypatch, svc, log, b"three\nfour\n", before=before)
    events = stream(svc, "r", tail=10)
    assert [d for k, d in events if k is None] == ["=== attempt 1 ===", "one", "two", "three", "four"]
    assert events[-1] == ("end", json.dumps({"state": "finished", "message": "finished"}))


def test_the_logs_endpoint_cuts_a_huge_line_and_says_so(app):
    a = app(log_line_bytes=1000, log_read_bytes=64 << 20)
    svc = a.state.service
    add_run(svc, "big", b"before\n" + b"#" * (HUGE - 3) + b"end\nafter\n")
    client = TestClient(a, base_url="http://127.0.0.1")
    tracemalloc.start()
    try:
        r = client.get("/v1/runs/big/logs", params={"tail": 5})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.status_code == 200
    lines = r.text.splitlines()
    assert lines == ["=== attempt 1 ===", "before", f"[line cut: its first {HUGE - 1000} bytes not shown] "
                     + "#" * 997 + "end", "after"]
    assert peak < 8 << 20, f"{peak} bytes held to answer"

    svc.settings.log_read_bytes = 1 << 20  # a request reads at most this much: the line's start is out of reach
    lines = client.get("/v1/runs/big/logs", params={"tail": 5}).text.splitlines()
    assert lines == ["[log cut: at most 1048576 bytes are read per request; earlier output not shown]",
                     "[line cut: its earlier bytes not shown] " + "#" * 997 + "end", "after"]


def test_a_stream_cuts_a_huge_line_and_keeps_progress_redraws_apart(app, monkeypatch):
    svc = app(log_line_bytes=1000).state.service
    log = add_run(svc, "s", b"start\n")
    write_during_the_tail_read(monkeypatch, svc, log, b"x" * (HUGE - 3) + b"end\n10%\r50%\r100%\ndone")
    tracemalloc.start()
    try:
        events = stream(svc, "s", tail=10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d for k, d in events if k is None] == [
        "=== attempt 1 ===", "start", f"[line cut: its first {HUGE - 1000} bytes not shown] " + "x" * 997 + "end", "10%", "50%", "100%", "done"]
    assert peak < 8 << 20, f"{peak} bytes held to stream"


def test_a_huge_line_costs_a_tail_read_what_it_keeps(tmp_path):
    log = tmp_path / "attempt-1.log"
    log.write_bytes(b"a\n" + b"z" * HUGE + b"\nb\n")
    tracemalloc.start()
    try:
        lines, read, stopped = read_tail(log, 200)  # the supervisor's read of how an attempt ended
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines == ["[line cut: its earlier bytes not shown] " + "z" * (64 << 10), "b"]
    assert read == 8 << 20 and stopped and peak < 4 << 20
    lines, read, stopped = read_tail(log, 200, max_bytes=HUGE + 5)
    assert lines == ["a", f"[line cut: its first {HUGE - (64 << 10)} bytes not shown] " + "z" * (64 << 10), "b"]
    assert read == HUGE + 4 and not stopped  # all but the final newline


def test_the_log_caps_are_flags():
    s = parse_args(["--gpus", "0", "--log-line-bytes", "1000", "--log-read-bytes", "4096"])
    assert (s.log_line_bytes, s.log_read_bytes) == (1000, 4096)
    with pytest.raises(ValueError, match="log_line_bytes 0"):
        Settings(token="x", gpus=0, log_line_bytes=0)



def test_a_stopping_service_ends_its_log_streams(make_service):
    """SIGTERM to the service (a deploy, a restart) with a stream open: the stream ends with a comment to reconnect,
    and the service exits (it waited for the streams, that is for their runs, to end)."""
    svc = make_service(fake=True, step_seconds=0.2)
    body = {"toml": '[model]\nflavor = "debug"\n[training]\nsteps = 500\nseq_len = 64\n', "name": "long"}
    assert svc.create(**body).status_code == 201
    svc.wait_state("long", ("running",))
    got: list[str] = []
    ready = threading.Event()

    def follow() -> None:
        with contextlib.suppress(httpx.HTTPError), httpx.stream("GET", f"{svc.url}/v1/runs/long/logs/stream",
                                                                timeout=30) as r:
            ready.set()
            got.extend(r.iter_lines())

    reader = threading.Thread(target=follow)
    reader.start()
    assert ready.wait(30)
    svc.proc.send_signal(signal.SIGTERM)
    svc.proc.wait(timeout=8)
    reader.join(10)
    assert ": the service is stopping; reconnect to follow the run" in got
