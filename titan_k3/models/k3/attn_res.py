"""Block Attention Residuals (docs/k3.md §2.4).

The residual stream is a list of block sums: block 0 is the embedding and a
new block opens every `block_size` layers. Each sublayer (and the final norm)
reads a softmax-weighted mix of the completed blocks and the current partial
sum; the score of source n is <RMSNorm(v_n), q> with a learned pseudo-query q
[D] per sublayer, initialised to zero so the first mix is a plain average.
Scores and the mix are computed in float32, by the implementation chosen in
`impl.py` (`kernels.attn_res`): the fused Triton op or the PyTorch reference.
With `kernels.attn_res_grad_in_place` each completed block has a gradient sink
(kernels/attn_res/sinks.py): the Triton mixes' backward sum its gradient in
place instead of autograd adding one tensor per mix that reads it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.attn_res.sinks import GradientSink, collect


class PseudoQueryMix(nn.Module):
    """Mix N sources [B, T, D] into one input with a learned pseudo-query [D].

    `mix(sources, query, eps) -> [B, T, D]` is the implementation
    (`kernels.attn_res.pseudo_query_mix` or its reference); given `sinks` (per source, a GradientSink or None),
    it is called with them (only the Triton mix takes them: `impl.Impl.attn_res_sinks`).
    """

    def __init__(self, dim: int, mix: Callable, eps: float = 1e-5):
        super().__init__()
        self.mix = mix
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)

    def forward(self, sources: list[torch.Tensor], sinks: list[GradientSink] | None = None) -> torch.Tensor:
        """sinks: the completed blocks' sinks, in order (ResidualBlocks.sinks); sources past them have none."""
        if len(sources) == 1:
            return sources[0]
        if sinks:
            return self.mix(sources, self.query, self.eps, sinks=sinks + [None] * (len(sources) - len(sinks)))
        return self.mix_several(sources)

    # NOTE: the unit `torch.compile` sees (parallelize.apply_compile). A lone source is returned before it:
    # a compiled frame that traces no op is skipped by dynamo, and the skip sticks to the code object, so
    # every later mix of every layer would run eager (the first mix of a model has one source).
    def mix_several(self, sources: list[torch.Tensor]) -> torch.Tensor:
        return self.mix(sources, self.query, self.eps)


class ResidualBlocks:
    """The block-sum residual stream of one forward pass: the completed blocks, and the open block's sum so far
    (`partial`, which each layer replaces with its own sum: `K3Block.forward`).

    grad_sinks: each completed block enters the stream through a GradientSink (`sinks`, one per completed
    block), which the mixes that read it sum its gradient into (kernels/attn_res/sinks.py).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, grad_sinks: bool = False):
        self.block_size = block_size
        self.grad_sinks = grad_sinks and torch.is_grad_enabled()
        self.completed: list[torch.Tensor] = []
        self.sinks: list[GradientSink] | None = [] if self.grad_sinks else None
        self.partial: torch.Tensor | None = None
        self._complete(embedding)

    def sources(self) -> list[torch.Tensor]:
        return self.completed + ([self.partial] if self.partial is not None else [])

    def end_layer(self, layer: int) -> None:
        """Close the current block after every `block_size` layers."""
        if (layer + 1) % self.block_size == 0 and self.partial is not None:
            self._complete(self.partial)
            self.partial = None

    def _complete(self, block: torch.Tensor) -> None:
        if self.sinks is not None:
            self.sinks.append(GradientSink())
            block = collect(block, self.sinks[-1])
        self.completed.append(block)
