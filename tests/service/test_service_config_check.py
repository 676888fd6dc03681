"""The trainer's side of the service's contract: the host check the service runs before it accepts a run
(`titan_k3.config.check`), `--job.validate_only`, finite and 64-bit config numbers, and the metrics endpoint
on loopback unless configured."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import urllib.request

import pytest

from service_harness import REPO
from titan_k3.config import ConfigError, load_job_config
from titan_k3.config.check import CONFIG_ERROR_EXIT, check_host, config_error


@pytest.mark.parametrize("argv, fragment", [
    (["--optimizer.lr", "inf"], "'optimizer.lr' = inf: expected a finite number"),
    (["--optimizer.lr", "-inf"], "expected a finite number"),
    (["--training.max_norm", "nan"], "'training.max_norm' = nan: expected a finite number"),
    (["--training.steps", str(10**30)], "'training.steps' = 1000000000000000000000000000000: out of range"),
    (["--training.seed", str(-(2**63) - 1)], "out of range"),
])
def test_numbers_no_run_can_use_are_config_errors(argv, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_job_config(argv)


def test_numbers_from_toml_are_checked_too():
    with pytest.raises(ConfigError, match=r"<inline TOML>: config key 'optimizer\.lr' = inf"):
        load_job_config([], toml_text="[optimizer]\nlr = inf\n")
    assert load_job_config(["--training.steps", str(2**63 - 1)]).training.steps == 2**63 - 1


@pytest.mark.parametrize("argv, fragment", [
    (["--data.mixture", "code:1,web:2"], "config key 'data.mixture' = 'code:1,web:2': unknown source(s) ['web']; "
                                          "the dataset has ['code', 'prose']"),
    (["--data.mixture", "prose:1"], "no weight for source(s) ['code']"),
    (["--data.dataset", "/nonexistent/k3-data"], "config key 'data.dataset' = '/nonexistent/k3-data': dataset"),
    (["--data.tokenizer", "/nonexistent/tok.json"], "config key 'data.tokenizer' = '/nonexistent/tok.json': no such"),
    (["--eval.tasks", "/nonexistent/a.jsonl"], "config key 'eval.tasks' = '/nonexistent/a.jsonl': no such"),
])
def test_host_check_names_the_key(argv, fragment):
    assert fragment in config_error(argv)


def test_host_check_refuses_a_port_in_use_and_passes_a_free_one():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        error = config_error(["--metrics.prometheus_port", str(port)])
        assert error.startswith(f"config key 'metrics.prometheus_port' = {port}: cannot listen on 127.0.0.1:{port}")
    check_host(load_job_config(["--metrics.prometheus_port", str(port), "--data.mixture", "code:1,prose:3"]))


def test_check_command_prints_one_line_and_exits_with_the_config_error_status():
    cmd = [sys.executable, "-m", "titan_k3.config.check", "-", "--training.steps", "5"]
    bad = subprocess.run(cmd, input='[data]\nmixture = "code:1,web:1"\n', capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert bad.returncode == CONFIG_ERROR_EXIT == 2
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("error: config key 'data.mixture'")
    good = subprocess.run(cmd, input="", capture_output=True, text=True, cwd=REPO, timeout=120)
    assert (good.returncode, good.stdout) == (0, "config ok\n")
    code = "import sys, titan_k3.config.check; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          timeout=120).stdout.strip() == "False"


def test_trainer_validate_only_checks_and_exits_without_a_run_directory(tmp_path):
    base = [sys.executable, "-m", "titan_k3.train", "--job.validate_only", "true", "--job.dump_folder",
            str(tmp_path), "--job.name", "v", "--model.flavor", "debug"]
    ok = subprocess.run(base, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert ok.returncode == 0 and ok.stdout.strip().endswith("config ok"), ok.stderr[-2000:]
    bad = subprocess.run(base + ["--data.mixture", "code:1,web:1"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert bad.returncode == CONFIG_ERROR_EXIT and "unknown source(s) ['web']" in bad.stderr
    assert list(tmp_path.iterdir()) == []


def test_trainer_metrics_endpoint_listens_on_loopback_unless_configured():
    from titan_k3.metrics.prometheus import PrometheusExporter

    exporter = PrometheusExporter("r")
    try:
        port = exporter.serve(0)
        assert exporter._server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert r.status == 200
    finally:
        exporter.close()
    assert load_job_config([]).metrics.prometheus_host == "127.0.0.1"
