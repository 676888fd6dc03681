"""The counters the service exports never go down: not when an attempt starts over (its events.jsonl moves to
service/attempt-<n>/), not when the service restarts over the same registry, not when a run is deleted.

Prometheus reads a counter that goes down as a reset, so increase() and rate() over it (the restart alert, the
fallback alert) would count what was already counted, or miss what happened.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

from service.registry import Registry
from service.settings import Settings
from service.rundir import RunFilesCache, tally_events
from service.attempts import set_aside_records
from service.supervisor import Supervisor
from service_harness import wait_until

PROMTOOL = shutil.which("promtool")
INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


def counters(text: str) -> dict[str, float]:
    """Every sample of a counter family (TYPE counter) in an exposition, by its name and labels."""
    kinds = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if kinds.get(series.split("{", 1)[0]) == "counter":
                out[series] = float(value)
    return out


def went_down(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[float, float | None]]:
    return {k: (v, after.get(k)) for k, v in before.items() if k in after and after[k] < v}


def promtool_ok(text: str) -> None:
    if PROMTOOL is None:
        return
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def test_counters_survive_attempts_that_start_over_and_a_service_restart(make_service):
    svc = make_service(fake=True, step_seconds=0.05)
    body = {"toml": INLINE, "name": "again", "restart_limit": 2, "overrides": {"debug.crash_at_step": 2}}
    assert svc.create(**body).status_code == 201
    seen: list[dict[str, float]] = []

    def failed() -> bool:
        seen.append(counters(svc.metrics_text()))
        return svc.run("again")["state"] == "failed"

    wait_until(failed, 60, "the run to fail after its restarts", interval=0.02)
    run = svc.run("again")
    assert run["exit_codes"] == [3, 3, 3], run["message"]
    # every attempt started over at update 0 and wrote one kernel report, each now in its own events.jsonl
    kernel = 'titan_k3_run_events_total{kind="kernel_report",run="again"}'
    text = svc.metrics_text()
    final = counters(text)
    assert final[kernel] == 3 and run["events"]["kernel_report"] == 3, (final, run["events"])
    assert final['titan_k3_service_run_restarts_total{run="again"}'] == 2
    for before, after in zip(seen, seen[1:] + [final]):
        assert not went_down(before, after)
    promtool_ok(text)

    # the service restarts over the same registry; the attempts' set-aside files are cleaned away meanwhile:
    # the counts come from the registry, not from those files
    svc.kill()
    shutil.rmtree(svc.state_dir / "runs" / "again" / "service" / "attempt-1")
    svc.start()
    text = svc.metrics_text()
    assert not went_down(final, counters(text)), went_down(final, counters(text))
    assert counters(text)[kernel] == 3
    promtool_ok(text)

    # a deleted run takes its series with it, never the service's total with it
    assert svc.client.delete("/v1/runs/again", headers=svc.auth).status_code == 200
    after = counters(svc.metrics_text())
    assert after["titan_k3_service_restarts_total"] == 2 and not any('run="again"' in k for k in after)
    svc.kill()
    svc.start()
    assert counters(svc.metrics_text())["titan_k3_service_restarts_total"] == 2


def events_line(kind: str, **extra: object) -> str:
    return json.dumps({"step": 1, "kind": kind, "message": kind, **extra}) + "\n"


def test_a_service_that_died_between_the_set_aside_and_the_registry_counts_it_on_restart(tmp_path):
    """The set-aside (a file move) and the registry write are two steps; a restart in between reads the counts
    from the moved events.jsonl, once."""
    settings = Settings(state_dir=tmp_path, token="x", gpus=0)
    reg = Registry(tmp_path / "registry.sqlite3")
    try:
        reg.insert_run("r", "inline", {}, 1, 0, 2)
        reg.update_run("r", state="failed")
        run_dir = settings.runs_dir / "r"
        run_dir.mkdir(parents=True)
        (run_dir / "events.jsonl").write_text(
            events_line("kernel_report") + events_line("invariant_violation", check="loss.finite") * 2)
        set_aside_records(run_dir, 1)  # the service dies here, before the registry hears of it
        (run_dir / "events.jsonl").write_text(events_line("kernel_report"))
        for _ in range(2):  # two restarts: the moved file is counted once
            files = RunFilesCache(settings.runs_dir, reg.carried)
            Supervisor(settings, reg, files).recover()
            counts = files.get("r").events()
            assert counts["counts"] == {"kernel_report": 2, "invariant_violation": 2}, counts
            assert counts["invariant_violations"]["by_check"] == {"loss.finite": 2}
            assert counts["invariant_violations"]["total"] == 2
    finally:
        reg.close()


def test_no_scrape_during_a_set_aside_sees_a_count_go_down(tmp_path):
    """A reader holding the run's files from before the set-aside keeps its counts; one made after sees the
    registry's carried counts plus the new file."""
    reg = Registry(tmp_path / "registry.sqlite3")
    try:
        reg.insert_run("r", "inline", {}, 1, 0, 2)
        run_dir = tmp_path / "runs" / "r"
        run_dir.mkdir(parents=True)
        (run_dir / "events.jsonl").write_text(events_line("fallback") * 3)
        cache = RunFilesCache(tmp_path / "runs", reg.carried)
        old = cache.get("r")
        assert old.event_counts() == {"fallback": 3}
        (run_dir / "events.jsonl").open("a").write(events_line("fallback"))  # not read by `old` yet
        set_aside_records(run_dir, 1)
        assert old.event_counts() == {"fallback": 3}  # the file went: what it read stays
        reg.carry("r", 1, *tally_events(run_dir / "service" / "attempt-1" / "events.jsonl"))
        cache.forget("r")
        assert cache.get("r").event_counts() == {"fallback": 4}
    finally:
        reg.close()
