"""Gradient norms per parameter group, with DTensor (FSDP2 / EP) gradients reduced over their shards.

Groups: embedding (token embedding), head (output projection), router (MoE
routers), experts (everything else inside a LatentMoE: routed experts, shared
expert, latent down/up projections and norm), attention (KDA and MLA), other
(dense FFNs, norms, residual mixes).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

GROUPS = ("embedding", "attention", "experts", "router", "head", "other")


def param_group(name: str) -> str:
    """The group of a parameter name of K3Model (prefixes added by wrappers are ignored)."""
    name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
    if name.startswith("tok_embeddings.") or ".tok_embeddings." in name:
        return "embedding"
    if name.startswith("output.") or ".output." in name:
        return "head"
    if ".router." in name:
        return "router"
    if ".ffn." in name and _is_moe_param(name):
        return "experts"
    if ".attn." in name:
        return "attention"
    return "other"


def _is_moe_param(name: str) -> bool:
    tail = name.split(".ffn.", 1)[1]
    # NOTE: routed experts are bare 3-D parameters ("ffn.w1"); a dense FFN's are Linears ("ffn.w1.weight").
    return tail in ("w1", "w3", "w2") or tail.split(".", 1)[0] in ("w_down", "w_up", "latent_norm", "shared")


def _local_and_reduce_groups(grad: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """(local tensor, process groups over which its squares must be summed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        return grad, ()
    if not isinstance(grad, DTensor):
        return grad, ()
    mesh = grad.device_mesh
    # NOTE: only Shard dims split the vector; Replicate dims hold copies that must not be summed twice.
    groups = tuple(mesh.get_group(d) for d, p in enumerate(grad.placements) if p.is_shard())
    return grad.to_local(), groups


@torch.no_grad()
def grad_norms_by_group(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, float]:
    """{group: L2 norm of its gradients, "global": the norm over all} for parameters with a gradient.

    Collective when gradients are DTensors: every rank of their meshes must call it.
    Groups without gradients report 0.
    """
    by_reduction: dict[tuple, torch.Tensor] = {}
    for name, p in named_params:
        if p.grad is None:
            continue
        local, groups = _local_and_reduce_groups(p.grad)
        key = tuple(id(g) for g in groups)
        if key not in by_reduction:
            by_reduction[key] = (groups, torch.zeros(len(GROUPS), dtype=torch.float64, device=local.device))
        # NOTE: float64 accumulation: a float32 norm of a large CPU tensor can be off by 1e-4 relative.
        sq = torch.linalg.vector_norm(local, dtype=torch.float64) ** 2 if local.numel() else local.new_zeros((), dtype=torch.float64)
        by_reduction[key][1][GROUPS.index(param_group(name))] += sq
    total = torch.zeros(len(GROUPS), dtype=torch.float64)
    for groups, sq_G in by_reduction.values():
        for g in groups:
            dist.all_reduce(sq_G, group=g)
        total += sq_G.cpu()
    norms = total.sqrt()
    out = {group: float(norms[i]) for i, group in enumerate(GROUPS)}
    out["global"] = float(total.sum().sqrt())
    return out
