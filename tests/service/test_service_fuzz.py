"""Schemathesis fuzzes the OpenAPI schema of a running service: no request may get a 5xx.

Bounded: --max-time 20 s, at most one training at a time (fake trainer), the SSE stream
excluded (it follows a live run by design; test_service_api covers it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service_harness import TOKEN

# NOTE: the interpreter's own scripts first ('st' elsewhere on PATH may be another program).
ST = next((str(p) for p in (Path(sys.executable).parent / n for n in ("schemathesis", "st")) if p.exists()),
          shutil.which("schemathesis"))


@pytest.mark.skipif(ST is None, reason="schemathesis is not installed (pip install -e '.[dev]')")
def test_openapi_fuzz_finds_no_server_error(make_service, tmp_path):
    svc = make_service("fuzz", fake=True, gpus=1, max_running=1, step_seconds=0.01)
    cmd = [ST, "run", f"{svc.url}/openapi.json", "--checks", "not_a_server_error", "--max-time", "20",
           "--seed", "7", "--workers", "1", "--phases", "examples,coverage,fuzzing", "--request-timeout", "10",
           "--exclude-path-regex", "/logs/stream$", "-H", f"Authorization: Bearer {TOKEN}",
           "--suppress-health-check", "all", "--report", "junit", "--report-dir", str(tmp_path / "report")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    counts = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert counts and counts.group(1) == counts.group(2) and int(counts.group(1)) >= 200, report
    assert svc.client.get("/healthz").status_code == 200
    assert "Traceback" not in svc.log_path.read_text(), svc.log_path.read_text()[-4000:]
