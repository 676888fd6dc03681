"""What the trainer needs around parallelize: process group + mesh, sharded init, grad clipping, compile report.

Under torchrun (WORLD_SIZE in the environment, even 1) the run is
distributed: the process group is NCCL on CUDA and gloo on CPU, the model is
FSDP2-sharded. Without torchrun it is a plain single process (no mesh).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from itertools import chain
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from titan_k3.parallel.dims import ParallelDims


@dataclass
class Distributed:
    dims: ParallelDims
    mesh: object | None
    """The world DeviceMesh (None for a plain single process)."""
    dp_rank: int
    dp_world: int
    dp_group: dist.ProcessGroup | None
    """All data-parallel ranks: loss / token counts, QB histograms, QK-Clip maxima."""


def _attempt_store(world: int) -> dict:
    """A store private to this torchrun attempt.

    NOTE: torchrun keeps one TCPStore on MASTER_PORT across restarts, so a
    restarted group would read the dead attempt's keys (gloo: connection
    refused; NCCL: a stale unique id). Prefixing by the restart count keeps
    each attempt's rendezvous apart. Outside torchrun the default env:// init is used.
    """
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=5))
    prefixed = dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    return {"store": prefixed, "rank": int(os.environ["RANK"]), "world_size": world}


def setup_distributed(parallelism_cfg, device: torch.device, n_experts: int) -> Distributed:
    """Init the process group and the mesh under torchrun with 2+ processes; a plain single process otherwise."""
    if "WORLD_SIZE" not in os.environ:
        return Distributed(ParallelDims.from_config(parallelism_cfg, 1, n_experts), None, 0, 1, None)
    world = int(os.environ["WORLD_SIZE"])
    dims = ParallelDims.from_config(parallelism_cfg, world, n_experts)  # refuse before any collective
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world == 1:
        # NOTE: one rank has nothing to shard or reduce. FSDP over a mesh of one only adds parameter and
        # gradient copies, hooks, and graph breaks where a router's own FSDP group sits inside a compiled
        # sublayer; torchrun with one process therefore trains exactly as a plain process does.
        return Distributed(dims, None, 0, 1, None)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None,
                                **_attempt_store(world))
    mesh = dims.build_mesh(device.type)
    dp = dims.dp_mesh(mesh)
    return Distributed(dims, mesh, dp.get_local_rank(), dp.size(), dp.get_group())


@torch.no_grad()
def init_weights(model: nn.Module, build: Callable[[], nn.Module], seed: int, device: torch.device) -> None:
    """Initialise `model` exactly as a single process would, sharded or not.

    A sharded model is filled from a full twin initialised with the same seed
    on this device (DTensor random init on CPU is not the single-process
    stream), each rank keeping its own shard.
    NOTE: the twin costs one full copy of the model on each device for the
    duration of init; fine up to k3-mini, not for the full k3 card.
    """
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        model.init_weights(seed=seed)
        return
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        twin = build()
    twin.to_empty(device=device)
    twin.init_weights(seed=seed)
    source = dict(chain(twin.named_parameters(), twin.named_buffers()))
    for name, target in chain(model.named_parameters(), model.named_buffers()):
        full = source[name].to(target.dtype)
        if isinstance(target, DTensor):
            shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
        else:
            target.copy_(full)


def comm_device(group) -> torch.device:
    """Where a collective on `group` takes its tensors: the current CUDA device for NCCL, else the host.

    NOTE: an NCCL group refuses host tensors ("No backend type associated with
    device type cpu"), and gloo refuses CUDA ones; small bookkeeping tensors
    travel to the group's device and back.
    """
    if group is not None and "nccl" in str(dist.get_backend(group)) and "gloo" not in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_small(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce of a small tensor on any device over any group; the result is on x's device (x untouched)."""
    if group is None:
        return x.clone()
    y = x.to(comm_device(group), copy=True)
    dist.all_reduce(y, op=op, group=group)
    return y.to(x.device)


def all_gather_small(x: torch.Tensor, group) -> torch.Tensor:
    """[W, *x.shape] on x's device: every rank's x (same shape on every rank), over any group."""
    y = x.to(comm_device(group)).contiguous()
    out = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, y, group=group)
    return torch.stack(out).to(x.device)


@torch.no_grad()
def sum_replicated_grads(model: nn.Module, group) -> None:
    """Sum over the data-parallel ranks the gradients of parameters FSDP leaves whole (plain tensors among DTensors).

    One all-reduce for all of them (the routers: a few hundred KB). Like FSDP's
    own reduction it sums, never averages: the loss is already divided by the
    global token count. No-op for a plain single process.
    """
    if group is None:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None and not isinstance(p, DTensor)]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads]).to(comm_device(group))
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.to(grads[0].device).split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


@torch.no_grad()
def grad_norm_and_clip_coef(params: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(global gradient norm, clip coefficient min(1, max_norm / (norm + 1e-6))), float32 scalars on the device.

    Each sharded gradient's local sum of squares is summed over the mesh dims
    that shard it (not those that replicate it), grouped so that there is one
    all-reduce per (mesh, dims) pair; plain tensors take the same path. The
    gradients are not touched: a trainer can hand the coefficient to the
    optimizers (`Optimizers.step(grad_scale=...)`) instead of a pass over them.
    """
    groups: dict = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not isinstance(pl, Replicate))
            key, local, mesh = (id(g.device_mesh), dims), g.to_local(), g.device_mesh
        else:
            key, local, mesh, dims = ("plain", ()), g, None, ()
        groups.setdefault(key, (mesh, dims, []))[2].append(local)
    total = None
    for mesh, dims, locals_ in groups.values():
        square = _sum_of_squares(locals_)
        for i in dims:
            dist.all_reduce(square, group=mesh.get_group(i))
        total = square if total is None else total + square
    norm = total.sqrt()
    return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 sum of squares of every element, as one scalar on the tensors' device.

    NOTE: on CUDA one foreach norm kernel replaces four launches per tensor
    (a k3-mini step was bound by launches); torch's foreach norm on CPU was
    measured 1e-4 relative off the float64 norm, so CPU keeps the exact sum.
    """
    if tensors[0].is_cuda:
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).pow(2).sum()
    return sum(t.float().pow(2).sum() for t in tensors)


class CompileWatch:
    """Reports graph breaks and recompiles of the compiled blocks through the event log when they change."""

    def __init__(self, events):
        self.events = events
        self.last: tuple[int, int, int] = (0, 0, 0)

    def check(self, step: int) -> None:
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        # NOTE: dynamo counts compiled frames, not recompiles; a frame compiled
        # again (a recompile, or the code after a graph break) adds one.
        frames = counters["frames"]["ok"]
        now = (breaks, graphs, frames)
        if now == self.last:
            return
        self.last = now
        reasons = [f"{n}x {reason}" for reason, n in counters["graph_break"].most_common(5)]
        self.events.emit(
            "compile", f"torch.compile: {graphs} graphs, {breaks} graph breaks, {frames} frames compiled"
            + (f"; breaks: {'; '.join(reasons)}" if reasons else ""), step=step,
            graphs=graphs, graph_breaks=breaks, frames_compiled=frames, break_reasons=reasons,
        )
