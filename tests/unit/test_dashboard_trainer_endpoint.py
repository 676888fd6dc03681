"""The dashboard shows a run started outside the service (Kubernetes, Slurm) from its trainer's rank-0 endpoint alone.

Every metric of the trainer's exporter table (titan_k3.metrics.prometheus.NAMES) is queried by a panel, and each
panel that reads a service series of a quantity the trainer also exports falls back to the trainer's series with
`or on(run, ...)`: one line per run, whichever source has it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from titan_k3.metrics.moe_stats import DEAD_SHARE
from titan_k3.metrics.prometheus import NAMES

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/dashboards/titan_k3.json"

# service series -> the trainer series of the same quantity
SAME = {
    "titan_k3_run_loss": "titan_k3_loss",
    "titan_k3_run_tokens_per_second_by_clock": "titan_k3_tokens_per_second",
    "titan_k3_run_mfu": "titan_k3_mfu",
    "titan_k3_run_memory_peak_allocated_gib": "titan_k3_memory_bytes",
    "titan_k3_run_lr": "titan_k3_learning_rate",
    "titan_k3_run_grad_norm_by_group": "titan_k3_grad_norm",
    "titan_k3_run_skipped_updates": "titan_k3_skipped_updates_total",
    "titan_k3_run_tokens_seen": "titan_k3_tokens_total",
    "titan_k3_run_tokens_by_source": "titan_k3_tokens_by_source_total",
    "titan_k3_run_moe_maxvio_by_layer": "titan_k3_expert_maxvio",
    "titan_k3_run_moe_dead_fraction_by_layer": "titan_k3_dead_expert_fraction",
    "titan_k3_run_moe_load_cv_by_layer": "titan_k3_expert_load_cv",
    "titan_k3_run_moe_entropy_by_layer": "titan_k3_expert_load_entropy",
    "titan_k3_run_data_wait_fraction": "titan_k3_data_wait_fraction",
}


def _exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def _names(expr: str) -> set[str]:
    return set(re.findall(r"titan_k3_[a-z0-9_]+", expr))


def test_every_trainer_metric_is_on_the_dashboard():
    queried = set().union(*map(_names, _exprs()))
    trainer = {n + "_bucket" if kind == "histogram" else n for n, (kind, _, _) in NAMES.items()}
    missing = trainer - queried - {"titan_k3_step"}  # the run list's source (templating)
    assert not missing, f"the trainer exports these but no panel shows them: {sorted(missing)}"


def test_service_panels_fall_back_to_the_trainer_endpoint():
    for expr in _exprs():
        for service, trainer in SAME.items():
            if re.search(rf"\b{service}\b", expr):
                assert trainer in _names(expr) and " or on(run" in expr, (service, expr)


def test_panels_say_what_their_series_hold():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    # Both sources give GiB (2^30 bytes): Grafana's 'gbytes'; 'decgbytes' showed them as GB (10^9), 7% off.
    assert panels["Peak memory allocated (GiB)"]["fieldConfig"]["defaults"]["unit"] == "gbytes"
    # A dead expert is one under DEAD_SHARE of the uniform share (moe_stats), not one that received no tokens.
    assert f"under {DEAD_SHARE:.0%} of the uniform share" in panels["Dead-expert fraction"]["description"]
    # The training clock times the batch fetch (TwoClocks.training wraps the whole update, the loader's wait inside it):
    # the panels said data waits were the session clock's alone, and the data-wait panel spoke of "the same signals".
    throughput = panels["Throughput (tokens/s)"]["description"]
    assert "batch fetch included" in throughput and "data waits" not in throughput
    wait = next(p for title, p in panels.items() if title.startswith("Data wait"))["description"]
    assert "on the training clock" in wait and "same signals" not in wait


def test_every_panel_query_parses(tmp_path):
    import shutil
    import subprocess

    import pytest
    import yaml

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed")
    rules = [{"record": f"panel_query_{i}", "expr": e.replace("$run", ".*").replace("$__rate_interval", "1m")}
             for i, e in enumerate(_exprs())]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
