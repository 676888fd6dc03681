"""A service that dies inside a launch never leaves a run to be launched twice.

A launch starts the attempt's processes, then records the attempt and marks the run running in one transaction.
The service is made to die between the two (the registry write raises), or its registry is left as an older service
that wrote them apart left it, and a new supervisor over the same state dir takes over: a recorded attempt is
re-adopted, not launched again beside itself; an unrecorded one is killed and recorded, and the next attempt is
launched in its place. An unrecorded relaunch (after a crash) is recorded with the crash, and counted as a restart.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from typing import Iterator

import pytest

from service.registry import Registry
from service.rundir import RunFilesCache
from service.settings import Settings
from service.attempts import processes_by_attempt, read_exit
from service.supervisor import Supervisor
from service_harness import HERE, gone, wait_until

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = {steps}\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


class ServiceDied(BaseException):
    """The service process ending at this point (nothing after it runs)."""


@pytest.fixture
def settings(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the fake trainer
    monkeypatch.setenv("FAKE_TRAINER_STEP_SECONDS", "0.05")
    (tmp_path / "state").mkdir()
    return Settings(state_dir=tmp_path / "state", token="x", gpus=0, launcher="python", trainer_module="fake_trainer")


def submit(settings: Settings, reg: Registry, run_id: str, steps: int, overrides: dict[str, str] | None = None) -> None:
    run_dir = settings.runs_dir / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "submitted.toml").write_text(INLINE.format(steps=steps))
    reg.insert_run(run_id, "inline", overrides or {}, 1, 0, 2)


def die_at(monkeypatch, reg: Registry, method: str, when=lambda *a, **kw: True) -> None:
    real = getattr(reg, method)

    def dying(*args, **kwargs):
        if when(*args, **kwargs):
            raise ServiceDied(method)
        return real(*args, **kwargs)

    monkeypatch.setattr(reg, method, dying)


def tagged(settings: Settings, run_id: str) -> dict[str, list]:
    """The live processes of each of the run's attempts, by attempt file name."""
    prefix = str(settings.runs_dir / run_id)
    return {tag.rsplit("/", 1)[1]: procs for tag, procs in processes_by_attempt().items() if tag.startswith(prefix)}


@contextlib.contextmanager
def restarted(settings: Settings, run_id: str) -> Iterator[Registry]:
    """The restarted service's registry over the state dir; when the block ends, however it ends, every live process
    of the run's attempts is killed and the registry closed."""
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        yield reg
    finally:
        for procs in tagged(settings, run_id).values():
            for p in procs:
                p.kill()
        reg.close()


def finish(sup: Supervisor, run_id: str, timeout: float = 60) -> None:
    def done():
        sup.tick()
        return sup.registry.get(run_id).state not in ("queued", "running")
    wait_until(done, timeout, f"run {run_id} to end", interval=0.1)


def test_a_queued_run_with_a_recorded_attempt_is_readopted(settings):
    """A service that recorded the attempt and the run's state in two writes (they are one transaction now) and died
    between them left a queued run holding a started attempt: the restarted service re-adopts it."""
    reg = Registry(settings.state_dir / "registry.sqlite3")
    submit(settings, reg, "r", steps=40)
    Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).tick()
    reg.close()
    with sqlite3.connect(settings.state_dir / "registry.sqlite3") as con:
        con.execute("UPDATE runs SET state = 'queued', message = '' WHERE id = 'r'")
    assert list(tagged(settings, "r")) == ["attempt-1.exit"]

    with restarted(settings, "r") as reg:
        assert reg.get("r").state == "queued" and len(reg.get("r").attempts) == 1
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.recover()
        run = reg.get("r")
        assert run.state == "running" and "attempt 1 re-adopted" in run.message, run.message
        sup.tick()  # the scheduler: nothing queued to launch
        assert len(reg.get("r").attempts) == 1 and list(tagged(settings, "r")) == ["attempt-1.exit"]
        finish(sup, "r")
        run = reg.get("r")
        assert run.state == "finished" and [a.exit_code for a in run.attempts] == [0], run.message
        steps = [json.loads(line)["step"] for line in (settings.runs_dir / "r" / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 41))  # one training, never a second one beside it


def test_died_before_recording_the_attempt_kills_it_and_launches_the_next(settings, monkeypatch):
    reg = Registry(settings.state_dir / "registry.sqlite3")
    submit(settings, reg, "u", steps=20)
    die_at(monkeypatch, reg, "add_attempt")
    with pytest.raises(ServiceDied):
        Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).tick()
    reg.close()
    run_dir = settings.runs_dir / "u"
    wait_until(lambda: "step 2 " in (run_dir / "stdout.log").read_text() if (run_dir / "stdout.log").exists()
               else False, 60, "the unrecorded attempt to train")
    orphans = tagged(settings, "u")["attempt-1.exit"]
    assert len(orphans) == 2  # the attempt wrapper and the trainer

    with restarted(settings, "u") as reg:
        assert reg.get("u").state == "queued" and reg.get("u").attempts == []
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.recover()
        assert all(gone(p.pid, 10) for p in orphans)
        run = reg.get("u")
        assert run.state == "queued" and [(a.n, a.ended_at is not None) for a in run.attempts] == [(1, True)]
        assert run.message == "attempt 1 started as the service went down and was never recorded " \
                              "(2 process(es) of it killed); queued again", run.message
        assert run.attempts[0].pid == min(p.pid for p in orphans)  # the wrapper, started first
        finish(sup, "u")
        run = reg.get("u")
        assert run.state == "finished" and [a.exit_code for a in run.attempts] == [None, 0], run.message
        # attempt 2 started over in the run directory; what attempt 1 wrote was moved aside, not deleted
        assert "step 2 " in (run_dir / "service" / "attempt-1" / "stdout.log").read_text()
        steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 21))


