"""The REST contract over a real uvicorn server, with the fake trainer (fast children)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service_harness import DEBUG_OVERRIDES, REPO, TOKEN, wait_until
from titan_k3.config import ConfigError, load_job_config

INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'
CKPT = INLINE + "[checkpoint]\nenable = true\ninterval = 2\n"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def detail(r: httpx.Response) -> str:
    """The one-line refusal of a 422 (FastAPI's validation-error shape: a list of {loc, msg, type})."""
    body = r.json()["detail"]
    assert isinstance(body, list) and len(body) == 1, body
    return body[0]["msg"]


def run_dirs(svc) -> set[str]:
    runs = svc.state_dir / "runs"
    return {p.name for p in runs.iterdir()} if runs.exists() else set()


def test_service_never_imports_torch(tmp_path):
    code = (
        "import sys\n"
        "from service.app import create_app\n"
        "from service.settings import Settings\n"
        f"app = create_app(Settings(state_dir={str(tmp_path)!r}, token='x', gpus=0))\n"
        "svc = app.state.service\n"
        "from service.schemas import RunCreate\n"
        "svc.create(RunCreate(toml='[model]\\nflavor = \"debug\"\\n', name='t'))\n"
        "import service.__main__, service.child, service.exporter\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_mutating_endpoints_need_the_token(fake_service):
    c = fake_service.client
    assert c.post("/v1/runs", json={"toml": INLINE}).status_code == 401
    r = c.post("/v1/runs", json={"toml": INLINE}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert c.post("/v1/runs", json={"toml": INLINE}, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
    assert c.post("/v1/runs/any/stop").status_code == 401
    assert c.post("/v1/runs/any/resume").status_code == 401
    assert c.delete("/v1/runs/any").status_code == 401
    assert c.get("/v1/runs").status_code == 200  # reads are open on loopback (--read-auth auto)


@pytest.mark.parametrize("toml, overrides", [
    ("[training]\nstepz = 3\n", {}),
    ("[model]\nflavor = \"debgu\"\n", {}),
    ("[training\nsteps = 3\n", {}),
    (INLINE, {"training.steps": "many"}),
    (INLINE, {"optimizer.beta1": 1.5}),
])
def test_bad_config_is_422_with_the_trainers_message_and_creates_nothing(fake_service, toml, overrides):
    before_dirs, before_runs = run_dirs(fake_service), len(fake_service.client.get("/v1/runs").json())
    with pytest.raises(ConfigError) as expected:
        argv = [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
        load_job_config(argv, toml_text=toml)
    r = fake_service.create(toml=toml, overrides=overrides, name="bad-config")
    assert r.status_code == 422
    assert detail(r) == str(expected.value)
    assert run_dirs(fake_service) == before_dirs
    assert len(fake_service.client.get("/v1/runs").json()) == before_runs
    assert fake_service.client.get("/v1/runs/bad-config").status_code == 404


@pytest.mark.parametrize("body, fragment", [
    ({"name": "../evil", "toml": INLINE}, "name"),
    ({"name": "a/b", "toml": INLINE}, "name"),
    ({"name": "..", "toml": INLINE}, "name"),
    ({"name": "a..b", "toml": INLINE}, "name"),
    ({"recipe": "../../etc/passwd"}, "recipe"),
    ({"recipe": "/etc/passwd"}, "recipe"),
    ({"toml": INLINE, "overrides": {"checkpoint.folder": "../../outside"}}, "checkpoint.folder"),
    ({"toml": INLINE, "overrides": {"checkpoint.folder": "/tmp/outside"}}, "checkpoint.folder"),
    # the service's own names in the run directory: the first save would meet a file there (FileExistsError)
    ({"toml": INLINE, "overrides": {"checkpoint.folder": "submitted.toml"}}, "the control service's own"),
    ({"toml": INLINE, "overrides": {"checkpoint.folder": "./service/ckpt"}}, "the control service's own"),
    ({"toml": INLINE, "overrides": {"data.dataset": "/etc"}}, "data.dataset"),
    ({"toml": INLINE, "overrides": {"job.dump_folder": "/tmp"}}, "job.dump_folder"),
    ({"toml": INLINE, "overrides": {"job.name": "../x"}}, "job.name"),
    ({"toml": INLINE, "overrides": {"compile.cache_dir": "/tmp/elsewhere"}}, "compile.cache_dir"),
    ({"toml": INLINE, "overrides": {"model.flavor": "debug\u0000"}}, "control characters"),
])
def test_names_and_paths_cannot_leave_their_roots(fake_service, body, fragment):
    before = run_dirs(fake_service)
    r = fake_service.create(**body)
    assert r.status_code == 422, r.text
    assert fragment in json.dumps(r.json()["detail"])  # schema refusals name the field in `loc`
    assert run_dirs(fake_service) == before
    assert not (fake_service.state_dir / "evil").exists() and not (fake_service.state_dir.parent / "evil").exists()


@pytest.mark.parametrize("value, kind", [([1, 2], "an array"), (None, "null"), ({"a": 1}, "an object")])
def test_an_override_value_of_the_wrong_kind_is_one_error_at_its_key(fake_service, value, kind):
    r = fake_service.create(toml=INLINE, overrides={"training.steps": value}, name="bad-override")
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]  # one, not one per member of the union
    assert error["loc"] == ["body", "overrides", "training.steps"]
    assert error["msg"] == f"Value error, an override is a string, number or boolean, not {kind}"


def test_listing_by_an_unknown_state_is_refused_not_answered_empty(fake_service):
    c = fake_service.client
    r = c.get("/v1/runs", params={"state": "runing"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"][:2] == ["query", "state"] and "'running'" in detail(r)
    assert c.get("/v1/runs", params={"state": "lost"}).status_code == 200


def test_path_traversal_in_url_is_refused(fake_service):
    c = fake_service.client
    assert c.get("/v1/runs/..%2F..%2Fregistry.sqlite3").status_code in (404, 422)
    assert c.get("/v1/runs/..%2Fstate/logs").status_code in (404, 422)
    assert c.get("/v1/runs/.. /logs").status_code in (404, 422)


def test_body_size_limit(fake_service):
    r = fake_service.create(toml="#" * (2 << 20))
    assert r.status_code == 413

    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = fake_service.client.post("/v1/runs", content=chunks(), headers={**fake_service.auth,
                                                                        "content-type": "application/json"})
    assert r.status_code == 413


def test_run_lifecycle_logs_metrics_and_stream(fake_service):
    r = fake_service.create(toml=CKPT, name="life")
    assert r.status_code == 201, r.text
    assert fake_service.create(toml=CKPT, name="life").status_code == 409
    run = fake_service.wait_state("life", ("finished",))
    assert run["exit_codes"] == [0]
    assert run["latest_checkpoint"] == "step-6"
    assert run["latest_metrics"]["step"] == 6.0
    assert run["run_dir"] == "runs/life" and run["step"] == 6 and run["checkpoint_step"] == 6
    hist = fake_service.client.get("/v1/runs/life/metrics", params={"keys": "loss"}).json()
    assert [h["step"] for h in hist] == [1, 2, 3, 4, 5, 6] and set(hist[0]) == {"step", "loss"}
    logs = fake_service.client.get("/v1/runs/life/logs", params={"tail": 2}).text.splitlines()
    assert logs == ["checkpoint saved at step 6", "done"]
    with fake_service.client.stream("GET", "/v1/runs/life/logs/stream", params={"tail": 3}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        body = "".join(s.iter_text())
    assert "data: done\n" in body and "event: end\n" in body and '"state": "finished"' in body
    assert fake_service.client.post("/v1/runs/life/stop", headers=fake_service.auth).status_code == 409


def test_stop_then_resume_continues_from_the_checkpoint(fake_service):
    body = {"toml": CKPT, "name": "pausable", "overrides": {"training.steps": 400, "checkpoint.folder": "state/ckpt"}}
    assert fake_service.create(**body).status_code == 201
    wait_until(lambda: fake_service.run("pausable")["latest_metrics"].get("step", 0) >= 3, 30, "3 steps")
    r = fake_service.client.post("/v1/runs/pausable/stop", headers=fake_service.auth)
    assert r.status_code == 202 and r.json()["state"] in ("stopping", "stopped")
    run = fake_service.wait_state("pausable", ("stopped",))
    stopped_at = int(run["latest_checkpoint"].removeprefix("step-"))
    assert (fake_service.state_dir / "runs" / "pausable" / "state" / "ckpt" / run["latest_checkpoint"]).is_dir()
    assert stopped_at >= 3 and run["exit_codes"] == [0]
    assert fake_service.client.post("/v1/runs/pausable/resume", headers=fake_service.auth).status_code == 202
    wait_until(lambda: len(fake_service.run("pausable")["attempts"]) == 2, 30, "the second attempt")
    run = fake_service.wait_state("pausable", ("running",))
    log = fake_service.client.get("/v1/runs/pausable/logs", params={"tail": 1000}).text
    wait_until(lambda: f"resumed from step {stopped_at}" in
               fake_service.client.get("/v1/runs/pausable/logs", params={"tail": 1000}).text, 30, "resume line")
    assert "=== attempt 1 ===" in log
    assert fake_service.client.post("/v1/runs/pausable/stop", headers=fake_service.auth).status_code == 202
    fake_service.wait_state("pausable", ("stopped",))


def test_crash_loop_stops_at_the_restart_limit(fake_service):
    body = {"toml": INLINE, "name": "crashy", "restart_limit": 2, "overrides": {"debug.crash_at_step": 1}}
    assert fake_service.create(**body).status_code == 201
    run = fake_service.wait_state("crashy", ("failed",))
    assert run["exit_codes"] == [3, 3, 3] and run["restarts_total"] == 2
    assert "restart limit 2 reached" in run["message"]
    m = samples(fake_service.metrics_text())
    assert m[("titan_k3_service_run_restarts_total", (("run", "crashy"),))] == 2
    assert m[("titan_k3_service_run_attempts", (("run", "crashy"),))] == 3


def test_gpu_queue_assigns_cuda_visible_devices(fake_service):
    long = {"toml": INLINE, "overrides": {"training.steps": 400}, "gpus": 1}
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        assert fake_service.create(name=name, **long).status_code == 201
    a = fake_service.wait_state("gpu-a", ("running",))
    b = fake_service.wait_state("gpu-b", ("running",))
    assert sorted(a["assigned_gpus"] + b["assigned_gpus"]) == [0, 1]
    assert fake_service.run("gpu-c")["state"] == "queued"
    assert samples(fake_service.metrics_text())[("titan_k3_service_queue_length", ())] == 1

    def manifest(name):
        path = fake_service.state_dir / "runs" / name / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else None

    wait_until(lambda: manifest("gpu-a"), 30, "gpu-a manifest")
    assert manifest("gpu-a")["cuda_visible_devices"] == str(a["assigned_gpus"][0])
    assert manifest("gpu-a")["token_in_env"] is False  # the bearer token never reaches a training
    assert fake_service.create(name="too-many", toml=INLINE, gpus=3).status_code == 422
    fake_service.client.post("/v1/runs/gpu-a/stop", headers=fake_service.auth)
    c = fake_service.wait_state("gpu-c", ("running",))
    assert c["assigned_gpus"] == a["assigned_gpus"]
    wait_until(lambda: manifest("gpu-c"), 30, "gpu-c manifest")
    assert manifest("gpu-c")["cuda_visible_devices"] == str(a["assigned_gpus"][0])
    for name in ("gpu-b", "gpu-c"):
        fake_service.client.post(f"/v1/runs/{name}/stop", headers=fake_service.auth)
        fake_service.wait_state(name, ("stopped",))


def test_fifty_concurrent_creates_lose_and_duplicate_nothing(make_service):
    svc = make_service("concurrent", fake=True, gpus=1, step_seconds=0.05)
    body = {"toml": INLINE, "gpus": 1, "overrides": {"training.steps": 400}}

    def post(i: int) -> httpx.Response:
        with httpx.Client(base_url=svc.url, timeout=60) as c:
            named = {"name": f"c{i:02d}"} if i % 2 else {}
            return c.post("/v1/runs", json={**body, **named}, headers=svc.auth)

    with ThreadPoolExecutor(max_workers=50) as pool:
        responses = list(pool.map(post, range(50)))
    assert [r.status_code for r in responses] == [201] * 50, [r.text for r in responses if r.status_code != 201]
    ids = [r.json()["id"] for r in responses]
    assert len(set(ids)) == 50
    listed = [r["id"] for r in svc.client.get("/v1/runs").json()]
    assert sorted(listed) == sorted(ids)
    assert {p.name for p in (svc.state_dir / "runs").iterdir()} == set(ids)
    wait_until(lambda: svc.client.get("/v1/runs", params={"state": "running"}).json(), 30, "one running")
    m = samples(svc.metrics_text())
    assert m[("titan_k3_service_runs", (("state", "running"),))] == 1
    assert m[("titan_k3_service_queue_length", ())] == 49
    # Same name from many clients at once: exactly one wins.
    with ThreadPoolExecutor(max_workers=10) as pool:
        codes = sorted(pool.map(lambda _: svc.create(name="same", **body).status_code, range(10)))
    assert codes == [201] + [409] * 9
    for run_id in ids + ["same"]:
        assert svc.client.post(f"/v1/runs/{run_id}/stop", headers=svc.auth).status_code == 202
    wait_until(lambda: all(r["state"] == "stopped" for r in svc.client.get("/v1/runs").json()), 60, "all stopped")


def test_recipe_by_name(fake_service):
    recipes = fake_service.client.get("/v1/recipes").json()
    assert "smoke" in recipes
    r = fake_service.create(recipe="smoke", name="from-recipe", overrides={**DEBUG_OVERRIDES, "metrics.log_freq": 1})
    assert r.status_code == 201, r.text
    run = fake_service.wait_state("from-recipe", ("finished",))
    assert run["recipe"] == "smoke" and run["latest_metrics"]["step"] == 6
    submitted = (fake_service.state_dir / "runs" / "from-recipe" / "submitted.toml").read_text()
    assert submitted == (REPO / "tomls" / "smoke.toml").read_text()
    r = fake_service.create(recipe="no-such-recipe")
    assert r.status_code == 422 and "smoke" in detail(r)
    assert fake_service.create(recipe="smoke", toml=INLINE).status_code == 422
    assert fake_service.create().status_code == 422


def test_stop_escalates_to_sigkill_after_the_grace_period(make_service):
    svc = make_service("hung", fake=True, grace_seconds=1.0, extra_env={"FAKE_TRAINER_IGNORE_SIGTERM": "1"})
    assert svc.create(name="hung", toml=INLINE, overrides={"training.steps": 4000}).status_code == 201
    run = svc.wait_state("hung", ("running",))
    pid = run["attempts"][0]["pid"]
    # The manifest is written after the trainer installed its SIGTERM handler.
    wait_until(lambda: (svc.state_dir / "runs" / "hung" / "manifest.json").exists(), 30, "the trainer to start")
    tree = [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    assert svc.client.post("/v1/runs/hung/stop", headers=svc.auth).json()["state"] == "stopping"
    run = svc.wait_state("hung", ("stopped",), timeout=30)
    assert run["exit_codes"] == [-9]
    wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                               for p in tree), 10, "every process of the attempt to be gone")


def test_prometheus_service_discovery_lists_live_trainer_endpoints(fake_service):
    body = {"toml": INLINE, "name": "with-port", "overrides": {"training.steps": 400, "metrics.prometheus_port": 9555}}
    assert fake_service.create(**body).status_code == 201
    assert fake_service.create(toml=INLINE, name="no-port", overrides={"training.steps": 400}).status_code == 201
    expected = [{"targets": ["127.0.0.1:9555"], "labels": {"run": "with-port"}}]
    wait_until(lambda: fake_service.client.get("/v1/prometheus/targets").json() == expected, 30, "the target")
    for name in ("with-port", "no-port"):
        fake_service.client.post(f"/v1/runs/{name}/stop", headers=fake_service.auth)
        fake_service.wait_state(name, ("stopped",))
    assert fake_service.client.get("/v1/prometheus/targets").json() == []


# ---- query parameters and keys= the endpoints do not take ------------------------------------------

@pytest.mark.parametrize("method, path, params, name, allowed", [
    ("GET", "/v1/runs", {"stat": "running"}, "stat", "it takes state"),
    ("GET", "/v1/runs/q-run/logs", {"tial": "5"}, "tial", "it takes tail"),
    ("GET", "/v1/runs/q-run/metrics", {"tail": "5", "key": "loss"}, "key", "it takes tail, keys"),
    ("GET", "/v1/runs/q-run", {"verbose": "1"}, "verbose", "it takes none"),
    ("DELETE", "/v1/runs/q-run", {"file": "true"}, "file", "it takes files"),
    ("POST", "/v1/runs/q-run/stop", {"force": "1"}, "force", "it takes none"),
    ("GET", "/metrics", {"name[]": "x"}, "name[]", "it takes none"),
])
def test_an_unknown_query_parameter_is_refused_naming_it_and_the_allowed_ones(fake_service, method, path, params,
                                                                               name, allowed):
    if fake_service.client.get("/v1/runs/q-run").status_code == 404:
        assert fake_service.create(toml=INLINE, name="q-run").status_code == 201
    r = fake_service.client.request(method, path, params=params, headers=fake_service.auth)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["query", name]
    assert error["msg"].startswith(f"unknown query parameter {name!r} for {method} ") and error["msg"].endswith(allowed)
    assert "\n" not in error["msg"]
    assert fake_service.client.get("/v1/runs/q-run").status_code == 200  # the DELETE did nothing


def test_a_one_value_query_parameter_given_twice_is_refused_and_a_list_one_is_not(fake_service):
    c = fake_service.client
    r = c.get("/v1/runs", params=[("state", "running"), ("state", "queued")])
    assert r.status_code == 200, r.text
    r = c.get("/v1/runs/none/logs", params=[("tail", "5"), ("tail", "6")])
    assert r.status_code == 422 and detail(r) == ("query parameter 'tail' given 2 times for GET /v1/runs/{run_id}/logs; "
                                                  "it takes one value"), r.text


def test_an_unknown_metric_key_is_refused_naming_it_and_the_runs_keys(fake_service):
    assert fake_service.create(toml=CKPT, name="keys-run").status_code == 201
    fake_service.wait_state("keys-run", ("finished",))
    c = fake_service.client
    r = c.get("/v1/runs/keys-run/metrics", params={"keys": "loss,lossx"})
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["query", "keys"]
    assert error["msg"].startswith("unknown metric key 'lossx' in 'keys': run 'keys-run' records ")
    assert "grad_norm/muon, " in error["msg"] and ", loss, " in error["msg"]
    # a key of the trainer's this run has not written (CUDA memory, an evaluation) is an empty column, not an error
    rows = c.get("/v1/runs/keys-run/metrics", params={"keys": "loss,memory_peak_reserved_gib,val_loss"}).json()
    assert rows and set(rows[-1]) == {"step", "loss"}
