"""benchmarks/scaling.py end to end on CPU (gloo, debug flavor): the tool the two-GPU measurement uses."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _scaling(tmp_path: Path, out: Path, *extra: str) -> list[dict]:
    cmd = [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--flavor", "debug", "--steps", "4", "--seq", "64",
           "--batch", "2", "--log-freq", "2", "--warmup-step", "2", "--out", str(out), *extra]
    env = {**os.environ, "BENCH_RUNS": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads((out / "scaling.json").read_text())["rows"]


def test_scaling_script_runs_every_setup_and_compares_losses(tmp_path):
    # The one-GPU run launches alone first, as it does on its own GPU beside the noise reference;
    # the full run merges its row instead of launching it again.
    first = _scaling(tmp_path, tmp_path / "first", "--only", "1 GPU")
    assert [r["setup"] for r in first] == ["1 GPU"]
    rows = _scaling(tmp_path, tmp_path / "results", "--merge", str(tmp_path / "first" / "scaling.json"),
                    "--", "--profiling.enable", "true", "--profiling.start_step", "3")
    assert rows[0]["losses"] == first[0]["losses"]
    assert [(r["setup"], r["gpus"]) for r in rows] == [
        ("1 GPU", 1), ("1 GPU, split finer", 1), ("FSDP2 x2", 2), ("FSDP2 x2 + EP2", 2)]
    failed = [r for r in rows if "error" in r]
    if failed:
        # NOTE: a torchrun launch on the loaded 2-core CI machine once failed transiently (one setup of three);
        # the failing setup gets one more launch, and its first error is reported, never hidden.
        warnings.warn(f"scaling setups failed once and were relaunched: {[(r['setup'], r['error']) for r in failed]}")
        again = _scaling(tmp_path, tmp_path / "again", "--only", *(r["setup"] for r in failed))
        assert all("error" not in r for r in again), again
        rows = [next((a for a in again if a["setup"] == r["setup"]), r) for r in rows]
    assert all(r["startup_s"] > 0 for r in rows)  # rank 0's process start to its first update, from events.jsonl
    base = rows[0]["losses"]
    for r in rows[1:]:  # the same global batch: one process accumulating equals two processes side by side
        assert r["losses"].keys() == base.keys()
        assert all(abs(r["losses"][s] / base[s] - 1) < 1e-3 for s in base), (r["setup"], r["losses"], base)
        assert r["max_abs_gap"] == max(abs(r["losses"][s] - base[s]) for s in base)
    if not failed:
        profiles = sorted(p.name for p in (tmp_path / "results" / "profiles").glob("profile-*.txt"))  # every rank of the launches
        assert profiles == ["profile-1gpu,splitfiner-rank0.txt", "profile-fsdp2x2-ep2-rank0.txt",
                            "profile-fsdp2x2-ep2-rank1.txt", "profile-fsdp2x2-rank0.txt", "profile-fsdp2x2-rank1.txt"]
        table = (tmp_path / "results" / "scaling.md").read_text()
        assert table.count("| FSDP2 x2") == 2 and "failed" not in table
        noise_row = next(line for line in table.splitlines() if "| 1 GPU, split finer |" in line)
        assert noise_row.count("—") == 1  # its own gap over the noise is not a measurement


def test_weak_scaling_setups_give_every_gpu_the_one_gpu_work():
    sys.path.insert(0, str(REPO))
    from benchmarks.scaling import setups

    strong = setups(2, 8)
    assert strong["1 GPU"] == (1, ["--training.grad_accum", "2"]) and strong["FSDP2 x2"] == (2, [])
    weak = setups(2, 8, weak_accum=2)
    assert list(weak) == ["1 GPU", "FSDP2 x2", "FSDP2 x2 + EP2"]  # no noise reference: losses are not compared
    assert weak["1 GPU"] == (1, ["--training.grad_accum", "2"]) and weak["FSDP2 x2"] == (2, ["--training.grad_accum", "2"])
    assert weak["FSDP2 x2 + EP2"] == (2, ["--training.grad_accum", "2", "--parallelism.expert_parallel_degree", "2"])


def test_a_stopped_scaling_run_keeps_the_setups_it_finished(tmp_path, monkeypatch):
    """A time limit that stops the script during its second setup leaves the first setup's row in scaling.json."""
    sys.path.insert(0, str(REPO))
    import benchmarks.scaling as scaling

    run_dir = tmp_path / "1gpu"
    run_dir.mkdir()
    records = [{"step": s, "loss": 5.0 - s / 10, "training_seconds": 1.0 * s, "tokens_seen": 1000 * s} for s in (2, 4)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def launch(name, *_):
        if name == "1 GPU":
            return run_dir
        raise KeyboardInterrupt  # what a time limit's signal looks like to the script

    monkeypatch.setattr(scaling, "launch", launch)
    monkeypatch.setattr(sys, "argv", ["scaling.py", "--flavor", "debug", "--warmup-step", "2", "--out", str(tmp_path / "out")])
    with pytest.raises(KeyboardInterrupt):  # the second setup is interrupted
        scaling.main()
    rows = json.loads((tmp_path / "out" / "scaling.json").read_text())["rows"]
    assert [r["setup"] for r in rows] == ["1 GPU"] and rows[0]["tokens_per_s"] == 1000.0
