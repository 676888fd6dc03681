"""Expert-load statistics for one MoE layer (docs/k3.md §5) and the expert-collapse alarm.

Legend: E routed experts.
"""

from __future__ import annotations

import math

import torch

DEAD_SHARE = 0.1
"""An expert is dead when its load is under this fraction of the uniform share 1/E."""


def expert_load_stats(counts_E: torch.Tensor, qb_bias_E: torch.Tensor) -> dict[str, float | list[float]]:
    """counts [E] selections since the last report, bias [E] -> metrics.

    load: the E load fractions; dead_fraction: experts under 10% of the
    uniform share; maxvio: max/mean - 1; load_cv: std/mean; entropy: load
    entropy / log E (1 = uniform); qb_range: max(b) - min(b).
    """
    counts = counts_E.detach().double().cpu()
    total = counts.sum().item()
    E = counts.numel()
    qb_range = float(qb_bias_E.max() - qb_bias_E.min())
    if total == 0:
        return {"dead_fraction": 0.0, "maxvio": 0.0, "load_cv": 0.0, "entropy": 1.0, "qb_range": qb_range,
                "load": [0.0] * E}
    frac = counts / total
    mean = total / E
    nz = frac[frac > 0]
    return {
        "dead_fraction": float((frac < DEAD_SHARE / E).double().mean()),
        "maxvio": float(counts.max() / mean - 1),
        "load_cv": float(counts.std(unbiased=False) / mean),
        "entropy": float(-(nz * nz.log()).sum() / math.log(E)) if E > 1 else 1.0,
        "qb_range": qb_range,
        "load": [float(x) for x in frac],
    }


class CollapseAlarm:
    """Fires once per episode when a layer's dead fraction stays above `threshold` for `patience` reports.

    The streak resets when the fraction drops back to or below the threshold,
    which re-arms the alarm for that layer.
    """

    def __init__(self, threshold: float, patience: int):
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold={threshold}: must be in (0, 1]")
        if patience < 1:
            raise ValueError(f"patience={patience}: must be >= 1")
        self.threshold, self.patience = threshold, patience
        self.streak: dict[int, int] = {}

    def update(self, layer: int, dead_fraction: float) -> bool:
        """Record one report; True exactly when this report completes a streak of `patience`."""
        if dead_fraction > self.threshold:
            self.streak[layer] = self.streak.get(layer, 0) + 1
        else:
            self.streak[layer] = 0
        return self.streak[layer] == self.patience
