"""The service refuses a run that the planner says cannot fit the GPUs it would get: 422 with the planner's line."""

from __future__ import annotations

import json
import subprocess
import sys

from service_harness import REPO

K3 = '[model]\nflavor = "k3"\n[training]\nsteps = 6\nseq_len = 4096\ncompute_dtype = "bfloat16"\n'
DEBUG = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


def detail(r) -> str:
    body = r.json()["detail"]
    assert isinstance(body, list) and len(body) == 1, body
    return body[0]["msg"]


def planner(*argv: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "titan_k3.tools.plan", *argv, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_a_run_that_cannot_fit_its_gpus_is_refused_with_the_planners_reason(make_service):
    svc = make_service("plan", fake=True, gpus=2)
    r = svc.create(name="k3-on-two", toml=K3, gpus=2, nproc_per_node=2)
    assert r.status_code == 422, r.text
    msg = detail(r)
    plan = planner("--model.flavor", "k3", "--training.seq_len", "4096", "--training.compute_dtype", "bfloat16",
                   "--cluster.gpus_per_node", "2")
    assert not plan["configured_fits"]
    assert msg.startswith("the planner says this run does not fit its 2 GPU(s)")
    assert f"{plan['configured']['peak_gib']:.1f} GiB" in msg and f"{plan['cluster']['budget_gib']:.1f} GiB" in msg
    assert svc.client.get("/v1/runs/k3-on-two").status_code == 404
    assert not (svc.state_dir / "runs" / "k3-on-two").exists()


def test_a_run_that_fits_is_accepted_and_cpu_runs_are_not_planned(make_service):
    svc = make_service("plan-ok", fake=True, gpus=1)
    assert svc.create(name="debug-gpu", toml=DEBUG, gpus=1).status_code in (200, 201)
    assert svc.create(name="debug-cpu", toml=DEBUG).status_code in (200, 201)


def test_parallel_degrees_that_do_not_fit_the_processes_are_refused_without_gpus_too(make_service):
    svc = make_service("degrees", fake=True, gpus=2)
    r = svc.create(name="shard-3-on-1", toml=DEBUG, gpus=0, overrides={"parallelism.data_parallel_shard_degree": 3})
    assert r.status_code == 422, r.text
    assert detail(r) == ("config key 'parallelism.data_parallel_shard_degree' = 3: replicate 1 x shard 3 must equal "
                         "the world size 1 (use -1 for the rest)")
    r = svc.create(name="ep-2-on-1", toml=DEBUG, gpus=0, overrides={"parallelism.expert_parallel_degree": 2})
    assert r.status_code == 422 and "'parallelism.expert_parallel_degree' = 2" in detail(r), r.text
    assert not (svc.state_dir / "runs" / "shard-3-on-1").exists()
    ok = svc.create(name="shard-2-on-2", toml=DEBUG, gpus=2, nproc_per_node=2,
                    overrides={"parallelism.data_parallel_shard_degree": 2})
    assert ok.status_code in (200, 201), ok.text
