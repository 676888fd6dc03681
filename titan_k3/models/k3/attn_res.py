"""Block Attention Residuals (K3_SPEC §1.4).

The residual stream is a list of block sums: block 0 is the embedding and a
new block opens every `block_size` layers. Each sublayer (and the final norm)
reads a softmax-weighted mix of the completed blocks and the current partial
sum; the score of source n is <RMSNorm(v_n), q> with a learned pseudo-query q
[D] per sublayer, initialised to zero so the first mix is a plain average.
Scores and the mix are computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_k3.models.k3.layers import upcast


class PseudoQueryMix(nn.Module):
    """Mix N sources [B, T, D] into one input with a learned pseudo-query [D]."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0]
        v_NBTD = upcast(torch.stack(sources))
        keys = F.rms_norm(v_NBTD, (v_NBTD.shape[-1],), None, self.eps)
        weights_NBT = torch.softmax(keys @ upcast(self.query), dim=0)
        return (weights_NBT.unsqueeze(-1) * v_NBTD).sum(dim=0).to(sources[0].dtype)


class ResidualBlocks:
    """The block-sum residual stream of one forward pass."""

    def __init__(self, embedding: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.completed: list[torch.Tensor] = [embedding]
        self.partial: torch.Tensor | None = None

    def sources(self) -> list[torch.Tensor]:
        return self.completed + ([self.partial] if self.partial is not None else [])

    def add(self, out: torch.Tensor) -> None:
        self.partial = out if self.partial is None else self.partial + out

    def end_layer(self, layer: int) -> None:
        """Close the current block after every `block_size` layers."""
        if (layer + 1) % self.block_size == 0 and self.partial is not None:
            self.completed.append(self.partial)
            self.partial = None
