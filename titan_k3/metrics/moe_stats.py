"""Expert-load statistics for one MoE layer (K3_SPEC §3): the expert-collapse signals."""

from __future__ import annotations

import math

import torch

DEAD_SHARE = 0.1


def expert_load_stats(counts_E: torch.Tensor, qb_bias_E: torch.Tensor) -> dict[str, float]:
    """counts [E] selections since the last report, bias [E] -> scalar metrics.

    dead_fraction: experts under 10% of the uniform share; maxvio: max/mean - 1;
    load_cv: std/mean; entropy: load entropy / log E (1 = uniform); qb_range:
    max(b) - min(b).
    """
    counts = counts_E.double()
    total = counts.sum().item()
    E = counts.numel()
    if total == 0:
        return {"dead_fraction": 0.0, "maxvio": 0.0, "load_cv": 0.0, "entropy": 1.0,
                "qb_range": float(qb_bias_E.max() - qb_bias_E.min())}
    frac = counts / total
    mean = total / E
    nz = frac[frac > 0]
    return {
        "dead_fraction": float((frac < DEAD_SHARE / E).double().mean()),
        "maxvio": float(counts.max() / mean - 1),
        "load_cv": float(counts.std(unbiased=False) / mean),
        "entropy": float(-(nz * nz.log()).sum() / math.log(E)),
        "qb_range": float(qb_bias_E.max() - qb_bias_E.min()),
    }
