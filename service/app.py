"""The FastAPI application: REST over the registry and the supervisor, /metrics, the web page."""

from __future__ import annotations

import asyncio
import fcntl
import hmac
import json
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from anyio import CapacityLimiter, to_thread
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.middleware.trustedhost import TrustedHostMiddleware

from service import errors, names
from service.admission import Submission, TrainerCheck, port_refusal, refusal
from service.exporter import TRAINER_KEYS, ServiceCollector, is_trainer_key
from service.limits import BodySizeLimit, MethodNotAllowed
from service.registry import ACTIVE, STATES, TERMINAL, DuplicateRun, Registry, Run
from service.rundir import SERVICE_NAMES, LineCap, RunFilesCache, budget_note, read_tail
from service.schemas import AttemptOut, Deleted, ErrorOut, Health, QUERY_BOOL, QUERY_INT, RunCreate, RunOut
from service.settings import Settings
from service.supervisor import STUCK_PASS_S, Conflict, FilesKept, Supervisor
from titan_k3.config import load_job_config

log = logging.getLogger("service")
STATIC = Path(__file__).resolve().parent / "static"
VIEW_TTL_SECONDS = 0.5
"""A queued or active run's JSON view is rebuilt from its files at most this often; an ended run's once per change
of its registry row (its files no longer change). List and status answer from these views."""
PROBE_THREADS = 4
"""Worker threads of their own for /healthz and /metrics: requests that wait for the registry's lock in the shared
pool (40 threads) during a slow supervisor pass cannot leave a probe or a scrape without one."""


def _view_key(run: Run, unsettled: dict[str, str]) -> tuple[float, int, str | None]:
    """What a run's cached view was built from: while it is unchanged (and the view fresh), the view stands."""
    return run.updated_at, len(run.attempts), unsettled.get(run.id)


def unprocessable(msg: str, *loc: str | int) -> HTTPException:
    """422 in the shape of FastAPI's own validation errors (one list schema for every 422)."""
    return HTTPException(422, [{"loc": list(loc) or ["body"], "msg": msg, "type": "value_error"}])


RunId = Annotated[str, PathParam(pattern=names.RUN_ID_PATTERN, max_length=names.RUN_ID_MAX,
                                 description="Run id: letters, digits, '_', '-', '.', no '..'.")]


def lock_state_dir(state_dir: Path) -> Any:
    """Hold `<state_dir>/service.lock` (an exclusive flock, released when the process ends however it ends): the
    open lock file. ValueError naming the holder's pid when another service has it.

    NOTE: two services over one registry would each re-adopt and relaunch the other's runs, and each answers from
    its own snapshot of the registry (a run created on one is a 404 on the other).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    f = open(state_dir / "service.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise ValueError(f"--state-dir {state_dir}: in use by another service (pid {holder}); stop it, or give "
                         "another --state-dir") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def registry_unavailable(e: sqlite3.Error, doing: str) -> HTTPException:
    """507 when the registry's disk is full, else 503 (locked past its retries, or failing): one line, retry later."""
    return HTTPException(507 if "full" in str(e) else 503, f"{doing}: {e}", headers={"Retry-After": "5"})


