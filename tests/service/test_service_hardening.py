"""The service under misuse (fake trainer): refusal at the door, host limits, resume that keeps its word,
DELETE, series that leave /metrics, and a closed read side."""

from __future__ import annotations

import json
import os
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ports import free_port
from service_harness import wait_until

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'
LONG = {"training.steps": 4000}


def detail(r: httpx.Response) -> str:
    body = r.json()["detail"]
    assert isinstance(body, list) and len(body) == 1, body
    return body[0]["msg"]


def run_series(svc, run_id: str) -> set[str]:
    """Names of the /metrics samples labelled with `run_id`."""
    return {s.name for fam in text_string_to_metric_families(svc.metrics_text()) for s in fam.samples
            if s.labels.get("run") == run_id}


def runs_dir(svc) -> set[str]:
    d = svc.state_dir / "runs"
    return {p.name for p in d.iterdir()} if d.exists() else set()


@pytest.mark.parametrize("overrides, toml, fragment", [
    ({"optimizer.lr": "inf"}, INLINE, "'optimizer.lr' = inf: expected a finite number"),
    ({"optimizer.lr": "nan"}, INLINE, "expected a finite number"),
    ({"training.steps": 10**30}, INLINE, "out of range"),
    ({}, INLINE + "[optimizer]\nlr = inf\n", "expected a finite number"),
    ({"data.mixture": "code:1,web:2"}, INLINE, "unknown source(s) ['web']"),
    ({"data.mixture": "code:1"}, INLINE, "no weight for source(s) ['prose']"),
    ({"nproc_per_node": 64}, INLINE, "CPU cores"),
    ({"gpus": 2}, INLINE, "this service schedules 1 GPU"),
    ({"model.flavor": "k3-mini"}, INLINE, "cannot train on CPU"),
    ({"training.device": "cuda"}, INLINE, "asks for no GPU"),
    ({"checkpoint.save_on_stop": False}, INLINE, "set by the service"),
    ({"metrics.prometheus_host": "0.0.0.0"}, INLINE, "set by the service"),
])
def test_runs_that_cannot_work_are_refused_at_the_door(fake_service_1gpu, overrides, toml, fragment):
    svc = fake_service_1gpu
    placement = {k: overrides.pop(k) for k in ("nproc_per_node", "gpus") if k in overrides}
    before = runs_dir(svc)
    r = svc.create(name="refused", toml=toml, overrides=overrides, **placement)
    assert r.status_code == 422, r.text
    assert fragment in detail(r)
    assert runs_dir(svc) == before and svc.client.get("/v1/runs/refused").status_code == 404


def test_metrics_ports_in_use_are_refused(fake_service_1gpu):
    svc = fake_service_1gpu
    r = svc.create(name="own-port", toml=INLINE, overrides={"metrics.prometheus_port": svc.port})
    assert r.status_code == 422 and "the control service's own port" in detail(r)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        r = svc.create(name="busy-port", toml=INLINE, overrides={"metrics.prometheus_port": port})
        assert r.status_code == 422 and f"cannot listen on 127.0.0.1:{port}" in detail(r)
    port = free_port()
    claims = svc.create(name="claims", toml=INLINE, overrides={**LONG, "metrics.prometheus_port": port})
    assert claims.status_code == 201
    r = svc.create(name="claims-too", toml=INLINE, overrides={"metrics.prometheus_port": port})
    assert r.status_code == 422 and "already claimed by run 'claims'" in detail(r)
    assert svc.client.delete("/v1/runs/claims", headers=svc.auth).status_code == 200


def test_one_run_at_a_time_without_gpus(make_service):
    svc = make_service("cpu-only", fake=True, gpus=0, step_seconds=0.05, max_running=None)
    for name in ("first", "second"):
        assert svc.create(name=name, toml=INLINE, overrides=LONG).status_code == 201
    svc.wait_state("first", ("running",))
    assert svc.run("second")["state"] == "queued"
    svc.client.post("/v1/runs/first/stop", headers=svc.auth)
    svc.wait_state("second", ("running",))
    svc.client.post("/v1/runs/second/stop", headers=svc.auth)
    svc.wait_state("second", ("stopped",))


