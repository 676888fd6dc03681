"""SIGTERM to one rank of the real CLI under torchrun (2 CPU ranks, gloo): every rank stops after the same
update with one checkpoint, each exits 0, and `[stopped]` is printed once (rank 0), not once per rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
]

ROOT = Path(__file__).resolve().parents[2]


def _worker_of_rank(torchrun_pid: int, rank: int) -> int | None:
    """The pid of the titan_k3.train worker with RANK=rank below torchrun_pid (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    frontier, found = [torchrun_pid], []
    while frontier:
        parent = frontier.pop()
        children = [c for c, p in parents.items() if p == parent]
        found += children
        frontier += children
    for pid in found:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"titan_k3.train" in cmdline:
            return pid
    return None


def test_sigterm_to_one_rank_stops_all_with_one_save_and_one_message(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
           "--monitor-interval", "0.2", "-m", "titan_k3.train", "--model.flavor", "debug",
           "--training.seq_len", "32", "--training.steps", "100000",
           "--training.local_batch_size", "1", "--training.device", "cpu", "--kernels.kda", "torch",
           "--kernels.experts", "torch", "--kernels.loss", "torch", "--kernels.attn_res", "torch",
           "--kernels.attention", "math", "--metrics.log_freq", "1", "--checkpoint.enable", "true",
           "--checkpoint.interval", "1000000", "--job.dump_folder", str(tmp_path), "--job.name", "stop"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 600
        while not any("step      1 |" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.1)
        rank1 = _worker_of_rank(proc.pid, 1)
        assert rank1 is not None
        os.kill(rank1, signal.SIGTERM)
        assert proc.wait(600) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:  # a failed test leaves no training behind: torchrun takes its workers down
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    reader.join(60)
    stopped = [line for line in lines if "[stopped]" in line]
    assert len(stopped) == 1 and "SIGTERM received: stopping after update" in stopped[0], "".join(lines[-30:])
    saved = (tmp_path / "stop/checkpoints/latest").read_text().strip()
    assert saved == f"step-{stopped[0].split('stopping after update ')[1].split()[0]}"
    assert sum("mesh: world 2" in line for line in lines) == 1
    # Signalled workers, not torchrun: torchrun ends 0 without its SignalException traceback (docs/distributed.md).
    assert not any("Traceback" in line for line in lines), "".join(lines[-30:])
