"""deploy/: every YAML/JSON parses, every metric the dashboard and alerts query is emitted, the
alerts pass their promtool unit tests, and a graceful stop is a success under Kubernetes and Slurm.

Emitted names come from running the service's exporter (service/exporter.py) over a run
directory whose metrics line holds every key of the trainer contract, plus the names in the
trainer's rank-0 exporter table (titan_k3.metrics.prometheus.NAMES).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ports import free_port
from service_harness import REPO, wait_until
from service.exporter import (EXPERT_LOAD, LABELLED, SERVICE_NAMES, TRAINER_KEYS, TRAINER_LIST_KEYS, ServiceCollector,
                              generic_name, is_trainer_key)
from service.registry import Attempt, Registry
from service.rundir import RunFilesCache
from titan_k3.config import load_job_config

DEPLOY = REPO / "deploy"
NAME_RE = re.compile(r"\btitan_k3_[a-zA-Z0-9_]+")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus; "
                                    "see .ci/system-deps.sh)")
# A k3-mini checkpoint took 24 s to save on an H200; a stop gets a budget of 5x that (120 s).
MEASURED_SAVE_SECONDS = 24
STOP_BUDGET_SECONDS = 5 * MEASURED_SAVE_SECONDS
IMAGE_UID = IMAGE_GID = 1000


def deploy_files(*exts: str) -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in exts)


def test_every_yaml_and_json_in_deploy_parses():
    ymls, jsons = deploy_files(".yml", ".yaml"), deploy_files(".json")
    assert len(ymls) >= 8 and len(jsons) >= 2
    for path in ymls:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, (dict, list)) for d in docs), path
    for path in jsons:
        json.loads(path.read_text())


def _fill(key: str) -> str:
    for hole, value in {"<group>": "muon", "<layer>": "3", "<source>": "code", "<check>": "replicas.checksums",
                        "<task>": "hellaswag"}.items():
        key = key.replace(hole, value)
    return key


def contract_record() -> dict[str, float]:
    return {_fill(key): float(i + 1) for i, key in enumerate(TRAINER_KEYS)}


def service_families(tmp_path: Path) -> list:
    """The metric families /metrics shows for a run whose files hold the whole trainer contract."""
    runs = tmp_path / "runs"
    run_dir = runs / "r"
    run_dir.mkdir(parents=True)
    lists = {_fill(key): [0.25, 0.75] for key in TRAINER_LIST_KEYS}
    (run_dir / "metrics.jsonl").write_text(json.dumps({**contract_record(), **lists}) + "\n")
    events = [{"time": 0.0, "step": 1, "kind": k, "message": "m", "check": "replica_params_equal"}
              for k in ("invariant_violation", "fallback", "checkpoint_saved")]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    reg = Registry(tmp_path / "registry.sqlite3")
    reg.insert_run("r", "inline", {}, 1, 0, 1)
    reg.add_attempt(Attempt("r", 1, 1, 0.0, 0.0, None, None, [], "", ""))
    reg.update_run("r", state="running", restarts_total=1)
    prom = CollectorRegistry(auto_describe=False)
    prom.register(ServiceCollector(reg, RunFilesCache(runs), gpus_total=2, finished_series_seconds=600.0))
    text = generate_latest(prom).decode()
    reg.close()
    return list(text_string_to_metric_families(text))


def service_emitted(tmp_path: Path) -> set[str]:
    """Every sample name /metrics shows for a run whose files hold the whole trainer contract."""
    return {s.name for fam in service_families(tmp_path) for s in fam.samples}


def test_service_gauges_are_not_named_like_counters(tmp_path):
    """promtool's lint without promtool: only a counter's name ends in _total (a gauge so named reads as one)."""
    gauges = {fam.name for fam in service_families(tmp_path) if fam.type == "gauge"}
    assert "titan_k3_service_gpus" in gauges
    assert not {name for name in gauges if name.endswith("_total")}


def test_trainer_keys_name_every_key_a_real_trainer_writes(tmp_path):
    """TRAINER_KEYS (what keys= accepts before a run writes it, what the dashboard can query) against a real record."""
    out = subprocess.run([sys.executable, "-m", "titan_k3.train", "--model.flavor", "debug", "--training.steps", "1",
                          "--training.seq_len", "64", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path),
                          "--job.name", "keys"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (record,) = [json.loads(line) for line in (tmp_path / "keys" / "metrics.jsonl").read_text().splitlines()]
    lists = {k for k, v in record.items() if isinstance(v, list)}
    list_key = re.compile("|".join(re.sub(r"<[a-z]+>", "[^/]+", re.escape(k)) for k in TRAINER_LIST_KEYS))
    assert lists and all(list_key.fullmatch(k) for k in lists), sorted(lists)
    assert sorted(k for k in record if k not in lists and not is_trainer_key(k)) == []


def trainer_exporter_names() -> set[str]:
    """Names the trainer's rank-0 endpoint exposes (its one NAMES table), when the trainer has one."""
    try:
        from titan_k3.metrics.prometheus import NAMES
    except ImportError:
        return set()
    # NOTE: a histogram is queried through its series (_bucket, _sum, _count).
    return set(NAMES) | {n + s for n, (kind, _, _) in NAMES.items() if kind == "histogram"
                         for s in ("_bucket", "_sum", "_count")}


