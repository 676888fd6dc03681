"""The routed experts' weights in the compute dtype, kept beside their float32 masters (kernels.expert_weight_shadows).

Without shadows each forward casts every expert weight (read 4 bytes, write 2 per parameter: for k3-mini 33 passes
of 24.5M parameters per update) and keeps the casts for the backward. With them the experts read buffers that hold
those casts already (`LatentMoE.w1_shadow`, ...), and Per-Head Muon's update pass writes each weight's new cast in
the launch that writes the weight (`kernels.muon.decay_add_multi_(shadows=...)`): 2 bytes more per parameter there.

A shadow is correct only while it is its master's cast. Three things keep that true, and one says so if not:
- Muon's update pass writes both in one kernel, from the stored float32 value (a skipped update writes neither).
- Every other write of a master goes through a torch op (initialisation, a checkpoint load, fault injection, a
  test's in-place edit), and every torch op that writes a tensor moves its version counter; `refresh_stale`, which
  the trainer calls before each update and each evaluation (the model's step hooks, bundle.py), casts again each
  master whose counter moved since its shadow was written. (Muon's Triton pass moves no counter, and writes the
  shadow itself.)
- A master the optimizer does not own is refused when Muon is given the shadows; so is a sharded one (FSDP2 and
  expert parallelism gather the experts in bf16 already: nothing to cast), which a run of several processes never
  builds (trainer_setup.resolve_kernels takes the cast pass there, a reported fallback).
- `LatentMoE.shadow_mismatches` compares every shadow with its master's cast, bit for bit; the invariant checks
  run it (weights.expert_shadows).
"""

from __future__ import annotations

import torch
from torch import nn

from titan_k3.models.k3.moe import SHADOWED, LatentMoE

KEY = "kernels.expert_weight_shadows"


class ExpertShadows:
    """Every shadowed LatentMoE of a model: which shadow belongs to which master, and the masters' versions when
    their shadows were last written."""

    def __init__(self, model: nn.Module):
        self.pairs: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        for prefix, module in model.named_modules():
            if isinstance(module, LatentMoE) and module.shadowed:
                for name in SHADOWED:
                    master, shadow = getattr(module, name), getattr(module, f"{name}_shadow")
                    self.pairs.append((f"{prefix}.{name}" if prefix else name, master, shadow))
        self._versions: list[int | None] = [None] * len(self.pairs)  # None: never written

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def check_owned(self, optimizer: torch.optim.Optimizer | None) -> None:
        """ValueError naming the first master that `optimizer` (Per-Head Muon) does not update in place, unsharded:
        its shadow would go stale at the first update."""
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else set()
        for name, master, _ in self.pairs:
            if hasattr(master, "device_mesh"):
                raise ValueError(f"config key '{KEY}' = true: {name} is sharded (FSDP2 or expert parallelism), whose "
                                 "all-gather casts the experts already; turn the key off for this mesh")
            if id(master) not in owned:
                raise ValueError(f"config key '{KEY}' = true: {name} is not updated by Per-Head Muon, which writes the "
                                 "shadows; turn the key off or give the experts to Muon")

    def by_master(self) -> dict[torch.Tensor, torch.Tensor]:
        """master -> shadow, for the optimizer's update pass."""
        return {master: shadow for _, master, shadow in self.pairs}

    @torch.no_grad()
    def refresh_stale(self) -> int:
        """Cast again each master written since its shadow was (its version counter moved); how many were."""
        stale = [i for i, (_, master, _) in enumerate(self.pairs) if master._version != self._versions[i]]
        if stale:
            torch._foreach_copy_([self.pairs[i][2] for i in stale], [self.pairs[i][1] for i in stale])
            for i in stale:
                self._versions[i] = self.pairs[i][1]._version
        return len(stale)
