"""What one control-service instance owns and does, behind its REST routes (service/app.py): the settings, the
run registry, the run files, the supervisor and the metrics, and the operations on runs (create, list, view, stop,
resume, delete) with the checks that refuse a bad request before anything changes.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from anyio import CapacityLimiter
from fastapi import HTTPException
from prometheus_client import CollectorRegistry

from service import errors, names
from service.admission import Submission, TrainerCheck, port_refusal, refusal
from service.exporter import ServiceCollector
from service.registry import ACTIVE, TERMINAL, DuplicateRun, Registry, Run
from service.rundir import SERVICE_NAMES, RunFilesCache, budget_note, read_tail
from service.schemas import AttemptOut, RunCreate, RunOut
from service.settings import Settings
from service.supervisor import Conflict, Supervisor
from titan_k3.config import load_job_config

log = logging.getLogger("service")
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
