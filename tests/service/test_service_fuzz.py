"""Schemathesis fuzzes the OpenAPI schema of a running service with every check it has.

Every answer must match the schema (422 bodies, documented 401/404/409/429, status codes, content
types), no request may get a 5xx, and a method a path lacks gets 405 with an Allow header.
Bounded: at most 40 examples per operation and phase and 90 s, one training at a time (fake
trainer), the SSE stream excluded (it follows a live run by design; test_service_api covers it).
tests/service/schemathesis.toml says why POST /v1/runs may refuse a schema-valid body with 422.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service_harness import TOKEN

HERE = Path(__file__).resolve().parent
# NOTE: the interpreter's own scripts first ('st' elsewhere on PATH may be another program).
ST = next((str(p) for p in (Path(sys.executable).parent / n for n in ("schemathesis", "st")) if p.exists()),
          shutil.which("schemathesis"))


@pytest.mark.skipif(ST is None, reason="schemathesis is not installed (pip install -e '.[dev]')")
def test_openapi_fuzz_finds_no_failure(make_service, tmp_path):
    svc = make_service("fuzz", fake=True, gpus=1, step_seconds=0.01)
    cmd = [ST, "--config-file", str(HERE / "schemathesis.toml"), "run", f"{svc.url}/openapi.json",
           "--checks", "all", "--max-examples", "40", "--max-time", "90", "--seed", "7", "--workers", "1",
           "--request-timeout", "10", "--exclude-path-regex", "/logs/stream$", "-H", f"Authorization: Bearer {TOKEN}",
           "--suppress-health-check", "all", "--report", "junit", "--report-dir", str(tmp_path / "report")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    report = out.stdout[-6000:] + out.stderr[-2000:]
    assert out.returncode == 0, report
    counts = re.search(r"(\d+) generated, (\d+) passed", out.stdout)
    assert counts and counts.group(1) == counts.group(2) and int(counts.group(1)) >= 200, report
    assert "No issues found" in out.stdout, report
    assert svc.client.get("/healthz").status_code == 200
    assert "Traceback" not in svc.log_path.read_text(), svc.log_path.read_text()[-4000:]
