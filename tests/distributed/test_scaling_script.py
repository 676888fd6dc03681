"""benchmarks/scaling.py end to end on CPU (gloo, debug flavor): the tool the two-GPU measurement uses."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_scaling_script_runs_every_setup_and_compares_losses(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--flavor", "debug", "--steps", "4", "--seq", "64",
           "--batch", "2", "--log-freq", "2", "--warmup-step", "2", "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "BENCH_RUNS": str(tmp_path / "runs")})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((out / "scaling.json").read_text())["rows"]
    assert [(r["setup"], r["gpus"]) for r in rows] == [("1 GPU", 1), ("FSDP2 x2", 2), ("FSDP2 x2 + EP2", 2)]
    assert all("error" not in r for r in rows), rows
    base = rows[0]["losses"]
    for r in rows[1:]:  # the same global batch: one process accumulating equals two processes side by side
        assert r["losses"].keys() == base.keys()
        assert all(abs(r["losses"][s] / base[s] - 1) < 1e-3 for s in base), (r["setup"], r["losses"], base)
    table = (out / "scaling.md").read_text()
    assert table.count("| FSDP2 x2") == 2 and "failed" not in table
