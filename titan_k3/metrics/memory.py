"""Memory: the accelerator's peak allocated / reserved bytes and the host's resident set size."""

from __future__ import annotations

import psutil
import torch

GIB = 2**30


def memory_stats(device: torch.device) -> dict[str, float]:
    """Bytes: peak_allocated and peak_reserved (CUDA only, since start), host_rss (now)."""
    out = {"host_rss": float(psutil.Process().memory_info().rss)}
    if device.type == "cuda":
        out["peak_allocated"] = float(torch.cuda.max_memory_allocated(device))
        out["peak_reserved"] = float(torch.cuda.max_memory_reserved(device))
    return out