def _override_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Service:
    """Everything one app instance owns: settings, registry, run files, supervisor, metrics."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.state_lock = lock_state_dir(settings.state_dir)
        settings.runs_dir.mkdir(parents=True, exist_ok=True)
        self.token = settings.ensure_token()
        self.registry = Registry(settings.state_dir / "registry.sqlite3")
        self.files = RunFilesCache(settings.runs_dir, self.registry.carried)
        self.supervisor = Supervisor(settings, self.registry, self.files)
        self.trainer_check = TrainerCheck(settings)
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(ServiceCollector(self.registry, self.files, settings.gpus,
                                               settings.finished_series_seconds, self.supervisor.unsettled))
        self.probe_threads = CapacityLimiter(PROBE_THREADS)
        self.streams = 0
        self.closing: Callable[[], bool] = lambda: False
        """Whether the server is stopping (set by `python -m service`): open log streams end."""
        self._state_prefix = f"{settings.state_dir}{os.sep}"
        self._views: dict[str, tuple[tuple[float, int, str | None], float, bytes]] = {}
        self._views_lock = threading.Lock()

    def view(self, run: Run) -> bytes:
        """`out(run)` as JSON bytes, from the cache while the run's row is unchanged and the view is fresh."""
        key, now = _view_key(run, self.supervisor.unsettled()), time.monotonic()
        body = self._cached_view(run, key, now)
        if body is None:
            body = self.out(run).model_dump_json().encode()
            with self._views_lock:
                self._views[run.id] = (key, now, body)
        return body

    def _cached_view(self, run: Run, key: tuple[float, int, str | None], now: float) -> bytes | None:
        with self._views_lock:  # NOTE: held only around a dict's get or set, never across a read
            hit = self._views.get(run.id)
        if hit is not None and hit[0] == key and (run.state in TERMINAL or now - hit[1] < VIEW_TTL_SECONDS):
            return hit[2]
        return None

    def list_body(self, states: tuple[str, ...] | None) -> bytes:
        """GET /v1/runs's answer: the views of the runs in `states` (every run when None), as a JSON array."""
        return b"[" + b",".join(self.view(r) for r in self.registry.list(states)) + b"]"

    def cached_list_body(self, states: tuple[str, ...] | None) -> bytes | None:
        """`list_body(states)` when no one holds the registry's lock and every view is cached: read without waiting
        and without a file read (for the event loop), and what `list_body` would answer. None otherwise."""
        runs = self.registry.runs_if_free()
        if runs is None:
            return None
        unsettled, now, views = self.supervisor.unsettled(), time.monotonic(), []
        for run in runs:
            if states is None or run.state in states:
                body = self._cached_view(run, _view_key(run, unsettled), now)
                if body is None:
                    return None
                views.append(body)
        return b"[" + b",".join(views) + b"]"

    def cached_run_body(self, run_id: str) -> bytes | None:
        """GET /v1/runs/{id}'s answer, as `cached_list_body` gives the list's; None also when there is no such run
        (the 404 is the slow path's)."""
        runs = self.registry.runs_if_free()
        run = None if runs is None else next((r for r in runs if r.id == run_id), None)
        if run is None:
            return None
        return self._cached_view(run, _view_key(run, self.supervisor.unsettled()), time.monotonic())

    def forget(self, run_id: str) -> None:
        with self._views_lock:
            self._views.pop(run_id, None)

    def scrub(self, obj: Any) -> Any:
        """Strings with the state directory's absolute path made relative to it (responses name no host paths)."""
        if isinstance(obj, str):
            return obj.replace(self._state_prefix, "")
        if isinstance(obj, dict):
            return {k: self.scrub(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.scrub(v) for v in obj]
        return obj

    # ---- create ----------------------------------------------------------------------------------

    def create(self, req: RunCreate) -> Run:
        if (req.recipe is None) == (req.toml is None):
            raise unprocessable("give exactly one of 'recipe' (a name under tomls/) or 'toml' (inline text)")
        try:
            if req.recipe is not None:
                path = names.recipe_path(self.settings.recipes_dir, req.recipe)
                if not path.is_file():
                    raise ValueError(f"recipe {req.recipe!r}: not found; available: {', '.join(self.recipes()) or 'none'}")
                toml_text, recipe = path.read_text(), req.recipe
            else:
                toml_text, recipe = req.toml, "inline"
            overrides = {k: _override_text(v) for k, v in req.overrides.items()}
            for key, value in overrides.items():
                names.check_override(key, value)
            run_id = names.check_run_id(req.name) if req.name is not None else self._new_id(recipe)
        except ValueError as e:
            raise unprocessable(str(e)) from None

        argv = self.settings.run_args(run_id)
        for key, value in overrides.items():
            argv += [f"--{key}", value]
        try:
            # The trainer's own loader and checks (ConfigError is a ValueError): its message, verbatim.
            cfg = load_job_config(argv, toml_text=toml_text)
            self._check_paths(cfg)
        except ValueError as e:
            raise unprocessable(str(e)) from None
        self._check_name_free(run_id)
        sub = Submission(run_id, toml_text, overrides, req.nproc_per_node, req.gpus, cfg)
        why = refusal(self.settings, sub, self.claimed_ports(), self.trainer_check)
        if why is not None:
            raise unprocessable(why)

        run_dir = self.settings.runs_dir / run_id
        with self.registry.lock:
            self._check_name_free(run_id)
            why = port_refusal(self.settings, sub, self.claimed_ports())  # another run may have claimed it meanwhile
            if why is not None:
                raise unprocessable(why)
            try:
                run_dir.mkdir(parents=True)
                (run_dir / "submitted.toml").write_text(toml_text)
                self.registry.insert_run(run_id, recipe, overrides, req.nproc_per_node, req.gpus, req.restart_limit,
                                         cfg.metrics.prometheus_port)
            except DuplicateRun:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise HTTPException(409, f"run {run_id!r} already exists") from None
            except OSError as e:  # a full or read-only disk: the host's fault, said in one line, nothing left
                shutil.rmtree(run_dir, ignore_errors=True)
                raise HTTPException(507, f"cannot create run directory runs/{run_id}: {e.strerror}") from None
            except sqlite3.Error as e:  # the registry's disk is full (or it stayed locked past its timeout)
                shutil.rmtree(run_dir, ignore_errors=True)
                raise registry_unavailable(e, f"cannot record run {run_id!r} in the registry") from None
            except BaseException:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise
        self.supervisor.wake()
        run = self.registry.get(run_id)
        assert run is not None
        return run

    def _check_name_free(self, run_id: str) -> None:
        run = self.registry.get(run_id)
        if run is not None:
            raise HTTPException(409, f"run {run_id!r} already exists ({run.state}); pick another name")
        if (self.settings.runs_dir / run_id).exists():
            # NOTE: DELETE without files=true keeps the directory: the name stays taken, and no run of the API
            # owns it any more (a new run there would mix its files with the deleted one's).
            raise HTTPException(409, f"run name {run_id!r} is taken: runs/{run_id} holds the files of a deleted run "
                                     "(DELETE with files=true removes them); pick another name")

    def claimed_ports(self) -> dict[int, str]:
        """metrics.prometheus_port -> run, for every queued or active run."""
        return {r.prometheus_port: r.id for r in self.registry.list(("queued", *ACTIVE)) if r.prometheus_port}

    def _new_id(self, recipe: str) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return f"{recipe.replace('/', '-')}-{stamp}-{secrets.token_hex(3)}"

    def _check_paths(self, cfg: Any) -> None:
        """Configs may write only inside their run directory and read only from data roots."""
        roots = self.settings.data_roots
        names.check_relative_subpath("checkpoint.folder", cfg.checkpoint.folder, taken=SERVICE_NAMES)
        names.check_readable_path("data.dataset", cfg.data.dataset, roots)
        names.check_readable_path("data.tokenizer", cfg.data.tokenizer, roots)
        names.check_readable_path("checkpoint.initial_load_path", cfg.checkpoint.initial_load_path, roots)
        for task in filter(None, (t.strip() for t in cfg.eval.tasks.split(","))):
            names.check_readable_path("eval.tasks", task, roots)

    def recipes(self) -> list[str]:
        root = self.settings.recipes_dir
        if not root.is_dir():
            return []
        return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.toml"))

    # ---- read ------------------------------------------------------------------------------------

    def get(self, run_id: str) -> Run:
        try:
            names.check_run_id(run_id)
        except ValueError as e:
            raise unprocessable(str(e), "path", "run_id") from None
        run = self.registry.get(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    def out(self, run: Run) -> RunOut:
        files = self.files.get(run.id)
        ev = files.events()
        last = run.last_attempt
        return RunOut(
            id=run.id, state=run.state, message=self.scrub(run.message), recipe=run.recipe, overrides=run.overrides,
            nproc_per_node=run.nproc_per_node, gpus=run.gpus, assigned_gpus=run.assigned_gpus,
            restart_limit=run.restart_limit, restarts=run.restarts, restarts_total=run.restarts_total,
            created_at=run.created_at, updated_at=run.updated_at,
            run_dir=files.dir.relative_to(self.settings.state_dir).as_posix(),
            attempts=[AttemptOut(n=a.n, pid=a.pid, started_at=a.started_at, ended_at=a.ended_at,
                                 exit_code=a.exit_code, gpus=a.assigned_gpus) for a in run.attempts],
            exit_codes=[a.exit_code for a in run.attempts if a.ended_at is not None],
            step=files.step(last.started_at if last else None), checkpoint_step=files.checkpoint_step(),
            latest_checkpoint=files.latest_checkpoint(), latest_metrics=errors.finite(files.latest_metrics()),
            invariant_violations=self.scrub(errors.finite(ev["invariant_violations"])), events=ev["counts"],
            registry_error=self.scrub(self.supervisor.unsettled().get(run.id)),
        )

    def transition(self, run_id: str, action: Callable[[str], Run]) -> RunOut:
        """The supervisor's `action` (stop, resume) on an existing run: 404 when absent, 409 when it refuses, 503 when
        the registry cannot record it."""
        self.get(run_id)
        try:
            return self.out(action(run_id))
        except Conflict as e:
            raise HTTPException(409, str(e)) from None
        except KeyError:  # deleted by a concurrent request
            raise HTTPException(404, f"no run {run_id!r}") from None
        except sqlite3.Error as e:
            raise registry_unavailable(e, f"{action.__name__} of run {run_id!r} not recorded") from None

    def log_lines(self, run: Run, tail: int, end: int | None = None) -> list[str]:
        """The last `tail` lines over all attempts' console logs (the last attempt's first `end` bytes when given); a
        header marks each attempt shown whole. Lines are cut to --log-line-bytes, and at most --log-read-bytes are
        read: a mark says what is not shown."""
        out: list[str] = []
        budget = self.settings.log_read_bytes
        for i, a in enumerate(reversed(run.attempts)):
            need = tail - len(out)
            if need <= 0:
                break
            lines, used, stopped = read_tail(Path(a.log_path), need, end=end if i == 0 else None,
                                             line_bytes=self.settings.log_line_bytes, max_bytes=budget)
            chunk = [self.scrub(line) for line in lines]
            budget -= used
            if stopped:
                return [budget_note(self.settings.log_read_bytes), *(chunk + out)[-(tail - 1):]]
            out = ([f"=== attempt {a.n} ==="] if len(chunk) < need else []) + chunk + out
        return out[-tail:]


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