def test_a_configuration_error_at_start_is_not_retried(make_service):
    svc = make_service("config-error", fake=True, gpus=0, step_seconds=0.05, max_running=None)
    assert svc.create(name="blocker", toml=INLINE, overrides=LONG).status_code == 201
    port = free_port()
    body = {"name": "late-port", "toml": INLINE, "restart_limit": 3, "overrides": {"metrics.prometheus_port": port}}
    assert svc.create(**body).status_code == 201  # free now; taken before the run starts
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        svc.client.post("/v1/runs/blocker/stop", headers=svc.auth)
        run = svc.wait_state("late-port", ("failed",))
    assert run["exit_codes"] == [2] and run["restarts_total"] == 0
    assert run["message"].startswith("configuration error, not retried") and "metrics.prometheus_port" in run["message"]


def test_stop_saves_without_periodic_checkpoints_and_resume_continues(fake_service_1gpu):
    svc = fake_service_1gpu
    assert svc.create(name="no-periodic", toml=INLINE, overrides=LONG).status_code == 201
    wait_until(lambda: svc.run("no-periodic")["step"] >= 3, 30, "3 updates")
    svc.client.post("/v1/runs/no-periodic/stop", headers=svc.auth)
    run = svc.wait_state("no-periodic", ("stopped",))
    saved = run["checkpoint_step"]
    assert saved is not None and saved >= 3 and run["latest_checkpoint"] == f"step-{saved}"
    assert run["step"] == saved and f"resumes from step-{saved}" in run["message"]
    r = svc.client.post("/v1/runs/no-periodic/resume", headers=svc.auth)
    assert r.status_code == 202 and f"continues from step-{saved}" in r.json()["message"]
    wait_until(lambda: svc.run("no-periodic")["step"] > saved, 30, "updates past the checkpoint")
    logs = svc.client.get("/v1/runs/no-periodic/logs", params={"tail": 1000}).text
    assert f"resumed from step {saved}" in logs
    svc.client.post("/v1/runs/no-periodic/stop", headers=svc.auth)
    svc.wait_state("no-periodic", ("stopped",))


def test_a_stop_is_stopped_whatever_the_launchers_exit_status(make_service):
    # torchrun signalled itself exits 1 after its ranks saved: the user's stop is still a stop.
    svc = make_service("stop-exit", fake=True, gpus=0, step_seconds=0.05, extra_env={"FAKE_TRAINER_STOP_EXIT": "1"})
    assert svc.create(name="exits-1", toml=INLINE, overrides=LONG).status_code == 201
    wait_until(lambda: svc.run("exits-1")["step"] >= 2, 30, "2 updates")
    svc.client.post("/v1/runs/exits-1/stop", headers=svc.auth)
    run = svc.wait_state("exits-1", ("stopped", "failed"))
    assert run["state"] == "stopped" and run["exit_codes"] == [1] and run["restarts_total"] == 0
    assert f"resumes from step-{run['checkpoint_step']}" in run["message"]


def test_resume_without_a_checkpoint_is_refused(fake_service_1gpu):
    svc = fake_service_1gpu
    body = {"name": "lost-work", "toml": INLINE, "restart_limit": 0, "overrides": {"debug.crash_at_step": 3}}
    assert svc.create(**body).status_code == 201
    run = svc.wait_state("lost-work", ("failed",))
    assert run["checkpoint_step"] is None and run["step"] == 3
    r = svc.client.post("/v1/runs/lost-work/resume", headers=svc.auth)
    assert r.status_code == 409
    assert "trained 3 update(s) but kept no checkpoint" in r.json()["detail"]
    assert svc.run("lost-work")["state"] == "failed"


