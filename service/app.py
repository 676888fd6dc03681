"""The FastAPI application: REST over the registry and the supervisor, /metrics, the web page."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import shutil
import time
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from service import names
from service.exporter import ServiceCollector
from service.limits import BodySizeLimit
from service.registry import ACTIVE, TERMINAL, DuplicateRun, Registry, Run
from service.rundir import RunFilesCache, tail_lines
from service.schemas import AttemptOut, Health, RunCreate, RunOut
from service.settings import Settings
from service.supervisor import Conflict, Supervisor
from titan_k3.config import load_job_config

log = logging.getLogger("service")
STATIC = Path(__file__).resolve().parent / "static"


def _finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null (a NaN loss must not break the API)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _override_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class Service:
    """Everything one app instance owns: settings, registry, run files, supervisor, metrics."""

    def __init__(self, settings: Settings):
        self.settings = settings
        settings.runs_dir.mkdir(parents=True, exist_ok=True)
        self.token = settings.ensure_token()
        self.registry = Registry(settings.state_dir / "registry.sqlite3")
        self.files = RunFilesCache(settings.runs_dir)
        self.supervisor = Supervisor(settings, self.registry)
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(ServiceCollector(self.registry, self.files, settings.gpus))

    # ---- create ----------------------------------------------------------------------------------

    def create(self, req: RunCreate) -> Run:
        if (req.recipe is None) == (req.toml is None):
            raise HTTPException(422, "give exactly one of 'recipe' (a name under tomls/) or 'toml' (inline text)")
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
            if req.gpus > self.settings.gpus:
                raise ValueError(f"gpus = {req.gpus}: this service schedules {self.settings.gpus} GPU(s)")
            if req.gpus and req.nproc_per_node > req.gpus:
                raise ValueError(f"nproc_per_node = {req.nproc_per_node}: at most gpus = {req.gpus} (one GPU per process)")
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

        argv = self.settings.run_args(run_id)
        for key, value in overrides.items():
            argv += [f"--{key}", value]
        try:
            # The trainer's own loader and checks (ConfigError is a ValueError): its message, verbatim.
            cfg = load_job_config(argv, toml_text=toml_text)
            self._check_paths(cfg)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

        run_dir = self.settings.runs_dir / run_id
        with self.registry.lock:
            if self.registry.get(run_id) is not None or run_dir.exists():
                raise HTTPException(409, f"run {run_id!r} already exists; resume it or pick another name")
            try:
                run_dir.mkdir(parents=True)
                (run_dir / "submitted.toml").write_text(toml_text)
                self.registry.insert_run(run_id, recipe, overrides, req.nproc_per_node, req.gpus, req.restart_limit)
            except DuplicateRun:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise HTTPException(409, f"run {run_id!r} already exists") from None
            except BaseException:
                shutil.rmtree(run_dir, ignore_errors=True)
                raise
        self.supervisor.wake()
        run = self.registry.get(run_id)
        assert run is not None
        return run

    def _new_id(self, recipe: str) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return f"{recipe.replace('/', '-')}-{stamp}-{secrets.token_hex(3)}"

    def _check_paths(self, cfg: Any) -> None:
        """Configs may write only inside their run directory and read only from data roots."""
        roots = self.settings.data_roots
        names.check_relative_subpath("checkpoint.folder", cfg.checkpoint.folder)
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
            raise HTTPException(422, str(e)) from None
        run = self.registry.get(run_id)
        if run is None:
            raise HTTPException(404, f"no run {run_id!r}")
        return run

    def out(self, run: Run) -> RunOut:
        files = self.files.get(run.id)
        ev = files.events()
        return RunOut(
            id=run.id, state=run.state, message=run.message, recipe=run.recipe, overrides=run.overrides,
            nproc_per_node=run.nproc_per_node, gpus=run.gpus, assigned_gpus=run.assigned_gpus,
            restart_limit=run.restart_limit, restarts=run.restarts, restarts_total=run.restarts_total,
            created_at=run.created_at, updated_at=run.updated_at, run_dir=str(files.dir),
            attempts=[AttemptOut(n=a.n, pid=a.pid, started_at=a.started_at, ended_at=a.ended_at,
                                 exit_code=a.exit_code, gpus=a.assigned_gpus) for a in run.attempts],
            exit_codes=[a.exit_code for a in run.attempts if a.ended_at is not None],
            latest_checkpoint=files.latest_checkpoint(), latest_metrics=_finite(files.latest_metrics()),
            invariant_violations=_finite(ev["invariant_violations"]), events=ev["counts"],
        )

    def transition(self, run_id: str, action: Callable[[str], Run]) -> RunOut:
        """The supervisor's `action` (stop, resume) on an existing run: 404 when absent, 409 when it refuses."""
        self.get(run_id)
        try:
            return self.out(action(run_id))
        except Conflict as e:
            raise HTTPException(409, str(e)) from None

    def log_lines(self, run: Run, tail: int) -> list[str]:
        """The last `tail` lines over all attempts' console logs; a header marks each attempt shown whole."""
        out: list[str] = []
        for a in reversed(run.attempts):
            need = tail - len(out)
            if need <= 0:
                break
            chunk = tail_lines(Path(a.log_path), need)
            out = ([f"=== attempt {a.n} ==="] if len(chunk) < need else []) + chunk + out
        return out[-tail:]


