"""benchmarks/short_conv.py end to end on CPU (Triton's interpreter), debug flavor: a crash costs CI time, not GPU's."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_short_conv_benchmark_checks_and_times_both_variants(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "short_conv.py"), "--flavor", "debug", "--seq", "64",
           "--batch", "2", "--doc-len", "20", "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-2000:]
    row, = json.loads((tmp_path / "out" / "short_conv.json").read_text())["rows"]
    assert row["compiled_ms"] > 0 and row["ours_ms"] > 0 and max(row["ours_rel_rms"]) < 1e-5
    assert "check ours: rel-RMS" in run.stdout and "| docs ~20 |" in (tmp_path / "out" / "short_conv.md").read_text()
    # fla's kernel is the strongest public baseline; without CUDA it is skipped out loud, and the ratio names the other
    assert "fla skipped: " in run.stdout and row["baseline"] == "compiled"
    assert "— (skipped)" in (tmp_path / "out" / "short_conv.md").read_text()
