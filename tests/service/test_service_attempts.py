"""Attempts after the first, and attempts that end from outside: a relaunch or a resume without a checkpoint
starts over instead of tripping on its predecessor's files; a wrapper or launcher killed from outside leaves
no trainer behind to train beside the next attempt; the run's message names how an attempt ended (the rank
and the signal under torchrun)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil

from service.registry import Attempt, Registry
from service.rundir import RunFilesCache
from service.settings import Settings
from service.attempts import ATTEMPT_ENV, describe_exit, set_aside_records
from service.supervisor import Supervisor
from titan_k3.config.run_files import RUN_FILES, RUN_FOLDERS
from service_harness import gone, wait_until

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 5\n'


def test_a_crash_before_any_checkpoint_is_relaunched_from_update_0(fake_service):
    body = {"toml": INLINE, "name": "early-crash", "restart_limit": 1, "overrides": {"debug.crash_at_step": 2}}
    assert fake_service.create(**body).status_code == 201
    run = fake_service.wait_state("early-crash", ("failed",))
    # the relaunch trained again (and crashed again) instead of refusing the directory its first attempt wrote
    assert run["exit_codes"] == [3, 3], run["message"]
    assert run["message"] == "attempt 2 exited with code 3; restart limit 1 reached"


def test_a_relaunch_from_update_0_keeps_the_crashed_attempts_records(fake_service):
    """job.overwrite deletes the earlier attempt's metrics, events and console output; the service moves them into
    service/attempt-<n>/ first, and the new attempt's log and the run's message say so."""
    body = {"toml": INLINE, "name": "kept", "restart_limit": 1,
            "overrides": {"debug.crash_at_step": 2, "metrics.log_freq": 1}}
    assert fake_service.create(**body).status_code == 201
    run = fake_service.wait_state("kept", ("failed",))
    assert run["exit_codes"] == [3, 3], run["message"]
    run_dir = fake_service.state_dir / "runs" / "kept"
    kept = run_dir / "service" / "attempt-1"
    assert sorted(p.name for p in kept.iterdir()) == ["config.toml", "events.jsonl", "manifest.json",
                                                      "metrics.jsonl", "stdout.log"]
    assert [json.loads(line)["step"] for line in (kept / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "crashing at step 2" in (kept / "stdout.log").read_text()
    assert "kernel_report" in (kept / "events.jsonl").read_text()
    # the top-level files are attempt 2's alone
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (run_dir / "stdout.log").read_text().count("crashing at step 2") == 1
    where = "attempt 1's config.toml, manifest.json, metrics.jsonl, events.jsonl, stdout.log moved to service/attempt-1/"
    first = (run_dir / "service" / "attempt-2.log").read_text().splitlines()[0]
    assert first == f"service: no checkpoint, attempt 2 starts over at update 0; {where}"
    logs = fake_service.client.get("/v1/runs/kept/logs", params={"tail": 1000}, headers=fake_service.auth).text
    assert where in logs
    assert not (run_dir / "service" / "attempt-2").exists()  # the last attempt's records stay where they are


def test_set_aside_moves_every_file_the_trainers_overwrite_deletes(tmp_path):
    from titan_k3.metrics import run_dir as trainer_run_dir

    # NOTE: memory-peak-rank0.md too (profiling.memory_peak_updates): a previous run's peak report left beside an
    # overwritten run would read as the new run's.
    names = [*RUN_FILES, "profile-rank0.txt", "trace-rank1.json.gz", "memory-peak-rank0.md",
             "events.out.tfevents.1.host"]
    for name in names:
        (tmp_path / name).write_text(name)
    for folder in RUN_FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "submitted.toml").write_text("")  # the service's own file stays
    (tmp_path / "checkpoints").mkdir()
    assert trainer_run_dir.previous_run_files(tmp_path)
    assert sorted(set_aside_records(tmp_path, 3)) == sorted([*names, *RUN_FOLDERS])
    assert trainer_run_dir.previous_run_files(tmp_path) == [] and not (tmp_path / "tensorboard").exists()
    assert sorted(p.name for p in (tmp_path / "service" / "attempt-3").iterdir()) == sorted([*names, *RUN_FOLDERS])
    assert (tmp_path / "submitted.toml").exists() and (tmp_path / "checkpoints").is_dir()
    assert set_aside_records(tmp_path, 4) == [] and not (tmp_path / "service" / "attempt-4").exists()


def test_resume_of_a_run_that_never_completed_an_update_starts_it(fake_service):
    body = {"toml": INLINE, "name": "resume-fresh", "restart_limit": 0, "overrides": {"debug.crash_at_step": 1}}
    assert fake_service.create(**body).status_code == 201
    assert fake_service.wait_state("resume-fresh", ("failed",))["exit_codes"] == [3]
    r = fake_service.client.post("/v1/runs/resume-fresh/resume", headers=fake_service.auth)
    assert r.status_code == 202 and "starts from update 0" in r.json()["message"]
    wait_until(lambda: len(fake_service.run("resume-fresh")["exit_codes"]) == 2, 30, "the resumed attempt to end")
    run = fake_service.run("resume-fresh")
    assert run["exit_codes"] == [3, 3] and "configuration error" not in run["message"], run["message"]
    assert (fake_service.state_dir / "runs" / "resume-fresh" / "service" / "attempt-1" / "stdout.log").is_file()


def test_a_killed_wrapper_leaves_no_trainer_beside_the_next_attempt(fake_service):
    body = {"toml": INLINE, "name": "orphan", "overrides": {"training.steps": 4000}}
    assert fake_service.create(**body).status_code == 201
    run = fake_service.wait_state("orphan", ("running",))
    wrapper = psutil.Process(run["attempts"][0]["pid"])
    trainer = wait_until(lambda: wrapper.children(), 30, "the trainer under the wrapper")[0]
    wrapper.kill()
    run = wait_until(lambda: (r := fake_service.run("orphan"))["attempts"][-1]["n"] == 2 and r, 30, "attempt 2")
    assert gone(trainer.pid, 5), "attempt 1's trainer still runs beside attempt 2"
    assert run["message"].startswith("attempt 1 was killed by SIGKILL; 1 leftover process(es) of it killed; "
                                     "restart 1 of 2"), run["message"]
    assert fake_service.client.post("/v1/runs/orphan/stop", headers=fake_service.auth).status_code == 202
    fake_service.wait_state("orphan", ("stopped",))


def test_a_restarted_service_kills_what_is_left_of_a_lost_attempt(tmp_path):
    settings = Settings(state_dir=tmp_path, token="x", gpus=0)
    reg = Registry(tmp_path / "registry.sqlite3")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    exit_path = str(tmp_path / "attempt-1.exit")
    leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                env={**os.environ, ATTEMPT_ENV: exit_path})
    try:
        reg.insert_run("r", "inline", {}, 1, 0, 2)
        reg.add_attempt(Attempt("r", 1, dead.pid, 1.0, time.time(), None, None, [], "", exit_path))
        reg.update_run("r", state="running")
        Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).recover()
        run = reg.get("r")
        assert run.state == "lost" and "1 leftover process(es) of it killed" in run.message, run.message
        assert gone(leftover.pid, 10)
    finally:
        leftover.kill()
        leftover.wait()
        reg.close()


def test_a_rank_killed_under_torchrun_is_named_with_its_signal(tmp_path):
    """torchrun exits 1 whatever ended a rank; the run's message names the rank and the signal from its summary."""
    script = tmp_path / "worker.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    log = tmp_path / "attempt-1.log"
    with open(log, "wb") as out:
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                               str(script)], stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    a = Attempt("r", 1, 0, 0.0, 0.0, None, None, [], str(log), "")
    assert code == 1
    assert describe_exit("torchrun", a, code) == "attempt 1 exited with code 1 (rank 0 was killed by SIGKILL)"
    assert describe_exit("python", a, -9) == "attempt 1 was killed by SIGKILL"
    assert describe_exit("python", a, None) == "attempt 1 ended without an exit status (its wrapper was killed)"
