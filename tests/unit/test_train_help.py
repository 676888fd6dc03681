"""`python -m titan_k3.train --help`: answered before torch is imported, and quiet when its reader goes away."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import runpy, sys
sys.argv = ["titan_k3.train", "--help"]
try:
    runpy.run_module("titan_k3.train", run_name="__main__", alter_sys=True)
except SystemExit as e:
    status = e.code
print("STATUS", status, "TORCH", "torch" in sys.modules, file=sys.stderr)
"""


def test_help_imports_no_torch():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("usage: python -m titan_k3.train")
    assert "--model.flavor" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == "STATUS 0 TORCH False"


def test_help_into_a_closed_pipe_exits_0_without_a_traceback():
    # NOTE: the read end is closed before the child writes, so its first write fails for certain (a reader like
    # `head` that leaves after one line may or may not beat a write that fits in the pipe's buffer).
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "titan_k3.train", "--help"], cwd=ROOT, stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_under_torchrun_rank_zero_alone_prints_the_help():
    """`torchrun --nproc_per_node N -m titan_k3.train --help` printed the help N times."""
    for rank, printed in (("1", False), ("0", True)):
        proc = subprocess.run([sys.executable, "-m", "titan_k3.train", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "RANK": rank, "WORLD_SIZE": "2"})
        assert proc.returncode == 0 and proc.stderr == ""
        assert proc.stdout.startswith("usage: python -m titan_k3.train") is printed
