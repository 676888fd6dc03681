"""The headline flows against the real trainer under real torchrun (CPU, gloo, debug flavor).

create -> running -> metrics at /metrics -> stop (a checkpoint written although periodic ones are off, state
stopped) -> resume (continues from it);
a crash at a step -> relaunched and resumed from the checkpoint;
the service killed and restarted -> the live (two-rank) run is re-adopted, then stopped cleanly.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service_harness import DEBUG_OVERRIDES, wait_until

LONG = {**DEBUG_OVERRIDES, "training.steps": 400, "metrics.log_freq": 1,
        "checkpoint.enable": True, "checkpoint.interval": 1000}
NO_PERIODIC = {**DEBUG_OVERRIDES, "training.steps": 400, "metrics.log_freq": 1}  # checkpoint.enable off


def run_samples(text: str, run_id: str) -> dict[str, dict[tuple, float]]:
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("run") == run_id:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
                out.setdefault(s.name, {})[labels] = s.value
    return out


def metric_step(svc, run_id: str) -> float:
    return run_samples(svc.metrics_text(), run_id).get("titan_k3_run_step", {}).get((), 0.0)


def test_create_running_metrics_stop_resume(make_service):
    svc = make_service(fake=False)
    r = svc.create(name="real", toml="", overrides=NO_PERIODIC)
    assert r.status_code == 201, r.text
    svc.wait_state("real", ("running",))
    wait_until(lambda: metric_step(svc, "real") >= 2, 300, "trainer metrics at /metrics")
    m = run_samples(svc.metrics_text(), "real")
    assert m["titan_k3_service_run_state"][(("state", "running"),)] == 1
    for name in ("titan_k3_run_loss", "titan_k3_run_lr", "titan_k3_run_grad_norm", "titan_k3_run_mfu",
                 "titan_k3_run_tokens_seen"):
        assert name in m, name
    assert set(m["titan_k3_run_tokens_per_second_by_clock"]) == {(("clock", "training"),), (("clock", "session"),)}
    assert m["titan_k3_run_moe_dead_fraction_by_layer"], "expert-load metrics missing"
    loads = m["titan_k3_run_moe_expert_load"]  # per (layer, expert) from the moe/<layer>/load lists
    layers = {dict(k)["layer"] for k in loads}
    assert layers and all(abs(sum(v for k, v in loads.items() if dict(k)["layer"] == la) - 1) < 1e-3 for la in layers)
    assert 0 < m["titan_k3_run_loss"][()] < 20

    r = svc.client.post("/v1/runs/real/stop", headers=svc.auth)
    assert r.status_code == 202
    run = svc.wait_state("real", ("stopped",), timeout=300)
    assert len(run["attempts"]) == 1 and run["attempts"][0]["ended_at"] is not None
    assert run["exit_codes"] == [0], svc.client.get("/v1/runs/real/logs", params={"tail": 40}).text
    assert run["latest_checkpoint"] is not None and run["latest_checkpoint"].startswith("step-")
    assert (svc.state_dir / "runs" / "real" / "checkpoints" / run["latest_checkpoint"]).is_dir()
    assert run["events"].get("checkpoint_saved", 0) == 1  # the stop's own: no periodic saves
    saved = run["checkpoint_step"]
    assert run["step"] == saved >= 2

    r = svc.client.post("/v1/runs/real/resume", headers=svc.auth)
    assert r.status_code == 202, r.text
    wait_until(lambda: svc.run("real")["events"].get("resumed", 0) == 1, 300, "the resumed attempt")
    wait_until(lambda: svc.run("real")["step"] > saved, 300, "updates past the stop checkpoint")
    steps = [int(h["step"]) for h in svc.client.get("/v1/runs/real/metrics").json()]
    assert steps[steps.index(saved) + 1] == saved + 1, steps  # the second attempt logs on from the checkpoint
    assert svc.client.post("/v1/runs/real/stop", headers=svc.auth).status_code == 202
    assert svc.wait_state("real", ("stopped",), timeout=300)["exit_codes"] == [0, 0]


def test_crash_is_restarted_and_resumes_from_the_checkpoint(make_service):
    svc = make_service(fake=False)
    # NOTE: the trainer saves step-4 (interval 2) before the crash knob fires after update 4, so the
    # relaunch resumes past the crash step instead of crashing again.
    overrides = {**DEBUG_OVERRIDES, "metrics.log_freq": 1, "checkpoint.enable": True, "checkpoint.interval": 2,
                 "debug.crash_at_step": 4}
    assert svc.create(name="crash", toml="", overrides=overrides, restart_limit=1).status_code == 201
    run = svc.wait_state("crash", ("finished", "failed"), timeout=400)
    logs = svc.client.get("/v1/runs/crash/logs", params={"tail": 400}).text
    assert "debug.crash_at_step = 4" in logs and "=== attempt 2 ===" in logs
    assert run["state"] == "finished", logs
    assert len(run["attempts"]) == 2 and run["exit_codes"][0] != 0 and run["exit_codes"][1] == 0
    assert run["restarts_total"] == 1
    assert run["events"].get("resumed", 0) == 1, run["events"]
    assert run["latest_checkpoint"] == "step-6"
    steps = [int(h["step"]) for h in svc.client.get("/v1/runs/crash/metrics").json()]
    assert steps[:4] == [1, 2, 3, 4] and steps[-1] == 6 and 5 in steps[4:], steps
    m = run_samples(svc.metrics_text(), "crash")
    assert m["titan_k3_service_run_restarts_total"][()] == 1


def test_service_restart_readopts_a_live_run(make_service):
    svc = make_service(fake=False)
    # Two ranks: the stop after re-adoption must reach both torchrun workers (each in its own session).
    assert svc.create(name="adopt", toml="", overrides=LONG, nproc_per_node=2).status_code == 201
    wait_until(lambda: metric_step(svc, "adopt") >= 2, 300, "trainer metrics")
    before = svc.run("adopt")
    svc.kill()

    svc2 = make_service(fake=False)  # a new process on a new port, over the same state dir
    assert svc2.state_dir == svc.state_dir
    run = svc2.run("adopt")
    assert run["state"] == "running", run
    assert [a["pid"] for a in run["attempts"]] == [a["pid"] for a in before["attempts"]]
    step = metric_step(svc2, "adopt")
    wait_until(lambda: metric_step(svc2, "adopt") > step, 180, "the adopted run to keep training")
    assert svc2.client.post("/v1/runs/adopt/stop", headers=svc2.auth).status_code == 202
    run = svc2.wait_state("adopt", ("stopped",), timeout=300)
    assert len(run["exit_codes"]) == 1 and run["exit_codes"][0] is not None  # read from the wrapper's exit file
    assert run["exit_codes"] == [0]
    assert run["latest_checkpoint"] is not None