def test_a_queued_run_never_launched_is_left_alone_by_recover(settings):
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "q", steps=2)
        t0 = time.time()
        Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).recover()
        run = reg.get("q")
        assert run.state == "queued" and run.attempts == [] and run.message == ""
        assert time.time() - t0 < 5
    finally:
        reg.close()


def test_a_launch_that_started_nothing_leaves_no_log_for_recover_to_mistake(settings):
    settings.python = str(settings.state_dir / "no-such-python")
    reg = Registry(settings.state_dir / "registry.sqlite3")
    try:
        submit(settings, reg, "nolaunch", steps=2)
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.tick()
        run = reg.get("nolaunch")
        assert run.state == "failed" and run.message.startswith("launch failed: "), run.message
        assert not (settings.runs_dir / "nolaunch" / "service" / "attempt-1.log").exists()
        sup.resume("nolaunch")
        Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).recover()  # a restart before the launch
        assert reg.get("nolaunch").attempts == []
    finally:
        reg.close()


def die_relaunching(settings: Settings, monkeypatch, run_id: str, steps: int, overrides: dict[str, str]) -> None:
    """Submit a run whose first attempt crashes; the service dies recording the relaunch, attempt 2 started."""
    reg = Registry(settings.state_dir / "registry.sqlite3")
    submit(settings, reg, run_id, steps, {"debug.crash_at_step": "3", **overrides})
    die_at(monkeypatch, reg, "add_attempt", when=lambda a: a.n == 2)
    sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
    with pytest.raises(ServiceDied):
        wait_until(sup.tick, 60, "the first attempt's crash")
    reg.close()


def trainings(settings: Settings, run_id: str, n: int) -> int:
    """How many trainings attempt `n`'s console log shows starting."""
    return (settings.runs_dir / run_id / "service" / f"attempt-{n}.log").read_text().count("fake trainer | run")


def test_a_relaunch_that_died_unrecorded_and_crashed_meanwhile_is_recorded_and_counted(settings, monkeypatch):
    die_relaunching(settings, monkeypatch, "c", steps=50, overrides={})
    exit_2 = settings.runs_dir / "c" / "service" / "attempt-2.exit"
    wait_until(lambda: read_exit(str(exit_2)) == 3, 60, "the unrecorded relaunch to crash as attempt 1 did")

    with restarted(settings, "c") as reg:
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.recover()
        run = reg.get("c")
        # the relaunch is attempt 2, with the status it crashed with, and the next relaunch is restart 2 of 2
        assert [(a.n, a.exit_code) for a in run.attempts] == [(1, 3), (2, 3), (3, None)], run.message
        assert (run.state, run.restarts, run.restarts_total) == ("running", 2, 2), run.message
        assert run.message.startswith("attempt 2 exited with code 3; restart 2 of 2, "), run.message
        finish(sup, "c")
        run = reg.get("c")
        assert run.state == "failed" and [a.exit_code for a in run.attempts] == [3, 3, 3], run.message
        # every relaunch that trained is counted, and none trained beside another in one attempt
        assert [trainings(settings, "c", n) for n in (2, 3)] == [1, 1]
        assert run.restarts_total == 2


def test_a_relaunch_that_died_unrecorded_still_running_is_killed_counted_and_queued_again(settings, monkeypatch):
    # attempt 2 resumes from attempt 1's checkpoint at its crash step, and trains on past it
    die_relaunching(settings, monkeypatch, "k", steps=200,
                    overrides={"checkpoint.enable": "true", "checkpoint.interval": "3"})
    log_2 = settings.runs_dir / "k" / "service" / "attempt-2.log"
    wait_until(lambda: "step 5 " in log_2.read_text(), 60, "the unrecorded relaunch to train")
    orphans = tagged(settings, "k")["attempt-2.exit"]

    with restarted(settings, "k") as reg:
        sup = Supervisor(settings, reg, RunFilesCache(settings.runs_dir))
        sup.recover()
        assert all(gone(p.pid, 1) for p in orphans) and tagged(settings, "k") == {}  # killed, no relaunch beside
        run = reg.get("k")
        assert [(a.n, a.exit_code) for a in run.attempts] == [(1, 3), (2, None)], run.message
        assert (run.state, run.restarts, run.restarts_total) == ("queued", 1, 1), run.message
        assert run.message == ("attempt 1 exited with code 3; restart 1 of 2: attempt 2 started as the service went "
                               "down and was never recorded (2 process(es) of it killed); queued again"), run.message
        finish(sup, "k")
        run = reg.get("k")
        # attempt 3 takes the killed relaunch's place (a launch from the queue, not a restart)
        assert run.state == "finished" and [a.exit_code for a in run.attempts] == [3, None, 0], run.message
        assert run.restarts_total == 1
