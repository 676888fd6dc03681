"""The cluster a plan is made for, and the measured constants the planner calibrates against.

Defaults describe H200 SXM nodes: 8 GPUs each, ~139 GiB of memory that torch sees per GPU, NVLink at
450 GB/s per GPU and direction, InfiniBand at 8 x 400 Gb/s per node (one NIC per GPU: 50 GB/s per GPU and
direction). Bandwidths are in gigabytes per second per GPU and direction.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Cluster:
    gpus_per_node: int = 8
    """GPUs in one node (one NVLink domain)."""
    nodes: int = 1
    """Nodes available; the planner searches world sizes up to gpus_per_node x nodes."""
    gpu_memory_gib: float = 139.0
    """Memory per GPU as torch reports it (an H200's 141 GB of HBM3e read as ~139 GiB)."""
    reserve_gib: float = 6.0
    """Kept free per GPU for the CUDA context, NCCL's buffers, the caching allocator's fragmentation."""
    intra_node_gbps: float = 450.0
    """NVLink bandwidth per GPU and direction, GB/s."""
    inter_node_gbps: float = 50.0
    """Network bandwidth per GPU and direction, GB/s (8 x 400 Gb/s InfiniBand per 8-GPU node)."""
    matmul_tflops: float = 790.0
    """bf16 matmul rate measured on one H200, TFLOP/s."""
    hbm_tbps: float = 4.2
    """Memory bandwidth measured on one H200, TB/s."""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def budget_gib(self) -> float:
        return self.gpu_memory_gib - self.reserve_gib

    def replace(self, **kw) -> "Cluster":
        return dataclasses.replace(self, **kw)


CLUSTER_KEYS = {f.name: f.type for f in dataclasses.fields(Cluster)}


def cluster_from_overrides(pairs: list[tuple[str, str]]) -> Cluster:
    """('cluster.nodes', '4'), ... -> Cluster; a bad key or value is a one-line ValueError."""
    values: dict[str, float | int] = {}
    for key, raw in pairs:
        name = key.split(".", 1)[1]
        if name not in CLUSTER_KEYS:
            raise ValueError(f"unknown cluster key '{key}': expected one of "
                             + ", ".join(f"cluster.{k}" for k in CLUSTER_KEYS))
        kind = int if CLUSTER_KEYS[name] in ("int", int) else float
        try:
            value = kind(raw)
        except ValueError:
            raise ValueError(f"cluster key '{key}' = {raw!r}: expected {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(value):
            raise ValueError(f"cluster key '{key}' = {raw!r}: expected a finite number")
        if name == "reserve_gib" and value < 0:
            raise ValueError(f"cluster key '{key}' = {raw!r}: must be >= 0")
        if name != "reserve_gib" and value <= 0:
            raise ValueError(f"cluster key '{key}' = {raw!r}: must be > 0")
        values[name] = value
    cluster = Cluster(**values)
    if cluster.reserve_gib >= cluster.gpu_memory_gib:
        raise ValueError(f"cluster key 'cluster.reserve_gib' = {cluster.reserve_gib}: must be below "
                         f"cluster.gpu_memory_gib = {cluster.gpu_memory_gib}")
    return cluster
