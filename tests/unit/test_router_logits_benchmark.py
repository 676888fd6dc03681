"""benchmarks/router_logits.py end to end on CPU: a crash costs CI time, not GPU's; the recipe's scores are float32's."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_router_logits_benchmark_times_each_variant_and_finds_the_recipe_float32_accurate(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "router_logits.py"), "--flavor", "debug", "--tokens", "256",
           "--out", str(tmp_path / "out")]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "router_logits.json").read_text())["rows"]
    by = {(r["variant"], r["x_dtype"]): r for r in rows}
    assert set(by) == {(v, d) for v in ("bf16", "recipe", "float32") for d in ("bfloat16", "float32")}
    assert all(r["fwd_ms"] > 0 for r in rows)
    assert all((r["fwd_bwd_ms"] is not None) == (r["variant"] != "float32") for r in rows)
    for dtype in ("bfloat16", "float32"):
        # The recipe's value is the float32 product's; autocast's bf16 product is ~1e3 times further off.
        assert by[("recipe", dtype)]["max_abs_err"] == by[("float32", dtype)]["max_abs_err"] < 1e-5
        assert by[("bf16", dtype)]["max_abs_err"] > 100 * by[("recipe", dtype)]["max_abs_err"]
