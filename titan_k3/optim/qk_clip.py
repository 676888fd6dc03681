"""QK-Clip for MLA layers (Kimi K2; docs/k3.md §6.3), applied after each optimizer step.

Row layout of the two MLA up-projections (per head h, heads stacked on dim 0):
  W_qb  [H * (nope + rope), q_lora]:  head h rows = [nope query rows | rope query rows]
  W_kvb [H * (nope + v), kv_lora]:    head h rows = [nope key rows   | value rows]
A logit of head h is q_nope . k_nope + q_rope . kr, where the shared key part
kr (from W_kva) is common to all heads and is never scaled. Scaling the nope
query and key rows by sqrt(gamma) and the rope query rows by gamma shrinks
every logit of that head by exactly gamma; values are untouched.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate


def qk_clip_(
    w_qb: torch.Tensor,
    w_kvb: torch.Tensor,
    max_logit_H: torch.Tensor,
    *,
    n_heads: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    tau: float = 100.0,
) -> torch.Tensor:
    """Scale the heads whose largest logit exceeded `tau`, in place; return gamma [H] (1 = not clipped).

    max_logit_H [H]: per head, the largest pre-softmax logit of the step,
    already max-reduced over microbatches and ranks; it must be finite (a
    step with a non-finite loss is skipped before clipping). gamma = tau / S_max
    where S_max > tau. Works on plain tensors and on DTensors of any placement
    (see `_scale_rows_`).
    """
    if n_heads < 1 or nope_dim < 1 or rope_dim < 0 or v_dim < 1:
        raise ValueError(
            f"qk_clip_: n_heads={n_heads}, nope_dim={nope_dim}, rope_dim={rope_dim}, v_dim={v_dim}; "
            "need n_heads, nope_dim, v_dim >= 1 and rope_dim >= 0"
        )
    if not tau > 0:
        raise ValueError(f"qk_clip_: tau={tau!r}; must be > 0")
    if w_qb.ndim != 2 or w_qb.shape[0] != n_heads * (nope_dim + rope_dim):
        raise ValueError(
            f"qk_clip_: w_qb has shape {tuple(w_qb.shape)}; expected [n_heads * (nope_dim + rope_dim)"
            f" = {n_heads * (nope_dim + rope_dim)}, q_lora]"
        )
    if w_kvb.ndim != 2 or w_kvb.shape[0] != n_heads * (nope_dim + v_dim):
        raise ValueError(
            f"qk_clip_: w_kvb has shape {tuple(w_kvb.shape)}; expected [n_heads * (nope_dim + v_dim)"
            f" = {n_heads * (nope_dim + v_dim)}, kv_lora]"
        )
    if tuple(max_logit_H.shape) != (n_heads,):
        raise ValueError(f"qk_clip_: max_logit_H has shape {tuple(max_logit_H.shape)}; expected ({n_heads},)")

    with torch.no_grad():
        s = max_logit_H.detach()
        if isinstance(s, DTensor):
            s = s.full_tensor()
        # NOTE: the H factors are formed in float64 so that sqrt(gamma)^2 == gamma
        # to the weights' precision; they are cast to the weights' dtype (at least float32) per row.
        s = s.double()
        gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
        root, one = gamma.sqrt()[:, None], torch.ones_like(gamma)[:, None]
        # Per-row scale vectors, built once for all heads: [H, rows per head] -> [rows].
        q_rows = torch.cat([root.expand(-1, nope_dim), gamma[:, None].expand(-1, rope_dim)], dim=1)
        kv_rows = torch.cat([root.expand(-1, nope_dim), one.expand(-1, v_dim)], dim=1)
        _scale_rows_(w_qb, q_rows.reshape(-1))
        _scale_rows_(w_kvb, kv_rows.reshape(-1))
    return gamma.to(torch.promote_types(max_logit_H.dtype, torch.float32))


def _scale_rows_(w: torch.Tensor, row_scale: torch.Tensor) -> None:
    """w[r, :] *= row_scale[r] in place (computed in at least float32, stored in w's dtype).

    For a DTensor `w` (e.g. FSDP2's Shard(0)), the full [rows] scale vector is
    wrapped as a replicated DTensor and redistributed to w's placements, which
    only slices locally: each rank then multiplies its own shard by the rows
    of the scale vector that it holds, with no communication. Only row
    sharding (Shard(0)) and replication are supported: a [rows, 1] vector
    cannot follow a column shard.
    """
    scale = row_scale.to(w.device, torch.promote_types(w.dtype, torch.float32))[:, None]
    if isinstance(w, DTensor):
        if not all(pl.is_replicate() or pl.is_shard(0) for pl in w.placements):
            raise ValueError(f"qk_clip_: weight placements {w.placements}; only Shard(0) and Replicate are supported")
        mesh = w.device_mesh
        scale = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim, run_check=False)
        scale = scale.redistribute(mesh, w.placements)
    w.mul_(scale)
