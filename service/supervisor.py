"""Launches, watches, restarts, stops and re-adopts training processes.

One background thread runs `tick()` every `poll_seconds`: reap exited
attempts (finish, fail, or relaunch within the restart limit), escalate
stops past their grace period to SIGKILL, then start queued runs in FIFO
order while GPUs (and the running-run limit) allow.

Each attempt is `python -m service.child EXIT_FILE -- <launch command>`,
started as a new session so that (a) stop can signal the whole process group
and (b) the trainings survive a restart of the service, which then
re-adopts them by pid and process start time (a reused pid has another
start time).

An attempt that ends with the trainer's configuration-error status
(CONFIG_ERROR_EXIT; under torchrun, read from its failure summary) is not
relaunched: the same configuration would fail the same way.

Each transition is one registry transaction (an attempt's end with the run's
new state, or with the next attempt's record), written after the processes it
records were started or reaped. When the registry refuses it (past its own
retries of a lock), the pass moves on and the run is retried later
(UNSETTLED_RETRY_S, doubling), named in `unsettled()` meanwhile (the run's GET,
/metrics, /healthz): an attempt it could not record is killed (a service
restart could not find it, and the retry starts it again), and the next pass
settles a run that claims to run with no attempt alive from its last recorded
attempt. A relaunch or launch the registry refuses for another reason than a
lock, or that fails otherwise between its start and its record (the events of
the attempt it follows cannot be counted), is killed and fails the run, if
that can still be written.

/healthz reports how long ago the watcher ended a pass: past STUCK_PASS_S one
is stuck, most likely on a registry write that SQLite's lock holds up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil

from service.attempts import (
    ATTEMPT_ENV, attempt_processes_of, config_error, describe_exit, kill_leftovers, kill_processes,
    launch_command, process_alive, processes_by_attempt, read_exit, set_aside_records,
)
from service.registry import ACTIVE, BUSY_TIMEOUT_S, RESUMABLE, WRITE_TRIES, Attempt, Registry, Run, is_transient
from service.rundir import RunFilesCache, tally_events
from service.settings import Settings
from titan_k3.config.run_files import RUN_FILES

log = logging.getLogger("service.supervisor")

UNSETTLED_RETRY_S = 1.0
"""A transition the registry refused is tried again after this long, then twice as long each time (at most 60 s)."""
STUCK_PASS_S = 2 * WRITE_TRIES * BUSY_TIMEOUT_S
"""A watcher that has ended no pass for this long is stuck (/healthz: degraded): twice the longest one write waits for
SQLite's lock before the registry gives up on it."""
class Conflict(Exception):
    """The request does not fit the run's current state (HTTP 409)."""


class FilesKept(Exception):
    """DELETE with files=true could not remove the run directory; the run is kept (HTTP 500, the line)."""


@dataclass
class Unsettled:
    """A run whose last transition the registry refused: what failed, how often, and when the next try is."""

    what: str
    error: str
    failures: int
    since: float
    retry_at: float

    def line(self) -> str:
        return (f"the registry refused to record {self.what} ({self.error}; {self.failures} time(s) since "
                f"{time.strftime('%H:%M:%S', time.localtime(self.since))}); the service retries it")