def test_delete_kills_forgets_and_drops_the_series(fake_service_1gpu):
    svc = fake_service_1gpu
    assert svc.create(name="doomed", toml=INLINE, overrides=LONG).status_code == 201
    wait_until(lambda: "titan_k3_run_loss" in run_series(svc, "doomed"), 30, "the run's series")
    pid = svc.run("doomed")["attempts"][0]["pid"]
    assert svc.client.delete("/v1/runs/doomed", headers=svc.auth).json() == {"id": "doomed", "files_removed": False}
    assert svc.client.get("/v1/runs/doomed").status_code == 404
    assert run_series(svc, "doomed") == set()
    wait_until(lambda: not _alive(pid), 10, "the attempt's processes to end")
    assert "doomed" in runs_dir(svc)  # the files stay unless asked
    assert svc.create(name="doomed", toml=INLINE).status_code == 409  # the directory still holds the name
    assert svc.client.delete("/v1/runs/doomed", headers=svc.auth).status_code == 404

    assert svc.create(name="swept", toml=INLINE).status_code == 201
    svc.wait_state("swept", ("finished",))
    r = svc.client.delete("/v1/runs/swept", params={"files": "true"}, headers=svc.auth)
    assert r.status_code == 200 and r.json()["files_removed"] is True
    assert "swept" not in runs_dir(svc) and run_series(svc, "swept") == set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def test_a_finished_runs_trainer_series_leave_metrics(make_service):
    svc = make_service("series", fake=True, gpus=0, step_seconds=0.01, extra_args=["--finished-series-seconds", "1"])
    assert svc.create(name="done", toml=INLINE).status_code == 201
    svc.wait_state("done", ("finished",))
    wait_until(lambda: not any(n.startswith("titan_k3_run_") for n in run_series(svc, "done")), 10,
               "the trainer series to leave")
    # The state series stays while the registry holds the run (alerts on a failed run can fire, then resolve).
    assert run_series(svc, "done") == {"titan_k3_service_run_state", "titan_k3_service_run_restarts_total",
                                       "titan_k3_service_run_attempts"}


def test_read_side_token_host_paths_and_stream_cap(make_service):
    svc = make_service("closed", fake=True, gpus=0, step_seconds=0.05,
                       extra_args=["--read-auth", "on", "--max-streams", "2"])
    c = svc.client
    assert svc.create(name="watched", toml=INLINE, overrides=LONG).status_code == 201
    for path in ("/v1/runs", "/v1/runs/watched", "/v1/runs/watched/logs", "/v1/runs/watched/metrics", "/v1/recipes"):
        assert c.get(path).status_code == 401, path
        assert c.get(path, headers=svc.auth).status_code == 200, path
    for path in ("/healthz", "/metrics", "/v1/prometheus/targets"):  # scrapers and probes
        assert c.get(path).status_code == 200, path
    assert c.get("/healthz", headers={"Host": "evil.example"}).status_code == 400
    assert c.get("/healthz", headers={"Host": f"localhost:{svc.port}"}).status_code == 200

    wait_until(lambda: svc.run("watched")["step"] >= 2, 30, "2 updates")
    answers = [c.get(path, headers=svc.auth).text for path in
               ("/v1/runs", "/v1/runs/watched", "/v1/runs/watched/logs?tail=1000", "/v1/runs/watched/metrics")]
    assert str(svc.state_dir) in (svc.state_dir / "runs" / "watched" / "service" / "attempt-1.log").read_text()
    assert not any(str(svc.state_dir) in a for a in answers)  # no host paths, though the trainer's log names them
    assert json.loads(answers[1])["run_dir"] == "runs/watched"

    url = "/v1/runs/watched/logs/stream"
    with c.stream("GET", url, headers=svc.auth) as s1, c.stream("GET", url, headers=svc.auth) as s2:
        assert s1.status_code == s2.status_code == 200
        r = c.get(url, headers=svc.auth)
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
    wait_until(lambda: _stream_opens(c, url, svc.auth), 10, "a stream slot to free up")
    c.post("/v1/runs/watched/stop", headers=svc.auth)
    svc.wait_state("watched", ("stopped",))


def _stream_opens(c: httpx.Client, url: str, auth: dict) -> bool:
    with c.stream("GET", url, headers=auth) as s:
        return s.status_code == 200


def test_a_method_a_path_lacks_gets_405_naming_all_its_methods(fake_service_1gpu):
    c = fake_service_1gpu.client
    r = c.request("PUT", "/v1/runs")
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    r = c.request("OPTIONS", "/v1/runs/anything")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    schema = c.get("/openapi.json").json()
    param = schema["paths"]["/v1/runs/{run_id}"]["get"]["parameters"][0]
    assert param["name"] == "run_id" and param["schema"]["pattern"].startswith("^")
    assert "401" in schema["paths"]["/v1/runs"]["post"]["responses"]
    assert "401" in schema["paths"]["/v1/runs/{run_id}"]["delete"]["responses"]
