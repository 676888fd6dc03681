"""The FastAPI application: REST over the registry and the supervisor, /metrics, the web page."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import sqlite3
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Literal

from anyio import to_thread
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware

from service import errors, names
from service.exporter import TRAINER_KEYS, is_trainer_key
from service.limits import BodySizeLimit, MethodNotAllowed
from service.operations import Service, registry_unavailable, unprocessable
from service.registry import ACTIVE, STATES, TERMINAL, Run
from service.rundir import LineCap
from service.schemas import Deleted, ErrorOut, Health, QUERY_BOOL, QUERY_INT, RunCreate, RunOut
from service.settings import Settings
from service.supervisor import STUCK_PASS_S, FilesKept

log = logging.getLogger("service")
RunId = Annotated[str, PathParam(pattern=names.RUN_ID_PATTERN, max_length=names.RUN_ID_MAX,
                                 description="Run id: letters, digits, '_', '-', '.', no '..'.")]
STATIC = Path(__file__).resolve().parent / "static"
AUTH = {401: {"model": ErrorOut, "description": "missing or wrong bearer token"}}
NOT_FOUND = {404: {"model": ErrorOut, "description": "no such run"}}
CONFLICT = {409: {"model": ErrorOut, "description": "the run's state does not allow it (the message says why)"}}


def as_json(responses: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Error responses documented as JSON on a route whose success is another media type (text, events)."""
    return {code: {"description": r["description"],
                   "content": {"application/json": {"schema": r["model"].model_json_schema()}}}
            for code, r in responses.items()}