class Supervisor:
    def __init__(self, settings: Settings, registry: Registry, files: RunFilesCache):
        self.settings = settings
        self.registry = registry
        self.files = files
        self._children: dict[str, subprocess.Popen] = {}
        self._doomed: dict[str, list[psutil.Process]] = {}
        self._unsettled: dict[str, Unsettled] = {}
        self.pass_error: str | None = None
        """Why the last pass stopped short (an error outside any one run's transition); None when it completed."""
        self._pass_ended: float | None = None
        """time.monotonic() when the watcher last ended a pass (`recover`, then each `tick`); None before it starts."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.recover()
        self._pass_ended = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="k3-supervisor", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop watching; the trainings keep running and are re-adopted by the next start."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wake(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
                self.pass_error = None
            except Exception as e:  # the watcher must outlive any single bad run
                self.pass_error = f"supervisor pass failed: {type(e).__name__}: {e}"
                log.exception("supervisor tick failed")
            self._pass_ended = time.monotonic()
            self._wake.wait(self.settings.poll_seconds)
            self._wake.clear()

    def since_pass(self) -> float | None:
        """Seconds since the watcher last ended a pass (a pass runs every `poll_seconds`); None before it starts."""
        ended = self._pass_ended
        return None if ended is None else time.monotonic() - ended

    def recover(self) -> None:
        """After a (re)start: re-adopt live attempts, settle the ones that ended while we were away.

        NOTE: a launch starts the attempt, records it, then marks the run running. A service that died after
        the record left a queued run with a started attempt: it is re-adopted (or settled) here as a running
        one, never launched a second time beside it. One that died before the record left an attempt log and
        maybe processes tagged with that attempt's exit file: they are killed, and the attempt is recorded as
        ended, so the launch that follows is the next attempt (and keeps its files, as after any crash). So is a
        relaunch's (it records the crashed attempt's end with the next attempt): it counts as a restart, and the run
        is settled from its exit.
        """
        with self.registry.lock:
            for run in self.registry.list():
                with self._settling(run.id, "the events of its set-aside attempts"):
                    self._carry_uncounted(run)
            tagged: dict[str, list[psutil.Process]] | None = None
            for run in self.registry.list(("queued", *ACTIVE)):
                n = len(run.attempts) + 1
                log_path, exit_path = self.attempt_files(run.id, n)
                if log_path.exists():
                    if tagged is None:
                        tagged = processes_by_attempt()
                    with self._settling(run.id, f"attempt {n}, started as the service went down"):
                        self._settle_unrecorded(run, n, tagged.get(str(exit_path), []))
                    run = self.registry.get(run.id) or run
                a = run.last_attempt
                if a is not None and a.ended_at is None:
                    with self._settling(run.id, "how its attempt fared while the service was down"):
                        self._recover_active(run, adopt_from_queue=run.state == "queued")
                elif run.state in ACTIVE:  # an unrecorded relaunch settled above, or a service that died between writes
                    with self._settling(run.id, "the end of its last attempt"):
                        self._reconcile(run)

    def _carry(self, run_id: str, n: int) -> None:
        """Count attempt `n`'s events.jsonl, set aside in service/attempt-<n>/, into the registry.

        NOTE: the run's event and violation counters are the registry's carried counts plus the current
        events.jsonl; the file moving aside must not take its counts with it (Prometheus would read a reset).
        """
        path = self.settings.runs_dir / run_id / "service" / f"attempt-{n}" / "events.jsonl"
        self.registry.carry(run_id, n, *tally_events(path))

    def _carry_uncounted(self, run: Run) -> None:
        """Carry the counts of attempts set aside but not counted (the service died between the move and the write)."""
        for d in (self.settings.runs_dir / run.id / "service").glob("attempt-*"):
            n = d.name.removeprefix("attempt-")
            if d.is_dir() and n.isdigit() and int(n) not in run.carried_attempts:
                log.info("run %s: counting the events of attempt %s, set aside before a service restart", run.id, n)
                self._carry(run.id, int(n))
                self.files.forget(run.id)

    def _settle_unrecorded(self, run: Run, n: int, procs: list[psutil.Process]) -> None:
        """Kill and record attempt `n` of `run`, started before a service restart and never recorded: a queued run's
        launch (the run stays queued), or an active run's relaunch."""
        a, code, left = self._end_unrecorded(run.id, n, procs)
        if run.state in ACTIVE and run.attempts:  # NOTE: a launch starts only queued runs, a relaunch active ones
            self._settle_unrecorded_relaunch(run, a, code, left)
            return
        note = f"attempt {n} started as the service went down and was never recorded ({left}); queued again"
        with self.registry.batch():
            self.registry.add_attempt(a)
            self.registry.end_attempt(run.id, n, code)
            self.registry.update_run(run.id, message=note)
        log.warning("run %s: %s", run.id, note)

    def _end_unrecorded(self, run_id: str, n: int, procs: list[psutil.Process]) -> tuple[Attempt, int | None, str]:
        """Kill `procs`, what runs of attempt `n`, started and never recorded: the attempt's record (its wrapper's pid,
        when it still ran), the exit status it wrote (None when killed here), and what was left of it, in words."""
        log_path, exit_path = self.attempt_files(run_id, n)
        wrapper, start = 0, log_path.stat().st_mtime
        for p in procs:
            with contextlib.suppress(psutil.Error):  # exited meanwhile
                if "service.child" in p.cmdline():
                    wrapper, start = p.pid, p.create_time()
        killed = kill_processes(procs)
        a = Attempt(run_id=run_id, n=n, pid=wrapper, pid_start_time=start, started_at=start, ended_at=None,
                    exit_code=None, assigned_gpus=[], log_path=str(log_path), exit_path=str(exit_path))
        return a, read_exit(exit_path), f"{killed} process(es) of it killed" if killed else "it had ended"

    def _settle_unrecorded_relaunch(self, run: Run, a: Attempt, code: int | None, left: str) -> None:
        """Record attempt `a` of active `run`, a relaunch never recorded, with the end of the attempt it followed (one
        transaction, as the relaunch would have written them), and count it as a restart.

        NOTE: the relaunch happened (the attempt may have trained, and crashed, while the service was down): not
        counted, the run's restarts and titan_k3_service_restarts_total fell short of its relaunches and its restart
        limit allowed one more. Killed here (no exit status), it is queued again, as an unrecorded launch is; else
        `recover` settles the run from its exit as from any attempt's.
        """
        prev = run.last_attempt
        assert prev is not None
        prev_code = prev.exit_code if prev.ended_at is not None else read_exit(prev.exit_path)
        note = (f"{describe_exit(self.settings.launcher, prev, prev_code)}; restart {run.restarts + 1} of "
                f"{run.restart_limit}: attempt {a.n} started as the service went down and was never recorded ({left})")
        after = {"message": note} if code is not None else \
            {"state": "queued", "assigned_gpus": [], "message": f"{note}; queued again"}
        with self.registry.batch():
            self.registry.end_attempt(run.id, prev.n, prev_code)
            self.registry.add_attempt(a)
            self.registry.end_attempt(run.id, a.n, code)
            self.registry.update_run(run.id, restarts=run.restarts + 1, restarts_total=run.restarts_total + 1, **after)
        log.warning("run %s: %s", run.id, note)

    def _recover_active(self, run: Run, adopt_from_queue: bool = False) -> None:
        a = run.last_attempt
        if a is not None and a.ended_at is None and process_alive(a.pid, a.pid_start_time):
            log.info("re-adopted run %s (pid %d, attempt %d)", run.id, a.pid, a.n)
            if adopt_from_queue:
                self.registry.update_run(run.id, state="running", assigned_gpus=a.assigned_gpus,
                                         message=f"attempt {a.n} re-adopted after a service restart (it had started "
                                                 "as the service went down)")
            return
        code = read_exit(a.exit_path) if a is not None else None
        killed = kill_leftovers(a) if a is not None else 0
        if a is not None and code not in (None, 0) and run.stop_requested_at is None:
            # NOTE: an attempt that failed while the service was down gets what it would have got with the service
            # up: a relaunch within the restart limit, or failed (at once for a configuration error), not lost.
            log.warning("run %s: attempt %d exited with %d while the service was down", run.id, a.n, code)
            self._on_exit(run, a, code)
            return
        with self.registry.batch():
            if a is not None and a.ended_at is None:
                self.registry.end_attempt(run.id, a.n, code)
            if code == 0 or (code is not None and run.stop_requested_at is not None):
                state = "stopped" if run.stop_requested_at is not None else "finished"
                self.registry.update_run(run.id, state=state, assigned_gpus=[],
                                         message=f"ended with exit code {code} while the service was down")
            else:
                left = f" ({killed} leftover process(es) of it killed)" if killed else ""
                self.registry.update_run(run.id, state="lost", assigned_gpus=[],
                                         message=f"process gone after a service restart{left}; resume to continue")

    def attempt_files(self, run_id: str, n: int) -> tuple[Path, Path]:
        """Attempt `n`'s console log and exit file (its path is the attempt's ATTEMPT_ENV tag)."""
        svc_dir = self.settings.runs_dir / run_id / "service"
        return svc_dir / f"attempt-{n}.log", svc_dir / f"attempt-{n}.exit"

    # ---- one pass --------------------------------------------------------------------------------

    def unsettled(self) -> dict[str, str]:
        """run id -> why its last transition is not recorded yet (the registry refused it; it is being retried)."""
        return {run_id: u.line() for run_id, u in list(self._unsettled.items())}

    @contextlib.contextmanager
    def _settling(self, run_id: str, what: str) -> Iterator[None]:
        """Record `run_id`'s transition in the block as done, or, when the registry refuses it, as unsettled (with the
        time of its next try) and go on with the other runs."""
        try:
            yield
        except sqlite3.Error as e:
            now = time.monotonic()
            u = self._unsettled.get(run_id)
            failures = u.failures + 1 if u else 1
            self._unsettled[run_id] = Unsettled(
                what=what, error=f"{type(e).__name__}: {e}", failures=failures, since=u.since if u else time.time(),
                retry_at=now + min(60.0, UNSETTLED_RETRY_S * 2 ** (failures - 1)))
            log.error("run %s: the registry refused to record %s (%s); retrying in %.0f s", run_id, what, e,
                      self._unsettled[run_id].retry_at - now)
        else:
            if self._unsettled.pop(run_id, None) is not None:
                log.info("run %s: recorded at last", run_id)

    def _due(self, run_id: str) -> bool:
        """Whether the run may be acted on in this pass (not waiting for the next try of a refused transition)."""
        u = self._unsettled.get(run_id)
        return u is None or time.monotonic() >= u.retry_at

    def tick(self) -> None:
        with self.registry.lock:
            now = time.time()
            for run in self.registry.list(ACTIVE):
                if self._due(run.id):
                    with self._settling(run.id, "the end of its attempt"):
                        self._watch(run, now)
            for run_id in set(self._unsettled) - {r.id for r in self.registry.list(("queued", *ACTIVE))}:
                del self._unsettled[run_id]  # settled meanwhile (a stop, a DELETE) or gone
            self._schedule()

    def _watch(self, run: Run, now: float) -> None:
        a = run.last_attempt
        if a is None or a.ended_at is not None:
            self._reconcile(run)
            return
        exited, code = self._poll(run.id, a)
        if exited:
            self._on_exit(run, a, code)
        elif run.state == "stopping" and now - (run.stop_requested_at or now) > self.settings.grace_seconds:
            self._kill(run.id, a, signal.SIGKILL)

    def _reconcile(self, run: Run) -> None:
        """Settle an active run whose attempts have all ended: the transition that follows the last one was never
        recorded (the registry refused it, or the service died between two writes of an older version).

        NOTE: what the registry does not record must not run: processes of an attempt after the last recorded one
        are killed first, and the run is then settled from its last attempt's recorded exit, as it would have been.
        """
        n = len(run.attempts) + 1
        _, exit_path = self.attempt_files(run.id, n)
        stray = processes_by_attempt().get(str(exit_path), [])
        if stray:
            log.warning("run %s: killing %d process(es) of attempt %d, never recorded", run.id, len(stray), n)
            kill_processes(stray)
        self._children.pop(run.id, None)
        a = run.last_attempt
        if a is None:
            self.registry.update_run(run.id, state="queued", assigned_gpus=[],
                                     message="active with no attempt recorded; queued again")
            return
        log.warning("run %s: active with attempt %d ended (exit code %s): settling it", run.id, a.n, a.exit_code)
        self._on_exit(run, a, a.exit_code)

    def _poll(self, run_id: str, a: Attempt) -> tuple[bool, int | None]:
        proc = self._children.get(run_id)
        if proc is not None and proc.pid == a.pid:
            wrapper_code = proc.poll()
            if wrapper_code is None:
                return False, None
            code = read_exit(a.exit_path)
            return True, code if code is not None else wrapper_code
        if process_alive(a.pid, a.pid_start_time):
            return False, None
        return True, read_exit(a.exit_path)

    def _on_exit(self, run: Run, a: Attempt, code: int | None) -> None:
        """Attempt `a` of `run` ended with `code`: reap what is left of it, then record its end with what follows
        (stopped, finished, failed, or the next attempt) in one transaction."""
        self._reap_leftovers(run.id, a)
        killed = kill_leftovers(a)
        how = describe_exit(self.settings.launcher, a, code)
        if killed:
            how += f"; {killed} leftover process(es) of it killed"
        bad_config = None if code == 0 or run.stop_requested_at is not None else \
            config_error(self.settings.launcher, a, code)
        if run.stop_requested_at is None and code != 0 and bad_config is None and run.restarts < run.restart_limit:
            ckpt = self.files.get(run.id).latest_checkpoint()
            where = f"resumes from {ckpt}" if ckpt else "no checkpoint: starts over at update 0"
            note = f"{how}; restart {run.restarts + 1} of {run.restart_limit}, {where}"
            log.warning("run %s: %s", run.id, note)
            self._launch(run, run.assigned_gpus, ended=(a, code), message=note,
                         restarts=run.restarts + 1, restarts_total=run.restarts_total + 1)
            if (proc := self._children.get(run.id)) is not None and proc.pid == a.pid:
                del self._children[run.id]  # recorded as failed: its launch could not start or be recorded
        else:
            if run.stop_requested_at is not None:
                # NOTE: the state is the user's stop whatever the exit code (torchrun signalled itself exits 1
                # after its ranks saved); the message says whether the run directory holds a checkpoint.
                ckpt = self.files.get(run.id).latest_checkpoint()
                kept = f"resumes from {ckpt}" if ckpt else "no checkpoint kept"
                state, message = "stopped", f"stopped on request; {kept} (attempt {a.n} exit code {code})"
            elif code == 0:
                state, message = "finished", "finished"
            elif bad_config is not None:
                state, message = "failed", f"configuration error, not retried (attempt {a.n}): {bad_config}"
            else:
                state, message = "failed", f"{how}; restart limit {run.restart_limit} reached"
            with self.registry.batch():
                self.registry.end_attempt(run.id, a.n, code)
                self.registry.update_run(run.id, state=state, assigned_gpus=[], message=message)
            self._children.pop(run.id, None)

    def used_gpus(self) -> set[int]:
        return {g for r in self.registry.list(ACTIVE) for g in r.assigned_gpus}

    def _schedule(self) -> None:
        queued = self.registry.list(("queued",))
        if not queued:
            return
        running = len(self.registry.list(ACTIVE))
        used = self.used_gpus()
        for run in queued:  # strict FIFO: a big request at the head is not starved by small ones
            if self.settings.max_running and running >= self.settings.max_running:
                return
            free = [g for g in range(self.settings.gpus) if g not in used]
            if run.gpus > len(free):
                return
            gpus = free[: run.gpus]
            if self._due(run.id):
                with self._settling(run.id, "its launch"):
                    self._launch(run, gpus)
            # NOTE: a run waiting to retry keeps its place and its GPUs: the queue stays FIFO.
            used.update(gpus)
            running += 1

    def _launch(self, run: Run, gpus: list[int], ended: tuple[Attempt, int | None] | None = None,
                message: str | None = None, **fields: object) -> None:
        """Start the run's next attempt on `gpus` and record it (after `ended`, the attempt that just ended with its
        code, when it is a relaunch), with `message` and `fields` for the run, in one transaction."""
        run_dir = self.settings.runs_dir / run.id
        n = len(run.attempts) + 1
        log_path, exit_path = self.attempt_files(run.id, n)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        exit_path.unlink(missing_ok=True)
        kept = ""
        carry: int | None = None
        message = run.message if message is None else message

        def end_and(**run_fields: object) -> None:
            with self.registry.batch():
                if ended is not None:
                    self.registry.end_attempt(run.id, ended[0].n, ended[1])
                self.registry.update_run(run.id, **run_fields)

        if run.attempts and self.files.get(run.id).latest_checkpoint() is None:
            # The attempt starts over (job.overwrite): its predecessor's records move aside first.
            prev = run.attempts[-1].n
            try:
                moved = set_aside_records(run_dir, prev)
            except OSError as e:
                end_and(state="failed", assigned_gpus=[], message=f"not relaunched: attempt {prev}'s records could "
                        f"not be moved aside (the relaunch would delete them): {e}")
                return
            aside = run_dir / "service" / f"attempt-{prev}"
            # NOTE: a launch retried after the registry refused it finds the records moved already (and their counts
            # still to carry).
            if not moved and aside.is_dir():
                found = {p.name for p in aside.iterdir()}
                moved = [n for n in RUN_FILES if n in found] + sorted(found - set(RUN_FILES))
            if moved:
                kept = f"attempt {prev}'s {', '.join(moved)} moved to service/attempt-{prev}/"
                carry = prev if prev not in run.carried_attempts else None
        cmd = [self.settings.python, "-m", "service.child", str(exit_path), "--",
               *launch_command(self.settings, run, run_dir)]
        env = {**self.settings.child_environ(), "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
               "TITAN_K3_RUN_ID": run.id, ATTEMPT_ENV: str(exit_path),
               # torchrun signalled itself (not the service's stop, which signals the ranks) gives its workers
               # this long to save before SIGKILL; read by torch 2.13's torchrun, 30 s fixed in older ones.
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(int(self.settings.stop_timeout))}
        proc = None
        try:
            with open(log_path, "ab") as out:
                if kept:
                    out.write(f"service: no checkpoint, attempt {n} starts over at update 0; {kept}\n".encode())
                    out.flush()
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        cwd=run_dir, env=env, start_new_session=True, close_fds=True)
            start_time = psutil.Process(proc.pid).create_time()
        except (OSError, psutil.Error) as e:
            if proc is not None:  # started and gone already, or not to be found: nothing of it may stay unrecorded
                self._kill_unrecorded(proc, exit_path)
            else:  # nothing started: a restarted service must not take the log for an unrecorded attempt
                log_path.unlink(missing_ok=True)
            end_and(state="failed", assigned_gpus=[], message=f"launch failed: {e}" + (f"; {kept}" if kept else ""))
            return
        try:
            with self.registry.batch():
                if ended is not None:
                    self.registry.end_attempt(run.id, ended[0].n, ended[1])
                if carry is not None:
                    self._carry(run.id, carry)
                self.registry.add_attempt(Attempt(
                    run_id=run.id, n=n, pid=proc.pid, pid_start_time=start_time, started_at=time.time(),
                    ended_at=None, exit_code=None, assigned_gpus=gpus, log_path=str(log_path),
                    exit_path=str(exit_path)))
                self.registry.update_run(run.id, state="running", assigned_gpus=gpus,
                                         message=f"{message}; {kept}" if kept else message, **fields)
        except Exception as e:
            # NOTE: an attempt the registry does not hold must not run: a restarted service would not find it, and
            # the launch is tried again (it would train beside its twin in the same run directory). So whatever
            # failed (the registry, or counting the events of the attempt it follows), it is killed first. The
            # service ending here (no handler runs) leaves it to `recover`, which kills and records it.
            self._kill_unrecorded(proc, exit_path)
            log_path.unlink(missing_ok=True)
            if isinstance(e, sqlite3.Error) and is_transient(e):
                raise
            why = f"attempt {n} could not be recorded, so it was killed ({type(e).__name__}: {e})"
            log.error("run %s: %s", run.id, why)
            end_and(state="failed", assigned_gpus=[], message=f"{message}; {why}; resume to try again"
                    if ended is not None else f"launch failed: {why}; resume to try again")
            return
        if kept:
            self.files.forget(run.id)  # its counts now start from the registry's carried ones
        self._children[run.id] = proc
        log.info("run %s attempt %d started: pid %d, CUDA_VISIBLE_DEVICES=%s", run.id, n, proc.pid, gpus)

    @staticmethod
    def _kill_unrecorded(proc: subprocess.Popen, exit_path: Path) -> None:
        """Kill an attempt the registry does not hold: its wrapper first (it starts nothing more), then what it
        started."""
        proc.kill()
        proc.wait()
        kill_processes(attempt_processes_of(str(exit_path)))

    # ---- requests --------------------------------------------------------------------------------

    def stop(self, run_id: str) -> Run:
        with self.registry.lock:
            run = self._require(run_id)
            if run.state == "queued":
                self.registry.update_run(run_id, state="stopped", stop_requested_at=time.time(),
                                         message="stopped before it started")
            elif run.state == "running":
                self.registry.update_run(run_id, state="stopping", stop_requested_at=time.time(),
                                         message="SIGTERM sent; waiting for the checkpoint")
                a = run.last_attempt
                assert a is not None
                self._kill(run_id, a, signal.SIGTERM)
            elif run.state != "stopping":
                raise Conflict(f"run {run_id!r} is {run.state}; only queued or running runs can be stopped")
            return self._require(run_id)

    def resume(self, run_id: str) -> Run:
        """Queue a stopped, failed or lost run again; refused when it trained and kept no checkpoint to go on from."""
        with self.registry.lock:
            run = self._require(run_id)
            if run.state not in RESUMABLE:
                raise Conflict(f"run {run_id!r} is {run.state}; resume needs one of {', '.join(RESUMABLE)}")
            files = self.files.get(run_id)
            ckpt, trained = files.latest_checkpoint(), files.progress_step()
            if ckpt is None and trained > 0:
                raise Conflict(f"run {run_id!r} trained {trained} update(s) but kept no checkpoint (its last attempt "
                               "ended before saving one); resuming would start over at update 0: create a new run")
            where = f"continues from {ckpt}" if ckpt else "starts from update 0 (nothing was trained)"
            self.registry.update_run(run_id, state="queued", restarts=0, stop_requested_at=None,
                                     message=f"resume requested; {where}")
        self.wake()
        return self._require(run_id)

    def delete(self, run_id: str, remove_files: bool) -> None:
        """Forget a run: an active attempt's processes are killed (no stop checkpoint), then its registry rows go;
        with `remove_files` its run directory too."""
        with self.registry.lock:
            run = self._require(run_id)
            a = run.last_attempt
            if a is not None and a.ended_at is None:
                # NOTE: recorded before the kill: should the registry refuse what follows, the supervisor settles the
                # killed attempt as stopped (the request's), not relaunches it as a crash.
                self.registry.update_run(run_id, stop_requested_at=time.time(), message="killed by DELETE")
                self._kill(run_id, a, signal.SIGKILL)
                proc = self._children.pop(run_id, None)
                if proc is not None and proc.pid == a.pid:
                    with contextlib.suppress(subprocess.TimeoutExpired):  # reaped by the OS if it lingers
                        proc.wait(timeout=10)
            self._doomed.pop(run_id, None)
            if remove_files:
                try:
                    shutil.rmtree(self.settings.runs_dir / run_id)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    # NOTE: the run stays (a DELETE can be repeated; forgotten, its kept files would hold the name
                    # with no run left to delete); killed, it is settled as stopped, not relaunched as a crash.
                    path = Path(e.filename or self.settings.runs_dir / run_id)
                    where = path.relative_to(self.settings.state_dir) if path.is_relative_to(self.settings.state_dir) \
                        else f"runs/{run_id}"
                    line = f"DELETE could not remove {where} ({e.strerror}); the run is kept"
                    if a is not None and a.ended_at is None:
                        self.registry.update_run(run_id, message=line)
                    raise FilesKept(f"{line}: DELETE again once it can go, or without files=true") from None
            self.registry.delete_run(run_id)
            self.files.forget(run_id)
        self.wake()

    def _require(self, run_id: str) -> Run:
        run = self.registry.get(run_id)
        if run is None:
            raise KeyError(run_id)
        return run

    # ---- signals ---------------------------------------------------------------------------------

    def _kill(self, run_id: str, a: Attempt, sig: signal.Signals) -> None:
        """Signal the attempt's trainer processes.

        torchrun starts each worker in a session of its own. SIGTERM goes to those worker
        groups, so the ranks checkpoint and exit 0 and torchrun then exits with their status
        (a torchrun that is itself signalled exits non-zero and kills slow workers after 30 s).
        With no such groups (the 'python' launcher, or torchrun still starting) SIGTERM goes to
        the attempt's own group. SIGKILL goes to every group and every process ever seen in the tree.
        """
        if not process_alive(a.pid, a.pid_start_time):
            if sig == signal.SIGKILL:
                kill_leftovers(a)
            return
        try:
            tree = psutil.Process(a.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        doomed = self._doomed.setdefault(run_id, [])
        known = {p.pid for p in doomed}
        doomed.extend(p for p in tree if p.pid not in known)
        groups = set()
        for p in tree:
            with contextlib.suppress(OSError):  # a process that exited meanwhile has no group left to signal
                groups.add(os.getpgid(p.pid))
        worker_groups = groups - {a.pid}
        targets = {a.pid} | groups if sig == signal.SIGKILL else (worker_groups or {a.pid})
        for pgid in targets:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
                os.killpg(pgid, sig)
        if sig == signal.SIGKILL:
            self._reap_leftovers(run_id, a)
            kill_leftovers(a)

    def _reap_leftovers(self, run_id: str, a: Attempt) -> None:
        for p in self._doomed.pop(run_id, []):
            with contextlib.suppress(psutil.Error):  # it exited between the check and the kill
                if p.is_running():  # psutil checks the start time: never a reused pid
                    p.kill()
