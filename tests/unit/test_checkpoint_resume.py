"""Exact resume through the real trainer CLI (subprocesses, CPU, debug flavor).

A run of 8 updates is the reference. Runs interrupted by os._exit after update 4
(debug.crash_at_step), by a kill between writing a checkpoint and committing it
(debug.kill_in_save_at_step), and by a true SIGKILL (async saves every update, so
the kill may land inside a background write), then restarted with the same
--job.name, must log bitwise the same loss / grad norm / LR / tokens for every update
and end with bitwise the same model (incl. the Quantile Balancing bias) and optimizer.
SIGTERM must finish the update, save and exit 0. Independent runs go in parallel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from titan_k3.checkpoint.hf import read_dcp_tensors

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
COMMON = [
    "--model.flavor", "debug", "--training.seq_len", "64", "--training.steps", str(STEPS),
    "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0",
]


def _start(dump: Path, name: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "titan_k3.train", *COMMON, "--job.dump_folder", str(dump), "--job.name", name, *extra]
    log = open(dump / f"{name}.log", "a")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, timeout: float = 900) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()


def _log_tail(dump: Path, name: str) -> str:
    return (dump / f"{name}.log").read_text()[-3000:]


def _metrics(run: Path) -> dict[int, dict]:
    """{step: record}; a step logged twice (before a kill and after the resume) keeps the later record."""
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]


def _latest(run: Path) -> str | None:
    try:
        return (run / "checkpoints" / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def _assert_same_run(ref: Path, run: Path) -> None:
    a, b = _metrics(ref), _metrics(run)
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        for key in ("loss", "grad_norm", "lr", "tokens_seen", "skipped_updates"):
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    final_a = read_dcp_tensors(ref / "checkpoints" / f"step-{STEPS}")
    final_b = read_dcp_tensors(run / "checkpoints" / f"step-{STEPS}")
    assert final_a.keys() == final_b.keys()
    assert any(k.endswith("router.qb_bias") for k in final_a)
    assert any(k.startswith("optim.muon.") for k in final_a) and any(k.startswith("optim.adamw.") for k in final_a)
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]), k
    qb = [k for k in final_a if k.endswith("router.qb_bias")]
    assert any(final_a[k].abs().sum() > 0 for k in qb), "routing state never moved: the test would not see it"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Start every first leg in parallel, then the resumes; returns the dump folder."""
    dump = tmp_path_factory.mktemp("resume")
    first = {
        "ref": _start(dump, "ref", "--checkpoint.interval", "4"),
        "crash": _start(dump, "crash", "--checkpoint.interval", "4", "--debug.crash_at_step", "4"),
        "killsave": _start(dump, "killsave", "--checkpoint.interval", "2", "--debug.kill_in_save_at_step", "4"),
        "sigkill": _start(dump, "sigkill", "--checkpoint.interval", "1", "--checkpoint.async_mode", "async"),
        "sigterm": _start(dump, "sigterm", "--checkpoint.interval", "1000", "--training.steps", "1000"),
    }
    # True SIGKILL once the second checkpoint is committed (6 updates of margin before the run would end).
    killed_at, deadline = None, time.time() + 900
    while killed_at is None and time.time() < deadline and first["sigkill"].poll() is None:
        latest = _latest(dump / "sigkill")
        if latest is not None and int(latest.split("-")[1]) >= 2:
            first["sigkill"].send_signal(signal.SIGKILL)
            killed_at = latest
        time.sleep(0.01)
    # SIGTERM once the first update is logged.
    while time.time() < deadline and first["sigterm"].poll() is None:
        if (dump / "sigterm" / "metrics.jsonl").is_file():
            first["sigterm"].send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    codes = {name: _finish(p) for name, p in first.items()}
    states = {"codes": codes, "killed_at": killed_at,
              "latest_after_killsave": _latest(dump / "killsave"),
              "tmp_after_killsave": sorted(p.name for p in (dump / "killsave" / "checkpoints").glob("*.tmp-*"))}
    second = {name: _start(dump, name, "--checkpoint.interval", "4") for name in ("crash", "killsave", "sigkill")}
    states["resume_codes"] = {name: _finish(p) for name, p in second.items()}
    return dump, states


def test_crash_then_resume_is_bitwise_exact(runs):
    dump, s = runs
    assert s["codes"]["ref"] == 0, _log_tail(dump, "ref")
    assert s["codes"]["crash"] == 3, _log_tail(dump, "crash")
    assert s["resume_codes"]["crash"] == 0, _log_tail(dump, "crash")
    resumed = [e for e in _events(dump / "crash") if e["kind"] == "resumed"]
    assert [e["step"] for e in resumed] == [4]
    _assert_same_run(dump / "ref", dump / "crash")


def test_sigkill_then_resume_is_bitwise_exact(runs):
    dump, s = runs
    assert s["killed_at"] is not None, "the run ended before it could be killed"
    assert s["codes"]["sigkill"] == -signal.SIGKILL
    assert s["resume_codes"]["sigkill"] == 0, _log_tail(dump, "sigkill")
    resumed = [e for e in _events(dump / "sigkill") if e["kind"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] >= int(s["killed_at"].split("-")[1])
    _assert_same_run(dump / "ref", dump / "sigkill")


def test_kill_during_save_resumes_from_previous_checkpoint(runs):
    dump, s = runs
    assert s["codes"]["killsave"] == 3, _log_tail(dump, "killsave")
    assert s["latest_after_killsave"] == "step-2"
    assert len(s["tmp_after_killsave"]) == 1 and s["tmp_after_killsave"][0].startswith("step-4.tmp-")
    assert s["resume_codes"]["killsave"] == 0, _log_tail(dump, "killsave")
    events = _events(dump / "killsave")
    discarded = [e for e in events if e["kind"] == "checkpoint_discarded"]
    assert len(discarded) == 1 and discarded[0]["removed"] == s["tmp_after_killsave"]
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [2]
    assert not list((dump / "killsave" / "checkpoints").glob("*.tmp-*"))
    _assert_same_run(dump / "ref", dump / "killsave")


def test_sigterm_finishes_the_update_saves_and_exits_zero(runs):
    dump, s = runs
    run = dump / "sigterm"
    assert s["codes"]["sigterm"] == 0, _log_tail(dump, "sigterm")
    stopped = [e for e in _events(run) if e["kind"] == "stopped"]
    assert len(stopped) == 1 and "SIGTERM" in stopped[0]["message"]
    step = stopped[0]["step"]
    assert 1 <= step < 1000
    assert _latest(run) == f"step-{step}"
    meta = json.loads((run / "checkpoints" / f"step-{step}" / "meta.json").read_text())
    assert meta["step"] == step and meta["train"]["step"] == step
