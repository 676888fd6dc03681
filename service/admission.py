"""Whether a submitted run may be accepted: `refusal(...)` is one line saying why not, or None.

Cheap checks come first, in the service (what this host and the other runs
allow), then the trainer's own check of the configuration against the host
(`titan_k3.config.check`: data sources, files, the metrics port), with the
very arguments the run will get, in a small pool of checker processes: the
service process imports nothing the trainer's data readers import, a slow or
crashing check is bounded by a timeout, and a check costs milliseconds
instead of a Python start-up (50 submissions at once on 2 cores).

To refuse something more (a plan that does not fit the GPUs' memory, say),
add a function that returns a line or None and chain it in `refusal`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as CheckTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from service.settings import Settings
from titan_k3.config import JobConfig
from titan_k3.config.check import config_error
from titan_k3.config.errors import toml_value
from titan_k3.models.k3.args import count_params, get_flavor
from titan_k3.plan.search import refusal as plan_refusal
from titan_k3.plan.search import resolve_layout

CPU_MAX_PARAMS = 100_000_000
"""Largest model (total parameters) a run without GPUs may train: past it one update takes minutes on CPU."""


@dataclass
class Submission:
    """A run as submitted: its TOML text, overrides and placement, and the config they resolve to."""

    run_id: str
    toml_text: str
    overrides: dict[str, str]
    nproc_per_node: int
    gpus: int
    cfg: JobConfig


def host_refusal(settings: Settings, sub: Submission) -> str | None:
    """What this host cannot give the run: GPUs, processes per GPU or core, a model too big for CPU."""
    if sub.gpus > settings.gpus:
        return f"gpus = {sub.gpus}: this service schedules {settings.gpus} GPU(s)"
    if sub.gpus and sub.nproc_per_node > sub.gpus:
        return f"nproc_per_node = {sub.nproc_per_node}: at most gpus = {sub.gpus} (one GPU per process)"
    if not sub.gpus and sub.nproc_per_node > settings.cpus:
        return (f"nproc_per_node = {sub.nproc_per_node}: a run without GPUs gets at most this host's "
                f"{settings.cpus} CPU cores, one process each")
    if sub.gpus:
        return None
    none_here = " (this host has none)" if settings.gpus == 0 else ""
    if sub.cfg.training.device == "cuda":
        return f"config key 'training.device' = 'cuda': the run asks for no GPU (gpus = 0){none_here}"
    flavor = sub.cfg.model.flavor
    params = count_params(get_flavor(flavor)).total
    if params > CPU_MAX_PARAMS:
        return (f"config key 'model.flavor' = {toml_value(flavor)}: {params / 1e9:.2f}B parameters cannot train on CPU "
                f"(at most {CPU_MAX_PARAMS / 1e6:.0f}M); ask for gpus >= 1{none_here}")
    return None


def degrees_refusal(sub: Submission) -> str | None:
    """The parallel degrees fit the run's world (`nproc_per_node` processes on one node), as the trainer checks."""
    try:
        resolve_layout(sub.cfg, sub.nproc_per_node, get_flavor(sub.cfg.model.flavor).n_experts)
    except ValueError as e:
        return str(e)
    return None


def port_refusal(settings: Settings, sub: Submission, claimed: dict[int, str]) -> str | None:
    """The metrics port is neither the service's own nor one another queued or live run claims."""
    port = sub.cfg.metrics.prometheus_port
    if not port:
        return None
    if port == settings.port:
        return f"config key 'metrics.prometheus_port' = {port}: the control service's own port"
    if port in claimed:
        return f"config key 'metrics.prometheus_port' = {port}: already claimed by run {claimed[port]!r}"
    return None


def exit_with_parent() -> None:
    """A checker process's initializer: the process exits as soon as the process that started it is gone.

    NOTE: a service killed outright (SIGKILL, the OOM killer) never shuts its pool down, and its checkers would
    wait on their task queue for good: one orphan per checker per such restart. The parent's sentinel (the pipe
    it holds open while it lives) becomes readable when it dies.
    """
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Shut `pool` down and kill its processes, a check still running in one of them included.

    NOTE: `shutdown` lets a running task run on, so a hung check (the reason a pool is discarded) would keep
    its process for good: the processes are killed first (Python 3.14's `ProcessPoolExecutor.kill_workers`;
    before it, the pool's own table of processes). Then `shutdown(wait=True)` returns at once, its manager
    thread having seen them die, and releases the pool's queues: without the wait, a service that stopped
    after using a pool printed a warning of leaked semaphores at exit.
    """
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


class TrainerCheck:
    """The trainer's configuration check (`titan_k3.config.check.config_error`, or `check`) in checker processes."""

    def __init__(self, settings: Settings, check: Callable[[list[str], str], str | None] = config_error):
        self.settings = settings
        self.check = check  # (argv, toml_text) -> the refusal line or None; importable by a spawned process
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # NOTE: spawn, not fork: the service has threads (uvicorn's, the supervisor's).
                self._pool = ProcessPoolExecutor(max_workers=max(1, min(4, self.settings.cpus)),
                                                 mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=exit_with_parent)
            return self._pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        """Replace a pool whose worker hangs or died (the next check starts a fresh one)."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
        stop_pool(pool)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            stop_pool(pool)

    def __call__(self, sub: Submission) -> str | None:
        s = self.settings
        argv = list(s.run_args(sub.run_id))
        for key, value in sub.overrides.items():
            argv += [f"--{key}", value]
        pool = self._executor()
        try:
            return pool.submit(self.check, argv, sub.toml_text).result(timeout=s.check_timeout)
        except CheckTimeout:
            self._discard(pool)
            return f"the trainer's configuration check took longer than {s.check_timeout:.0f} s"
        except BrokenProcessPool:
            self._discard(pool)
            return "the trainer's configuration check crashed; try again"


def refusal(settings: Settings, sub: Submission, claimed_ports: dict[int, str],
            trainer_check: TrainerCheck) -> str | None:
    """The first reason to refuse `sub`, or None to accept it."""
    # The planner (torch-free, in process): a run whose memory cannot fit its GPUs, one process each.
    return (host_refusal(settings, sub) or degrees_refusal(sub) or port_refusal(settings, sub, claimed_ports)
            or (plan_refusal(sub.cfg, sub.nproc_per_node) if sub.gpus else None) or trainer_check(sub))
