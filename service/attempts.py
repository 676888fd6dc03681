"""One attempt of a run, seen from outside: its launch command, its processes, how it ended, its records.

An attempt is `python -m service.child EXIT_FILE -- <launch command>`; every process it starts carries ATTEMPT_ENV
(its exit file's path) in its environment, so that its processes are found and killed even once their parents are
gone. Its end is read from the exit file the wrapper writes, and the trainer's configuration error (which no relaunch
would mend) from its console log, under torchrun from the failure summary. The Supervisor (service/supervisor.py)
decides what to do with each.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import psutil

from service.registry import Attempt, Run
from service.rundir import tail_lines
from service.settings import Settings
from titan_k3.config.check import CONFIG_ERROR_EXIT
from titan_k3.config.run_files import RUN_FILE_PATTERNS, RUN_FILES, RUN_FOLDERS

START_TIME_TOLERANCE_S = 0.05
"""Seconds a process's start time may differ from the recorded one and still be the attempt's (a reused pid has
another start time)."""
ATTEMPT_ENV = "K3_SERVICE_ATTEMPT"
"""Set in every attempt's environment to its exit file's path (unique per service, run and attempt): every process
the attempt starts inherits it, so its leftovers are found even once their parents are gone."""
# torchrun's failure summary names each failed worker's status ("exitcode  : 2 (pid: ...)"); torchrun itself exits 1.
_WORKER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)
_ERROR_LINE = re.compile(r"(?:^|\s)error: (.+)$")
_WORKER_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")


def launch_command(settings: Settings, run: Run, run_dir: Path) -> list[str]:
    """The trainer's argument list for one attempt (never a shell string)."""
    if settings.launcher == "torchrun":
        head = [settings.python, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(run.nproc_per_node), "-m", settings.trainer_module]
    else:
        head = [settings.python, "-m", settings.trainer_module]
    args = ["--job.config_file", str(run_dir / "submitted.toml"), *settings.run_args(run.id)]
    for key, value in run.overrides.items():
        args += [f"--{key}", value]
    if run.attempts:
        # NOTE: a later attempt (a relaunch after a crash, a resume) reuses the run directory. With a checkpoint the
        # trainer resumes it whatever job.overwrite says; without one, the earlier attempt's files would make it
        # refuse the name ("holds a previous run and nothing to resume"), so it starts over at update 0 in their
        # place. Last, so that it wins over the request's own job.overwrite.
        args += ["--job.overwrite", "true"]
    return head + args


def process_alive(pid: int, start_time: float) -> bool:
    """True when `pid` runs and is the process we started (same start time), not a zombie."""
    try:
        p = psutil.Process(pid)
        return abs(p.create_time() - start_time) < START_TIME_TOLERANCE_S and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def config_error(launcher: str, a: Attempt, code: int | None) -> str | None:
    """The trainer's one-line configuration error when attempt `a` ended with one, else None."""
    tail = tail_lines(Path(a.log_path), 200)
    if code != CONFIG_ERROR_EXIT:
        codes = {int(c) for c in _WORKER_EXIT.findall("\n".join(tail))}
        if not (launcher == "torchrun" and code == 1 and codes == {CONFIG_ERROR_EXIT}):
            return None
    errors = [m.group(1) for m in map(_ERROR_LINE.search, tail) if m]
    return errors[-1].strip() if errors else f"exit status {CONFIG_ERROR_EXIT}"


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def describe_exit(launcher: str, a: Attempt, code: int | None) -> str:
    """How attempt `a` ended, in words: its status or signal, and under torchrun each failed rank's (torchrun
    itself exits 1 whatever killed a rank; its failure summary names the rank and the signal)."""
    if code is None:
        return f"attempt {a.n} ended without an exit status (its wrapper was killed)"
    text = f"attempt {a.n} {_status(code)}"
    if launcher != "torchrun" or code <= 0:
        return text
    ranks: list[str] = []
    rank = None
    for line in tail_lines(Path(a.log_path), 200):
        if m := _WORKER_RANK.match(line):
            rank = m.group(1)
        elif (m := _WORKER_EXIT.match(line)) and rank is not None:
            ranks.append(f"rank {rank} {_status(int(m.group(1)))}")
            rank = None
    return f"{text} ({', '.join(dict.fromkeys(ranks))})" if ranks else text


def attempt_processes(a: Attempt) -> list[psutil.Process]:
    """The processes of attempt `a` still running, wherever they now hang in the process tree, but its wrapper
    (the service's own child: `Popen` reaps it and reads its status)."""
    return [p for p in attempt_processes_of(a.exit_path) if p.pid != a.pid]


def attempt_processes_of(exit_path: str) -> list[psutil.Process]:
    """The running processes tagged with the attempt whose exit file is `exit_path`."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # exited meanwhile, or another user's process
            if p.environ().get(ATTEMPT_ENV) == exit_path:
                found.append(p)
    return found


def processes_by_attempt() -> dict[str, list[psutil.Process]]:
    """Every running process that carries ATTEMPT_ENV, by its value (an attempt's exit file), in one scan."""
    found: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # exited meanwhile, or another user's process
            tag = p.environ().get(ATTEMPT_ENV)
            if tag:
                found.setdefault(tag, []).append(p)
    return found


def kill_processes(procs: list[psutil.Process], timeout: float = 10.0) -> int:
    """SIGKILL `procs` and wait for them to go; how many there were."""
    for p in procs:
        with contextlib.suppress(psutil.Error):  # exited between the scan and the kill
            p.kill()
    psutil.wait_procs(procs, timeout=timeout)
    return len(procs)


def kill_leftovers(a: Attempt, timeout: float = 10.0) -> int:
    """SIGKILL what is left of attempt `a` and wait for it to go; the number of processes killed.

    NOTE: a wrapper or torchrun killed from outside leaves its ranks running, reparented: the next attempt
    (a relaunch, a resume) would train beside them in the same run directory.
    """
    return kill_processes(attempt_processes(a), timeout)


def set_aside_records(run_dir: Path, n: int) -> list[str]:
    """Move attempt `n`'s trainer records out of `run_dir` into `run_dir/service/attempt-<n>/`; the names moved.

    NOTE: the next attempt starts over (no checkpoint) under job.overwrite, which deletes them: the metrics,
    events and console output of a crashed attempt are what tells why it crashed. OSError when they cannot move.
    """
    found = [run_dir / name for name in RUN_FILES if (run_dir / name).is_file()]
    found += sorted(p for pattern in RUN_FILE_PATTERNS for p in run_dir.glob(pattern) if p.is_file())
    found += [run_dir / name for name in RUN_FOLDERS if (run_dir / name).is_dir()]
    if not found:
        return []
    dest = run_dir / "service" / f"attempt-{n}"
    dest.mkdir(parents=True, exist_ok=True)
    for path in found:
        os.replace(path, dest / path.name)
    return [p.name for p in found]


def read_exit(path: str) -> int | None:
    """The status the attempt's wrapper wrote to its exit file; None while there is none (or it cannot be read)."""
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None
