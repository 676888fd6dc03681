"""benchmarks/max_logit.py end to end on CPU (Triton's interpreter), debug flavor: a crash costs CI time, not GPU's."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_max_logit_benchmark_checks_and_times_both_layouts(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "max_logit.py"), "--flavor", "debug", "--seq", "64",
           "--batch", "2", "--doc-len", "20", "--sweep", "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "max_logit.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["causal", "docs ~20"]
    assert all(r[f"{v}_ms"] > 0 for r in rows for v in ("reference", "ours"))
    assert "| B2 T64 H2 E24 float32 | docs ~20 |" in (tmp_path / "out" / "max_logit.md").read_text()
    assert run.stdout.count("sweep docs ~20 BQ") == 8 and "failed" not in run.stdout
