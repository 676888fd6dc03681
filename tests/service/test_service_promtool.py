"""The service's /metrics, with finished, stopped and crashed runs in it, passes `promtool check metrics`
(skipped without promtool: apt-get install prometheus)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

PROMTOOL = shutil.which("promtool")
INLINE = '[model]\nflavor = "debug"\n[training]\nsteps = 6\nseq_len = 64\n[metrics]\nlog_freq = 1\n'


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (apt-get install prometheus)")
def test_service_metrics_pass_promtool(fake_service):
    svc = fake_service
    assert svc.create(toml=INLINE, name="prom-done").status_code == 201
    assert svc.create(toml=INLINE, name="prom-crash", restart_limit=0,
                      overrides={"debug.crash_at_step": 2}).status_code == 201
    svc.wait_state("prom-done", ("finished",))
    svc.wait_state("prom-crash", ("failed",))
    text = svc.metrics_text()
    assert 'run="prom-done"' in text and "titan_k3_run_loss" in text
    out = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # No lint finding is allowed either (promtool exits 3 for lint findings alone).
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