def create_app(settings: Settings) -> FastAPI:
    svc = Service(settings)
    bearer = HTTPBearer(auto_error=False, description="Token from $K3_SERVICE_TOKEN, --token-file or <state-dir>/token")

    def require_token(cred: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        ok = cred is not None and cred.scheme.lower() == "bearer" and hmac.compare_digest(
            cred.credentials.encode(), svc.token.encode())
        if not ok:
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        svc.supervisor.start()
        yield
        svc.supervisor.shutdown()
        svc.registry.close()

    app = FastAPI(title="titan_k3 control service", version="0.1.0", lifespan=lifespan,
                  description="Start, watch and stop titan_k3 trainings (torchrun children) over REST.")
    app.state.service = svc
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.post("/v1/runs", status_code=201, response_model=RunOut, dependencies=[Depends(require_token)],
              responses={409: {"description": "name taken"}, 422: {"description": "invalid config (trainer's message)"}})
    def create_run(req: RunCreate) -> RunOut:
        return svc.out(svc.create(req))

    @app.get("/v1/runs", response_model=list[RunOut])
    def list_runs(state: str | None = Query(None, pattern="^[a-z]{1,16}$")) -> list[RunOut]:
        runs = svc.registry.list((state,) if state else None)
        return [svc.out(r) for r in runs]

    @app.get("/v1/runs/{run_id}", response_model=RunOut, responses={404: {"description": "no such run"}})
    def get_run(run_id: str) -> RunOut:
        return svc.out(svc.get(run_id))

    @app.post("/v1/runs/{run_id}/stop", status_code=202, response_model=RunOut,
              dependencies=[Depends(require_token)], responses={404: {}, 409: {}})
    def stop_run(run_id: str) -> RunOut:
        return svc.transition(run_id, svc.supervisor.stop)

    @app.post("/v1/runs/{run_id}/resume", status_code=202, response_model=RunOut,
              dependencies=[Depends(require_token)], responses={404: {}, 409: {}})
    def resume_run(run_id: str) -> RunOut:
        return svc.transition(run_id, svc.supervisor.resume)

    @app.get("/v1/runs/{run_id}/logs", response_class=PlainTextResponse, responses={404: {}})
    def run_logs(run_id: str, tail: int = Query(200, ge=1, le=10000)) -> PlainTextResponse:
        lines = svc.log_lines(svc.get(run_id), tail)
        return PlainTextResponse("\n".join(lines) + ("\n" if lines else ""))

    @app.get("/v1/runs/{run_id}/logs/stream", responses={200: {"content": {"text/event-stream": {}}}, 404: {}})
    async def stream_logs(run_id: str, tail: int = Query(50, ge=0, le=10000)) -> StreamingResponse:
        """Server-sent events: one `data:` line per log line, following attempts; `event: end` when the run ends."""
        run = svc.get(run_id)
        return StreamingResponse(_follow(svc, run, tail), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.get("/v1/runs/{run_id}/metrics", responses={404: {}})
    def run_metrics(run_id: str, tail: int = Query(1000, ge=1, le=4000),
                    keys: str | None = Query(None, max_length=2000,
                                             description="comma-separated metric keys (step is always included)")
                    ) -> JSONResponse:
        run = svc.get(run_id)
        wanted = [k for k in keys.split(",") if k] if keys else None
        return JSONResponse(_finite(svc.files.get(run.id).history(tail, wanted)))

    @app.get("/v1/recipes", response_model=list[str])
    def list_recipes() -> list[str]:
        return svc.recipes()

    @app.get("/v1/prometheus/targets")
    def prometheus_targets() -> JSONResponse:
        """Prometheus HTTP service discovery: the rank-0 endpoint of every active run that opened one."""
        groups = []
        for run in svc.registry.list(ACTIVE):
            port = svc.files.get(run.id).config_value("metrics", "prometheus_port")
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                groups.append({"targets": [f"{settings.advertise_host}:{port}"], "labels": {"run": run.id}})
        return JSONResponse(groups)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> Response:
        return Response(generate_latest(svc.metrics), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=Health)
    def healthz() -> Health:
        runs = svc.registry.list()
        return Health(status="ok", runs=len(runs), gpus_total=settings.gpus,
                      gpus_used=sum(len(r.assigned_gpus) for r in runs if r.state in ACTIVE))

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text())

    return app


async def _follow(svc: Service, run: Run, tail: int) -> AsyncIterator[bytes]:
    def event(line: str, kind: str | None = None) -> bytes:
        head = f"event: {kind}\n" if kind else ""
        return (head + "".join(f"data: {part}\n" for part in line.split("\n")) + "\n").encode()

    for line in svc.log_lines(run, tail) if tail else []:
        yield event(line)
    n = run.attempts[-1].n if run.attempts else 0
    offset = Path(run.attempts[-1].log_path).stat().st_size if run.attempts and Path(run.attempts[-1].log_path).exists() else 0
    partial = b""
    while True:
        current = svc.registry.get(run.id)
        if current is None:
            return
        if current.attempts and current.attempts[-1].n != n:
            n, offset, partial = current.attempts[-1].n, 0, b""
            yield event(f"=== attempt {n} ===")
        data = b""
        if current.attempts:
            with suppress(FileNotFoundError):  # the attempt has not written its log yet
                with open(current.attempts[-1].log_path, "rb") as f:
                    f.seek(offset)
                    data = f.read(1 << 20)
        if data:
            offset += len(data)
            *lines, partial = (partial + data).split(b"\n")
            for line in lines:
                yield event(line.decode("utf-8", errors="replace"))
        elif current.state in TERMINAL:
            if partial:
                yield event(partial.decode("utf-8", errors="replace"))
            yield event(json.dumps({"state": current.state, "message": current.message}), "end")
            return
        else:
            await asyncio.sleep(0.25)