def create_app(settings: Settings) -> FastAPI:
    svc = Service(settings)
    bearer = HTTPBearer(auto_error=False, description="Token from $K3_SERVICE_TOKEN, --token-file or <state-dir>/token")

    async def require_token(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        # NOTE: async (a comparison, no wait): a plain `def` dependency took a worker thread for every request
        ok = cred is not None and cred.scheme.lower() == "bearer" and hmac.compare_digest(
            cred.credentials.encode(), svc.token.encode())
        if not ok:
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    # NOTE: reads of runs (logs, configs, metrics history) need the token when the service is exposed beyond
    # loopback (--read-auth auto); /metrics, /v1/prometheus/targets and /healthz stay open for scrapers and probes.
    reads_closed = settings.read_auth == "on"
    read = [Depends(require_token)] if reads_closed else []
    read_auth = AUTH if reads_closed else {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        svc.supervisor.start()
        yield
        svc.supervisor.shutdown()
        svc.trainer_check.close()
        svc.registry.close()
        svc.state_lock.close()

    app = FastAPI(title="titan_k3 control service", version="0.2.0", lifespan=lifespan,
                  description="Start, watch and stop titan_k3 trainings (torchrun children) over REST.",
                  dependencies=[Depends(errors.reject_unknown_query)])
    app.state.service = svc
    errors.install(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(MethodNotAllowed)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.allowed_hosts)

    @app.post("/v1/runs", status_code=201, response_model=RunOut, dependencies=[Depends(require_token)],
              responses={**AUTH, 400: {"model": ErrorOut, "description": "body is not valid JSON"},
                         415: {"model": ErrorOut, "description": "body not sent as application/json"},
                         409: {"model": ErrorOut, "description": "name taken"},
                         507: {"model": ErrorOut, "description": "the run directory cannot be created or the registry "
                                                                 "cannot record the run (disk full)"},
                         503: {"model": ErrorOut, "description": "the registry stayed locked (retry)"},
                         413: {"model": ErrorOut, "description": "body too large"},
                         422: {"description": "refused: bad config, or more than this host or the trainer allows "
                                              "(the trainer's own one-line message in detail[0].msg)"}})
    def create_run(req: RunCreate) -> RunOut:
        return svc.out(svc.create(req))

    # NOTE: every handler that reads the registry or a run's files is a plain `def` (FastAPI runs it in its thread
    # pool) or hands that work to the pool: registry reads take the registry's lock, which a supervisor pass holds
    # throughout (a write it makes waits up to 3 x 10 s for SQLite's lock), and on the event loop one such wait
    # paused every request and every log stream. List and get answer on the event loop only when that costs no wait
    # and no file read (the lock free, every view cached): the same answer, without the hop to a worker thread
    # (0.06-0.24 ms of service CPU a request on a 2-core VM: benchmarks/results/service_load.md).
    @app.get("/v1/runs", response_model=list[RunOut], dependencies=read, responses=read_auth)
    async def list_runs(state: list[Literal[STATES]] | None = Query(
            None, description="only runs in these states (repeat the parameter for several)")) -> Response:
        states = tuple(state) if state else None
        body = svc.cached_list_body(states)
        if body is None:
            body = await run_in_threadpool(svc.list_body, states)
        return Response(body, media_type="application/json")

    @app.get("/v1/runs/{run_id}", response_model=RunOut, dependencies=read, responses={**read_auth, **NOT_FOUND})
    async def get_run(run_id: RunId) -> Response:
        body = svc.cached_run_body(run_id)
        if body is None:
            body = await run_in_threadpool(lambda: svc.view(svc.get(run_id)))
        return Response(body, media_type="application/json")

    @app.delete("/v1/runs/{run_id}", response_model=Deleted, dependencies=[Depends(require_token)],
                responses={**AUTH, **NOT_FOUND, 500: {"model": ErrorOut, "description": "files=true: the run directory "
                                                      "could not be removed; the run is kept (the message says why)"}})
    def delete_run(run_id: RunId,
                   files: Annotated[bool, Query(description="also remove the run directory"), QUERY_BOOL] = False
                   ) -> Deleted:
        """Forget a run (its series leave /metrics); an active one is killed first, without a stop checkpoint
        (POST stop first to keep one); `files=true` also removes its run directory."""
        svc.get(run_id)
        try:
            svc.supervisor.delete(run_id, remove_files=files)
        except KeyError:  # deleted by a concurrent request
            raise HTTPException(404, f"no run {run_id!r}") from None
        except FilesKept as e:
            raise HTTPException(500, str(e)) from None
        except sqlite3.Error as e:
            raise registry_unavailable(e, f"DELETE of run {run_id!r} not recorded") from None
        svc.forget(run_id)
        return Deleted(id=run_id, files_removed=files)

    @app.post("/v1/runs/{run_id}/stop", status_code=202, response_model=RunOut,
              dependencies=[Depends(require_token)], responses={**AUTH, **NOT_FOUND, **CONFLICT})
    def stop_run(run_id: RunId) -> RunOut:
        return svc.transition(run_id, svc.supervisor.stop)

    @app.post("/v1/runs/{run_id}/resume", status_code=202, response_model=RunOut,
              dependencies=[Depends(require_token)], responses={**AUTH, **NOT_FOUND, **CONFLICT})
    def resume_run(run_id: RunId) -> RunOut:
        return svc.transition(run_id, svc.supervisor.resume)

    @app.get("/v1/runs/{run_id}/logs", response_class=PlainTextResponse, dependencies=read,
             responses=as_json({**read_auth, **NOT_FOUND}))
    def run_logs(run_id: RunId, tail: Annotated[int, Query(ge=1, le=10000), QUERY_INT] = 200) -> PlainTextResponse:
        lines = svc.log_lines(svc.get(run_id), tail)
        return PlainTextResponse("\n".join(lines) + ("\n" if lines else ""))

    @app.get("/v1/runs/{run_id}/logs/stream", dependencies=read,
             responses={200: {"content": {"text/event-stream": {}}}, **as_json({
                 **read_auth, **NOT_FOUND,
                 429: {"model": ErrorOut, "description": "too many open streams (--max-streams)"}})})
    async def stream_logs(run_id: RunId, tail: Annotated[int, Query(ge=0, le=10000), QUERY_INT] = 50
                          ) -> StreamingResponse:
        """Server-sent events: one `data:` line per log line, following attempts; `event: end` when the run ends."""
        run = await run_in_threadpool(svc.get, run_id)
        if svc.streams >= settings.max_streams:
            raise HTTPException(429, f"{svc.streams} log streams open (at most {settings.max_streams}); retry later",
                                headers={"Retry-After": "5"})
        return StreamingResponse(_counted(_StreamSlot(svc), _follow(svc, run, tail)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/v1/runs/{run_id}/metrics", dependencies=read, responses={**read_auth, **NOT_FOUND})
    def run_metrics(run_id: RunId, tail: Annotated[int, Query(ge=1, le=4000), QUERY_INT] = 1000,
                    keys: str | None = Query(None, max_length=2000,
                                             description="comma-separated metric keys (step is always included)")
                    ) -> JSONResponse:
        run = svc.get(run_id)
        files = svc.files.get(run.id)
        wanted = [k.strip() for k in keys.split(",") if k.strip()] if keys else None
        if wanted:
            recorded = files.recorded_keys()
            unknown = next((k for k in wanted if k not in recorded and not is_trainer_key(k)), None)
            if unknown is not None:
                have = (f"run {run.id!r} records {', '.join(sorted(recorded))}" if recorded else
                        f"run {run.id!r} has recorded none yet; the trainer writes {', '.join(TRAINER_KEYS)}")
                raise unprocessable(f"unknown metric key {unknown!r} in 'keys': {have}", "query", "keys")
        return JSONResponse(errors.finite(files.history(tail, wanted)))

    @app.get("/v1/recipes", response_model=list[str], dependencies=read, responses=read_auth)
    def list_recipes() -> list[str]:
        return svc.recipes()

    @app.get("/v1/prometheus/targets")
    def prometheus_targets() -> JSONResponse:
        """Prometheus HTTP service discovery: the rank-0 endpoint of every active run that opened one."""
        groups = [{"targets": [f"{settings.advertise_host}:{run.prometheus_port}"], "labels": {"run": run.id}}
                  for run in svc.registry.list(ACTIVE) if run.prometheus_port]
        return JSONResponse(groups)

    # NOTE: /metrics and /healthz read the registry's last committed write (`Registry.snapshot()`), never its lock: a
    # supervisor pass holds that throughout, up to 30 s on one write SQLite's lock holds up, and a scrape (10 s
    # timeout by default) or a liveness probe that waited for it failed, and an orchestrator may kill a healthy service.
    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        body = await to_thread.run_sync(generate_latest, svc.metrics, limiter=svc.probe_threads)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def health() -> Health:
        runs = svc.registry.snapshot().runs
        problems = [f"run {run_id}: {line}" for run_id, line in sorted(svc.supervisor.unsettled().items())]
        if svc.supervisor.pass_error:
            problems.insert(0, svc.supervisor.pass_error)
        since = svc.supervisor.since_pass()
        since = None if since is None else round(since, 1)
        if since is not None and since > STUCK_PASS_S:
            problems.insert(0, f"no supervisor pass has ended for {since:.0f} s (one is most likely waiting for the "
                               "registry's lock): runs are neither watched nor started meanwhile")
        return Health(status="degraded" if problems else "ok", runs=len(runs), gpus_total=settings.gpus,
                      gpus_used=sum(len(r.assigned_gpus) for r in runs if r.state in ACTIVE),
                      problems=svc.scrub(problems), seconds_since_pass=since)

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        return await to_thread.run_sync(health, limiter=svc.probe_threads)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    return app


class _StreamSlot:
    """One of `Service.streams`, taken now and given back once: when its stream ends, or when a stream that
    never started (the client left first) is collected."""

    def __init__(self, svc: Service):
        self.svc = svc
        self.held = True
        svc.streams += 1  # NOTE: handlers and stream generators all run on the event loop's one thread

    def release(self) -> None:
        if self.held:
            self.held = False
            self.svc.streams -= 1

    def __del__(self) -> None:
        self.release()


async def _counted(slot: _StreamSlot, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`stream`, giving its slot back however it ends (end of run, client gone, shutdown)."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        slot.release()


def _log_size(path: str) -> int:
    """The size of an attempt's log (0 while the attempt has not written it yet, or when there is no attempt)."""
    try:
        return os.stat(path).st_size if path else 0
    except FileNotFoundError:
        return 0


def _log_from(path: str, offset: int) -> bytes:
    """Up to 1 MiB of an attempt's log from `offset` (nothing while the attempt has not written it yet)."""
    with suppress(FileNotFoundError):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20)
    return b""


async def _follow(svc: Service, run: Run, tail: int) -> AsyncIterator[bytes]:
    """The run's log stream as SSE chunks. Its file and registry reads run in the thread pool: the event loop it
    shares with every request never waits on a disk or on the registry's lock."""
    def event(line: str, kind: str | None = None) -> bytes:
        head = f"event: {kind}\n" if kind else ""
        # NOTE: SSE ends a field at '\\r' as at '\\n': a progress bar's '\\r' would start a bogus field mid-line.
        return (head + "".join(f"data: {part}\n" for part in line.splitlines() or [""]) + "\n").encode()

    async def read(path: str, offset: int) -> bytes:
        return await run_in_threadpool(_log_from, path, offset) if path else b""

    partial = LineCap(svc.settings.log_line_bytes)

    def lines_of(data: bytes) -> list[str]:
        """The lines `data` completes (the first one with what came before it); what follows the last newline is kept
        for the next read, its oldest bytes past --log-line-bytes dropped (and named when the line is shown)."""
        nonlocal partial
        pieces = data.split(b"\n")
        done = []
        for piece in pieces[:-1]:
            partial.append(piece)
            done.extend(partial.text())
            partial = LineCap(svc.settings.log_line_bytes)
        partial.append(pieces[-1])
        return [svc.scrub(line) for line in done]

    # NOTE: the last attempt's log size first, its tail read up to it, the follow from it: what is written meanwhile
    # is shown once, by the follow (a size taken after the tail read skipped it).
    n = run.attempts[-1].n if run.attempts else 0
    path = run.attempts[-1].log_path if run.attempts else ""
    offset = await run_in_threadpool(_log_size, path)
    for line in await run_in_threadpool(svc.log_lines, run, tail, end=offset) if tail else []:
        yield event(line)

    def flush_partial() -> list[str]:
        nonlocal partial
        done = [svc.scrub(line) for line in partial.text()] if partial else []
        partial = LineCap(svc.settings.log_line_bytes)
        return done

    while True:
        if svc.closing():  # NOTE: a comment line (EventSource ignores it, and reconnects once the stream ends)
            yield b": the service is stopping; reconnect to follow the run\n\n"
            return
        current = await run_in_threadpool(svc.registry.get, run.id)
        if current is None:  # deleted meanwhile: end the stream as a run's end, not as a dropped connection
            yield event(json.dumps({"state": "deleted", "message": f"run {run.id!r} was deleted"}), "end")
            return
        if current.attempts and current.attempts[-1].n != n:
            # NOTE: what the ended attempt wrote since the last read (its last lines: why it ended) comes first.
            while data := await read(path, offset):
                offset += len(data)
                for line in lines_of(data):
                    yield event(line)
            for line in flush_partial():
                yield event(line)
            n, path, offset = current.attempts[-1].n, current.attempts[-1].log_path, 0
            yield event(f"=== attempt {n} ===")
        data = await read(path, offset)
        if data:
            offset += len(data)
            for line in lines_of(data):
                yield event(line)
        elif current.state in TERMINAL:
            for line in flush_partial():
                yield event(line)
            yield event(json.dumps({"state": current.state, "message": svc.scrub(current.message)}), "end")
            return
        else:
            await asyncio.sleep(0.25)
