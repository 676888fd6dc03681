"""Supervisor pieces without a server: pid-reuse-safe liveness, recovery after a restart, argv."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import psutil

from service.registry import Attempt, Registry
from service.rundir import RunFilesCache
from service.settings import Settings
from service.attempts import launch_command, process_alive
from service.supervisor import Supervisor


def sleeper() -> tuple[subprocess.Popen, float]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return p, psutil.Process(p.pid).create_time()


def test_process_alive_needs_the_recorded_start_time():
    p, start = sleeper()
    try:
        assert process_alive(p.pid, start)
        assert not process_alive(p.pid, start - 5.0)  # same pid, another process (a reused pid)
    finally:
        p.kill()
        p.wait()
    assert not process_alive(p.pid, start)


def test_recover_readopts_live_attempts_and_settles_the_rest(tmp_path):
    settings = Settings(state_dir=tmp_path, token="x", gpus=2)
    reg = Registry(tmp_path / "registry.sqlite3")
    with sqlite3.connect(tmp_path / "registry.sqlite3") as con:
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    live, start = sleeper()
    try:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        cases = {
            # run id: (state, pid, start time, exit-file text, stop requested)
            "alive": ("running", live.pid, start, None, False),
            "reused-pid": ("running", live.pid, start - 5.0, None, False),
            "ended-ok": ("running", dead.pid, 1.0, "0", False),
            "stopped-while-away": ("stopping", dead.pid, 1.0, "0", True),
            "crashed-while-away": ("running", dead.pid, 1.0, "1", False),
            "vanished": ("running", dead.pid, 1.0, None, False),
        }
        for i, (run_id, (state, pid, t0, exit_text, stop)) in enumerate(cases.items()):
            # NOTE: no restarts left: a crash while away fails it (a relaunch is test_service_lifecycle's)
            reg.insert_run(run_id, "inline", {}, 1, 1, 0 if run_id == "crashed-while-away" else 2)
            exit_path = tmp_path / f"{run_id}.exit"
            if exit_text is not None:
                exit_path.write_text(exit_text + "\n")
            reg.add_attempt(Attempt(run_id, 1, pid, t0, time.time(), None, None, [i % 2], "", str(exit_path)))
            reg.update_run(run_id, state=state, assigned_gpus=[i % 2], stop_requested_at=time.time() if stop else None)
        Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).recover()
        got = {r.id: r for r in reg.list()}
        assert {k: r.state for k, r in got.items()} == {
            "alive": "running", "reused-pid": "lost", "ended-ok": "finished", "stopped-while-away": "stopped",
            "crashed-while-away": "failed", "vanished": "lost"}
        assert got["crashed-while-away"].message == "attempt 1 exited with code 1; restart limit 0 reached"
        assert got["alive"].assigned_gpus == [0] and got["alive"].attempts[0].ended_at is None
        assert got["ended-ok"].attempts[0].exit_code == 0 and got["vanished"].attempts[0].exit_code is None
        assert all(r.assigned_gpus == [] for k, r in got.items() if k != "alive")
        assert Supervisor(settings, reg, RunFilesCache(settings.runs_dir)).used_gpus() == {0}
    finally:
        live.kill()
        live.wait()
        reg.close()


def test_launch_command_is_an_argument_list_with_overrides_verbatim(tmp_path):
    settings = Settings(state_dir=tmp_path, token="x", gpus=0)
    reg = Registry(tmp_path / "registry.sqlite3")
    reg.insert_run("r1", "inline", {"job.description": "a b; rm -rf / $(x)", "training.steps": "6"}, 2, 0, 0)
    run = reg.get("r1")
    argv = launch_command(settings, run, tmp_path / "runs" / "r1")
    # every run saves on stop, and its metrics endpoint listens where the service does (loopback here)
    assert argv[argv.index("--checkpoint.save_on_stop") + 1] == "true"
    assert argv[argv.index("--metrics.prometheus_host") + 1] == "127.0.0.1"
    assert argv[:8] == [settings.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        "-m", "titan_k3.train"]
    i = argv.index("--job.description")
    assert argv[i + 1] == "a b; rm -rf / $(x)"
    assert argv[argv.index("--job.name") + 1] == "r1"
    assert argv[argv.index("--job.dump_folder") + 1] == str(tmp_path / "runs")
    # every run of the service shares one kernel cache: a restarted run loads instead of compiling
    assert argv[argv.index("--compile.cache_dir") + 1] == str(tmp_path / "compile-cache")
    reg.close()


def test_limits_and_read_side_come_from_the_host(tmp_path):
    cpu = Settings(state_dir=tmp_path, token="x", gpus=0)
    assert cpu.max_running == 1 and cpu.read_auth == "off" and cpu.cpus >= 1
    assert {"127.0.0.1", "localhost"} <= set(cpu.allowed_hosts)
    four = Settings(state_dir=tmp_path, token="x", gpus=4, host="0.0.0.0", advertise_host="k3-service")
    assert four.max_running == 4 and four.read_auth == "on" and "k3-service" in four.allowed_hosts
    assert four.metrics_host == "0.0.0.0"
    assert Settings(state_dir=tmp_path, token="x", gpus=4, max_running=0).max_running == 0  # no limit
    assert Settings(state_dir=tmp_path, token="x", gpus=0, host="0.0.0.0", read_auth="off").read_auth == "off"
    assert Settings(state_dir=tmp_path, token="x", gpus=0).grace_seconds > Settings(state_dir=tmp_path, token="x",
                                                                                     gpus=0).stop_timeout >= 120


def test_token_from_file_env_or_generated(tmp_path, monkeypatch):
    from service.settings import parse_args

    monkeypatch.setenv("K3_SERVICE_TOKEN", "from-env")
    assert parse_args(["--state-dir", str(tmp_path / "a"), "--gpus", "0"]).ensure_token() == "from-env"
    (tmp_path / "tok").write_text("from-file\n")
    s = parse_args(["--state-dir", str(tmp_path / "a"), "--gpus", "0", "--token-file", str(tmp_path / "tok")])
    assert s.ensure_token() == "from-file" and s.host == "127.0.0.1"
    monkeypatch.delenv("K3_SERVICE_TOKEN")
    s = parse_args(["--state-dir", str(tmp_path / "b"), "--gpus", "0"])
    token = s.ensure_token()
    assert len(token) >= 32 and (tmp_path / "b" / "token").stat().st_mode & 0o077 == 0
    assert parse_args(["--state-dir", str(tmp_path / "b"), "--gpus", "0"]).ensure_token() == token


def test_every_string_config_key_is_classified_for_path_checks():
    """A new string key may be a path a request could point outside the state dir: decide, then list it here."""
    import dataclasses
    import typing

    from titan_k3.config import JobConfig

    checked = {"checkpoint.folder", "checkpoint.initial_load_path", "eval.tasks", "data.dataset", "data.tokenizer"}
    # set by the service, refused as overrides
    reserved = {"job.config_file", "job.dump_folder", "job.name", "compile.cache_dir", "metrics.prometheus_host"}
    not_paths = {"job.description", "model.name", "model.flavor", "data.mixture", "training.context_stages"}
    strings = set()
    for section in dataclasses.fields(JobConfig):
        cls = typing.get_type_hints(JobConfig)[section.name]
        for name, tp in typing.get_type_hints(cls).items():
            if tp is str:
                strings.add(f"{section.name}.{name}")
    assert strings == checked | reserved | not_paths, (
        f"unclassified: {sorted(strings - checked - reserved - not_paths)}; "
        "paths must be checked in service/app.py Service._check_paths")


def test_a_config_error_under_torchrun_is_read_from_its_failure_summary(tmp_path):
    """torchrun exits 1 whatever its workers' statuses; the service reads theirs from torchrun's summary."""
    from service.attempts import config_error

    script = tmp_path / "worker.py"
    script.write_text("import sys\nprint(\"error: config key 'data.mixture' = 'web:1': unknown source(s)\", "
                      "file=sys.stderr)\nsys.exit(int(sys.argv[1]))\n")

    def attempt(status: int) -> tuple[Attempt, int]:
        log = tmp_path / f"attempt-{status}.log"
        with open(log, "wb") as out:
            code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                   "1", str(script), str(status)], stdout=out, stderr=subprocess.STDOUT,
                                  timeout=300).returncode
        return Attempt("r", 1, 0, 0.0, 0.0, None, None, [], str(log), ""), code

    a, code = attempt(2)
    assert code == 1
    assert config_error("torchrun", a, code) == "config key 'data.mixture' = 'web:1': unknown source(s)"
    crashed, code = attempt(3)
    assert code == 1 and config_error("torchrun", crashed, code) is None
    assert config_error("python", crashed, 2) == "config key 'data.mixture' = 'web:1': unknown source(s)"