def queried_names() -> dict[str, set[str]]:
    """metric name -> files whose queries use it (dashboard targets, templating, alert rules)."""
    found: dict[str, set[str]] = {}

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in ("expr", "query", "definition") and isinstance(v, str):
                    for m in NAME_RE.finditer(v):
                        found.setdefault(m.group(0), set()).add(where)
                else:
                    walk(v, where)
        elif isinstance(node, list):
            for v in node:
                walk(v, where)

    for path in deploy_files(".json"):
        walk(json.loads(path.read_text()), path.name)
    for path in deploy_files(".yml", ".yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            walk(doc, path.name)
    return found


def test_dashboard_and_alerts_query_only_emitted_metrics(tmp_path):
    emitted = service_emitted(tmp_path)
    # The mapping is what the docstring says: one gauge per contract key (but a name the service's own families
    # hold: the trainer's invariant_violations total is the events' counter), the labelled families.
    assert {generic_name(k) for k in contract_record()} - set(SERVICE_NAMES) <= emitted
    assert {lab.name for lab in LABELLED} | {EXPERT_LOAD} <= emitted
    trainer = trainer_exporter_names()
    queried = queried_names()
    dashboard = json.loads((DEPLOY / "grafana/dashboards/titan_k3.json").read_text())
    assert len(dashboard["panels"]) >= 12 and queried

    def known(name: str) -> bool:
        if name in emitted:
            return True
        return name in trainer

    unknown = {n: sorted(w) for n, w in queried.items() if not known(n)}
    assert not unknown, f"queried but emitted by no exporter in the repo: {unknown}"
    # The dashboard covers what the issue asks for.
    needed = ["titan_k3_run_loss", "titan_k3_run_tokens_per_second_by_clock", "titan_k3_run_mfu",
              "titan_k3_run_memory_peak_allocated_gib", "titan_k3_run_grad_norm_by_group",
              "titan_k3_run_moe_maxvio_by_layer", "titan_k3_run_moe_dead_fraction_by_layer",
              "titan_k3_run_invariant_violations_total", "titan_k3_service_run_restarts_total"]
    in_dashboard = {n for n, w in queried.items() if "titan_k3.json" in w}
    assert set(needed) <= in_dashboard, set(needed) - in_dashboard


def alert_names() -> set[str]:
    groups = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"]
    return {r["alert"] for g in groups for r in g["rules"] if "alert" in r}


def test_dashboard_panels_tile_the_grid_and_show_every_alert():
    panels = json.loads((DEPLOY / "grafana/dashboards/titan_k3.json").read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    taken: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{p['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = p["title"]
    firing = next(p for p in panels if p["title"] == "Firing alerts")["targets"][0]["expr"]
    shown = re.search(r'alertname=~"([^"]+)"', firing).group(1)
    assert alert_names() and all(re.fullmatch(shown, a) for a in alert_names())


def test_grafana_provisioning_points_at_the_dashboard():
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = ds["datasources"][0]["uid"]
    dash = json.loads((DEPLOY / "grafana/dashboards/titan_k3.json").read_text())
    for panel in dash["panels"]:
        assert panel["datasource"]["uid"] == uid and panel["targets"], panel["title"]
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    assert set(compose["services"]) == {"k3-service", "prometheus", "grafana"}
    mounts = " ".join(compose["services"]["grafana"]["volumes"])
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/titan_k3.yml").read_text())
    assert f"./grafana/dashboards:{provider['providers'][0]['options']['path']}" in mounts
    for port in (p for s in compose["services"].values() for p in s.get("ports", [])):
        assert port.startswith("127.0.0.1:"), f"compose publishes {port} beyond loopback"
    for mount in (v for s in compose["services"].values() for v in s.get("volumes", [])):
        if mount.startswith("./"):
            assert (DEPLOY / mount.split(":")[0]).exists(), mount
    build = compose["services"]["k3-service"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            assert any((REPO / src.rstrip("*")).exists() for src in sources), line


def test_compose_sets_only_settings_the_service_reads():
    settings = (REPO / "service/settings.py").read_text()
    for path in (DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.gpu.yml"):
        env = yaml.safe_load(path.read_text())["services"]["k3-service"]["environment"]
        assert env and all(f'"{name}"' in settings for name in env), (path.name, sorted(env))


def test_kubernetes_and_slurm_launch_torchrun_with_c10d_and_valid_configs():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes/jobset.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert {"ConfigMap", "PersistentVolumeClaim", "JobSet"} <= set(kinds)
    recipe = kinds["ConfigMap"]["data"]["pretrain.toml"]
    job = kinds["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    args = job["template"]["spec"]["containers"][0]["args"]
    assert "--rdzv-backend=c10d" in args and f"--nnodes={job['parallelism']}" in args
    head = f"{kinds['JobSet']['metadata']['name']}-{kinds['JobSet']['spec']['replicatedJobs'][0]['name']}-0-0"
    assert any(a.startswith(f"--rdzv-endpoint={head}.{kinds['JobSet']['spec']['network']['subdomain']}:") for a in args)
    trainer_args = args[args.index("titan_k3.train") + 1:]
    load_job_config([a for a in trainer_args if not a.startswith("--job.config_file")], toml_text=recipe)

    ptj = yaml.safe_load((DEPLOY / "kubernetes/pytorchjob.yaml").read_text())
    assert ptj["spec"]["elasticPolicy"]["rdzvBackend"] == "c10d"

    sbatch = (DEPLOY / "slurm/train.sbatch").read_text()
    for needle in ("srun", "deploy/k3_torchrun.py", "--rdzv-backend c10d", "--rdzv-endpoint", "-m titan_k3.train"):
        assert needle in sbatch, needle
    if shutil.which("bash"):
        assert subprocess.run(["bash", "-n", str(DEPLOY / "slurm/train.sbatch")]).returncode == 0


# ---- Prometheus: the alerts' unit tests and the shipped config ------------------------------------

ALERT_TESTS = sorted((DEPLOY / "prometheus").glob("*.test.yml"))


@needs_promtool
def test_promtool_unit_tests_prove_every_alert():
    alerts = alert_names()
    tested = {case["alertname"] for path in ALERT_TESTS for t in yaml.safe_load(path.read_text())["tests"]
              for case in t.get("alert_rule_test", [])}
    assert alerts and alerts <= tested, f"alerts without a promtool unit test: {sorted(alerts - tested)}"
    out = subprocess.run([PROMTOOL, "test", "rules", *map(str, ALERT_TESTS)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_promtool
def test_shipped_prometheus_config_passes_promtool_check_config(tmp_path):
    """As shipped, from any working directory: its rule file and target files resolve beside it."""
    for cwd in (REPO, tmp_path):
        out = subprocess.run([PROMTOOL, "check", "config", str(DEPLOY / "prometheus/prometheus.yml")],
                             capture_output=True, text=True, cwd=cwd, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "1 rule files found" in out.stdout and f"{len(alert_names())} rules found" in out.stdout, out.stdout
    # The service's targets name the run the trainer's own `run` label names: kept, not doubled as exported_run.
    jobs = {job["job_name"]: job for job in yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
            ["scrape_configs"]}
    assert jobs["k3-trainer"].get("honor_labels") is True
    assert jobs["k3-trainer-external"].get("honor_labels") is True  # a trainer's own run label, wherever it runs
    from titan_k3.metrics.prometheus import NAMES
    assert NAMES and all("run" not in labels for _, labels, _ in NAMES.values())  # `run` is added to every one
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"] if v.startswith("./"))
    config_dir = Path(mounts["./prometheus/prometheus.yml"]).parent
    cfg = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    # In the container each relative path lands where compose mounts the repo's file.
    for rel in cfg["rule_files"]:
        assert not Path(rel).is_absolute() and mounts[f"./prometheus/{rel}"] == str(config_dir / rel)
    for job in cfg["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            for pattern in sd["files"]:
                folder = Path(pattern).parent
                assert mounts[f"./prometheus/{folder}"] == str(config_dir / folder), pattern


# ---- the image: .dockerignore and the torch pin -------------------------------------------------

def _docker_pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex over a slash path ('**' spans folders, '*' does not)."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, lines: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for line in lines:
        negate = line.startswith("!")
        rx = _docker_pattern(line.lstrip("!").strip("/"))
        if any(rx.match(c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_secrets_state_and_caches_out_of_the_build_context():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    left_out = [".venv/bin/python", ".git/config", "runs/smoke-1/metrics.jsonl", "k3-service/token",
                "k3-service/registry.sqlite3", "data/shards/000.bin", ".env", "titan_k3.egg-info/PKG-INFO",
                "titan_k3/__pycache__/train.cpython-311.pyc", "service/__pycache__/app.cpython-311.pyc",
                ".pytest_cache/v/cache/nodeids", ".hypothesis/examples/x", "benchmarks/results/x.json"]
    assert [p for p in left_out if not dockerignored(p, lines)] == []
    # Everything the Dockerfile copies stays in.
    sources = [src for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")
               for src in line.split()[1:-1]]
    assert "deploy/k3_torchrun.py" in sources
    kept = subprocess.run(["git", "ls-files", "--", *sources], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()
    assert len(kept) > 20 and [p for p in kept if dockerignored(p, lines)] == []


def test_dockerfile_pins_the_torch_each_image_is_tested_on():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    gpu_pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", dockerfile, re.M).group(1)
    cpu_pin = re.search(r"--build-arg TORCH_VERSION=(\S+) --build-arg TORCH_INDEX=\S+/whl/cpu", dockerfile).group(1)
    assert re.fullmatch(r"\d+\.\d+\.\d+", gpu_pin), f"GPU image torch pin {gpu_pin!r} is not one exact version"
    # The CPU image has the torch CI installs (Makefile); the GPU one the GPU machine's, whose
    # Triton the shipped kernel specializations were recorded with.
    assert cpu_pin == re.search(r"torch==(\S+)", (REPO / "Makefile").read_text()).group(1)
    assert gpu_pin == "2.11.0" and (REPO / "kernels/specializations/triton-3.6.0-cuda-90.json").exists()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', (REPO / "pyproject.toml").read_text()).groups()
    assert tuple(map(int, gpu_pin.split(".")[:2])) >= tuple(map(int, floor))
    assert f"--uid {IMAGE_UID} --gid {IMAGE_GID}" in dockerfile and "\nUSER k3\n" in dockerfile


# ---- graceful stop: Kubernetes ------------------------------------------------------------------

def pod_specs() -> dict[str, dict]:
    jobset = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes/jobset.yaml").read_text()) if d}
    ptj = yaml.safe_load((DEPLOY / "kubernetes/pytorchjob.yaml").read_text())
    return {"jobset": jobset["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"],
            "pytorchjob": ptj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]}


@pytest.mark.parametrize("kind", ["jobset", "pytorchjob"])
def test_kubernetes_pods_stop_gracefully_and_can_write_the_run_volume(kind):
    pod = pod_specs()[kind]
    container = pod["containers"][0]
    # SIGTERM reaches k3-torchrun (under tini), which stops the ranks instead of torchrun.
    assert container["command"] == ["tini", "--", "k3-torchrun"]
    env = {e["name"]: e["value"] for e in container["env"]}
    shutdown = int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert shutdown >= STOP_BUDGET_SECONDS
    # The kubelet's SIGKILL comes after torchrun's own escalation and time to exit.
    assert pod["terminationGracePeriodSeconds"] >= shutdown + 30
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == IMAGE_UID and sc["fsGroup"] == IMAGE_GID
    assert sc["fsGroupChangePolicy"] == "OnRootMismatch"
    assert "--checkpoint.save_on_stop=true" in container["args"]
    runs = next(m for m in container["volumeMounts"] if m["name"] == "runs")
    assert runs["mountPath"] == "/runs" and "--job.dump_folder=/runs" in container["args"]


def test_kubernetes_recipe_serves_metrics_to_the_pod_network():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes/jobset.yaml").read_text()) if d}
    cfg = load_job_config([], toml_text=docs["ConfigMap"]["data"]["pretrain.toml"])
    port = cfg.metrics.prometheus_port
    assert cfg.metrics.prometheus_host == "0.0.0.0" and cfg.checkpoint.enable
    job = docs["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert job["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert {"name": "metrics", "containerPort": port} in job["spec"]["containers"][0]["ports"]


# ---- graceful stop: the launcher, under real torchrun --------------------------------------------

RANK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
out, save_seconds = Path(sys.argv[1]), float(sys.argv[2])
rank = os.environ["RANK"]
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(out / f"ready-{rank}").write_text(str(os.getpid()))
deadline = time.time() + 90
while not stop and time.time() < deadline:
    time.sleep(0.05)
if not stop:
    sys.exit(3)
time.sleep(save_seconds)  # the stop checkpoint
(out / f"saved-{rank}").write_text("")
"""
SAVE_SECONDS = 2.0


def _start_ranks(tmp_path: Path, launcher: list[str]) -> tuple[subprocess.Popen, Path]:
    """Two ranks under `launcher` that save for SAVE_SECONDS on SIGTERM; returns once both run."""
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    # torchrun's own SIGKILL would come 1 s after it is signalled, before the 2 s save ends.
    env = {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([*launcher, "--standalone", "--nproc_per_node", "2", str(script), str(out),
                             str(SAVE_SECONDS)], env=env, cwd=tmp_path)
    deadline = time.time() + 90
    while len(list(out.glob("ready-*"))) < 2:
        assert proc.poll() is None, f"launcher exited early with {proc.returncode}"
        assert time.time() < deadline, "ranks did not start"
        time.sleep(0.1)
    return proc, out


def _finish(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()


@pytest.mark.parametrize("orchestrator", ["kubernetes", "slurm"])
def test_k3_torchrun_turns_a_stop_into_saved_ranks_and_exit_0(tmp_path, orchestrator):
    proc, out = _start_ranks(tmp_path, [sys.executable, str(DEPLOY / "k3_torchrun.py")])
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 3  # torchrun and its two ranks
    if orchestrator == "kubernetes":
        proc.send_signal(signal.SIGTERM)  # the kubelet signals the main process (under tini)
    else:
        # srun forwards SIGUSR1 to the step, which may reach every process in it.
        for p in [psutil.Process(proc.pid), *tree]:
            p.send_signal(signal.SIGUSR1)
    assert _finish(proc) == 0
    assert sorted(p.name for p in out.glob("saved-*")) == ["saved-0", "saved-1"]


# ---- graceful stop: the Slurm batch script, under a stand-in srun --------------------------------

FAKE_SRUN = """#!{python}
import os, signal, sys, time
from pathlib import Path
log = Path(os.environ["FAKE_LOG"])
(log / "args").write_text("\\n".join(sys.argv[1:]))
got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append("USR1"))
# Real srun answers SIGTERM by SIGKILLing its tasks: a stop must not come that way.
signal.signal(signal.SIGTERM, lambda *_: ((log / "killed").write_text(""), os._exit(137)))
(log / "ready").write_text("")
if os.environ.get("FAKE_SRUN_EXIT"):
    sys.exit(int(os.environ["FAKE_SRUN_EXIT"]))
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.02)
time.sleep(0.5)  # the ranks save
(log / "saved").write_text(" ".join(got))
sys.exit(0 if got else 4)
"""
FAKE_SCONTROL = """#!/bin/sh
case "$1" in
  show) printf 'node-a\\nnode-b\\n' ;;
  requeue) echo "$2" > "$FAKE_LOG/requeued" ;;
esac
"""


def _run_sbatch(tmp_path: Path, stop: bool, **env_extra: str) -> tuple[int, Path]:
    bindir, log = tmp_path / "bin", tmp_path / "log"
    bindir.mkdir()
    log.mkdir()
    for name, text in (("srun", FAKE_SRUN.format(python=sys.executable)), ("scontrol", FAKE_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
           "SLURM_JOB_ID": "42", "SLURM_JOB_NAME": "k3", "SLURM_JOB_NODELIST": "node-[a-b]",
           "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(REPO), "K3_RUNS_DIR": str(tmp_path / "runs"), **env_extra}
    proc = subprocess.Popen(["bash", str(DEPLOY / "slurm/train.sbatch"), "tomls/pretrain.toml",
                             "--training.steps", "5"], env=env, cwd=tmp_path)
    deadline = time.time() + 30
    while not (log / "ready").exists():
        assert time.time() < deadline and proc.poll() is None, "the batch script did not start srun"
        time.sleep(0.05)
    if stop:
        proc.send_signal(signal.SIGTERM)  # --signal=B:TERM@120 (or scancel --batch --signal=TERM)
    return proc.wait(timeout=60), log


def test_slurm_script_asks_for_an_early_stop_signal():
    sbatch = (DEPLOY / "slurm/train.sbatch").read_text()
    lead = int(re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", sbatch, re.M).group(1))
    assert lead >= STOP_BUDGET_SECONDS and re.search(r"^trap forward_stop TERM", sbatch, re.M)
    assert "deploy/k3_torchrun.py" in sbatch and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in sbatch


def test_slurm_graceful_stop_reaches_the_launcher_and_exits_0(tmp_path):
    rc, log = _run_sbatch(tmp_path, stop=True)
    assert rc == 0
    assert (log / "saved").read_text() == "USR1" and not (log / "killed").exists()
    assert not (log / "requeued").exists()
    args = (log / "args").read_text().splitlines()
    assert args[args.index("python") + 1] == str(REPO / "deploy/k3_torchrun.py")
    assert "node-a:29500" in args and args[args.index("--job.name") + 1] == "k3-42"
    assert args[args.index("--checkpoint.save_on_stop") + 1] == "true"


def test_slurm_graceful_stop_requeues_when_asked(tmp_path):
    rc, log = _run_sbatch(tmp_path, stop=True, K3_REQUEUE_ON_STOP="1")
    assert rc == 0 and (log / "requeued").read_text().strip() == "42"


def test_slurm_failure_without_a_stop_keeps_its_status(tmp_path):
    rc, log = _run_sbatch(tmp_path, stop=False, FAKE_SRUN_EXIT="1")
    assert rc == 1 and not (log / "requeued").exists()


# ---- the alerts in a real Prometheus, scraping the service -----------------------------------------

PROMETHEUS = shutil.which("prometheus")
INLINE_RUN = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus missing (apt-get install prometheus; see .ci/system-deps.sh)")
def test_a_real_prometheus_fires_and_resolves_the_alerts_on_the_service(make_service, tmp_path):
    svc = make_service(fake=True, step_seconds=0.05)
    assert svc.create(toml=INLINE_RUN, name="live", overrides={"training.steps": 100000}).status_code == 201
    assert svc.create(toml=INLINE_RUN, name="boom", restart_limit=0,
                      overrides={"debug.crash_at_step": 1}).status_code == 201
    svc.wait_state("live", ("running",))
    svc.wait_state("boom", ("failed",))
    cfg = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
           "rule_files": [str(DEPLOY / "prometheus/alerts.yml")],
           "scrape_configs": [{"job_name": "k3-service", "static_configs": [{"targets": [f"127.0.0.1:{svc.port}"]}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    port = free_port()
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def firing() -> set[tuple[str, str]]:
        assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
        try:
            response = client.get("/api/v1/alerts")
        except httpx.TransportError:
            return set()
        if response.status_code == 503:  # Prometheus answers "Service Unavailable" until its storage is ready
            return set()
        alerts = response.json()["data"]["alerts"]
        return {(a["labels"]["alertname"], a["labels"]["run"]) for a in alerts if a["state"] == "firing"}

    try:
        wait_until(lambda: ("K3RunFailed", "boom") in firing(), 60, "K3RunFailed for the failed run")
        assert not {a for a in firing() if a[1] == "live"}
        # The first invariant violation and a fallback, as the trainer appends them to events.jsonl.
        with (svc.state_dir / "runs" / "live" / "events.jsonl").open("a") as f:
            for kind, extra in (("invariant_violation", {"check": "replica_params_equal"}), ("fallback", {})):
                f.write(json.dumps({"time": time.time(), "step": 5, "kind": kind, "message": "m", **extra}) + "\n")
        wait_until(lambda: {("K3InvariantViolation", "live"), ("K3KernelFallback", "live")} <= firing(), 60,
                   "the first violation and the fallback to fire")
        # Stopped, the run keeps its event counts in /metrics, but the fallback alert resolves.
        assert svc.client.post("/v1/runs/live/stop", headers=svc.auth).status_code == 202
        svc.wait_state("live", ("stopped",))
        wait_until(lambda: ("K3KernelFallback", "live") not in firing(), 60, "the fallback alert to resolve")
        assert 'titan_k3_run_events_total{kind="fallback",run="live"}' in svc.metrics_text()
        # Deleted, the failed run's series leave /metrics and its alert resolves.
        assert ("K3RunFailed", "boom") in firing()
        assert svc.client.delete("/v1/runs/boom", headers=svc.auth).status_code == 200
        wait_until(lambda: ("K3RunFailed", "boom") not in firing(), 60, "K3RunFailed to resolve on DELETE")
    finally:
        client.close()
        prom.terminate()
        prom.wait(timeout=30)
