"""Block Attention Residuals (docs/k3.md §2.4).

The residual stream is a list of block sums: block 0 is the embedding and a
new block opens every `block_size` layers. Each sublayer (and the final norm)
reads a softmax-weighted mix of the completed blocks and the current partial
sum; the score of source n is <RMSNorm(v_n), q> with a learned pseudo-query q
[D] per sublayer, initialised to zero so the first mix is a plain average.
Scores and the mix are computed in float32, by the implementation chosen in
`impl.py` (`kernels.attn_res`): the fused Triton op or the PyTorch reference.
With `kernels.attn_res_norm_in_mix` each mix also applies the RMSNorm of what it
feeds (handed to `PseudoQueryMix.forward` as `norm`), in the same kernels.
With `kernels.attn_res_grad_in_place` the stream's gradients are summed inside
the Triton mixes' backward kernels instead of by autograd's adds
(kernels/attn_res/sinks.py): each completed block has a gradient sink, and each
residual add hands its gradient for the partial sum to the mix that reads it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels.attn_res.sinks import GradientHandoff, GradientSink, add_handing_off, collect


class PseudoQueryMix(nn.Module):
    """Mix N sources [B, T, D] into one input with a learned pseudo-query [D].

    `mix(sources, query, eps) -> [B, T, D]` is the implementation
    (`kernels.attn_res.pseudo_query_mix` or its reference); given `sinks` (per source, a GradientSink or None)
    and a `handoff` for the last source, it is called with them (only the Triton mix takes them:
    `impl.Impl.attn_res_sinks`); given a `norm` (an RMSNorm module the mix does not own), with its weight and eps
    as `norm_weight`, `norm_eps`.
    """

    def __init__(self, dim: int, mix: Callable, eps: float = 1e-5):
        super().__init__()
        self.mix = mix
        self.eps = eps
        self.query = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.query)

    def forward(self, sources: list[torch.Tensor], sinks: list[GradientSink] | None = None,
                handoff: GradientHandoff | None = None, norm: nn.Module | None = None) -> torch.Tensor:
        """sinks: the completed blocks' sinks, in order (ResidualBlocks.sinks); sources past them have none.
        handoff: where the residual add that also reads the last source leaves its gradient (`residual_layer`).
        norm: None, or the RMSNorm (`.weight`, `.eps`) whose output is returned instead of the mix's."""
        if len(sources) == 1 and norm is None:
            return sources[0]
        if sinks or handoff is not None:
            sinks = (sinks or []) + [None] * (len(sources) - len(sinks or []))
            return self.mix(sources, self.query, self.eps, sinks=sinks, handoff=handoff, **_norm_args(norm))
        return self.mix_several(sources, norm)

    # NOTE: the unit `torch.compile` sees (parallelize.apply_compile). A lone source without a norm is returned
    # before it: a compiled frame that traces no op is skipped by dynamo, and the skip sticks to the code object, so
    # every later mix of every layer would run eager (the first mix of a model has one source). With a norm, a lone
    # source goes through the mix too: the Triton mix's kernels normalise it in one pass each way (an eager RMSNorm
    # of a bf16 [B, T, D] outside the compiled sublayers is five).
    def mix_several(self, sources: list[torch.Tensor], norm: nn.Module | None = None) -> torch.Tensor:
        return self.mix(sources, self.query, self.eps, **_norm_args(norm))


def _norm_args(norm: nn.Module | None) -> dict:
    return {} if norm is None else dict(norm_weight=norm.weight, norm_eps=norm.eps)


def residual_layer(
    sources: list[torch.Tensor], partial: torch.Tensor | None, sinks: list[GradientSink] | None,
    attn_mix: PseudoQueryMix, attn: Callable, ffn_mix: PseudoQueryMix, ffn: Callable,
    attn_norm: nn.Module | None = None, ffn_norm: nn.Module | None = None,
) -> torch.Tensor:
    """One layer of the stream: partial + a + f with a = attn(attn_mix(sources, partial)) and f = ffn(ffn_mix(sources,
    partial + a)); sources: the completed blocks; partial: the open block's sum (None: it opens here); sinks: the
    completed blocks' gradient sinks (ResidualBlocks.sinks) or None. attn_norm, ffn_norm: given, the mixes apply
    them (kernels.attn_res_norm_in_mix), so attn and ffn take normalised inputs.

    NOTE: the sum after the attention sublayer is the FFN mix's source and the next partial sum's first term both:
    one add, so one node whose two gradients are summed once (computing it twice cost an add in the forward and two
    gradient adds in the backward per layer, ~25 us each at k3-mini's B8 T4096). Autograd sums them; with sinks,
    each add hands its gradient for the partial sum to the mix that read it, whose backward kernel adds it.
    """
    handoff = GradientHandoff() if sinks is not None and partial is not None else None
    a = attn(attn_mix(sources + ([partial] if partial is not None else []), sinks, handoff, attn_norm))
    partial = _residual_add(partial, a, handoff)
    handoff = GradientHandoff() if sinks is not None else None
    return _residual_add(partial, ffn(ffn_mix(sources + [partial], sinks, handoff, ffn_norm)), handoff)


def _residual_add(p: torch.Tensor | None, term: torch.Tensor, handoff: GradientHandoff | None) -> torch.Tensor:
    """p + term (term alone when the block opens here, p None); with a handoff, p's gradient from this add goes to
    the mix that read p, which adds it in its backward kernel."""
    if p is None:
        return term
    return p + term if handoff is None else add_handing_off(p, term, handoff)


class ResidualBlocks:
    """The block-sum residual stream of one forward pass: the completed blocks, and the open block's sum so far
    (`partial`, which each layer replaces with its own sum: `K3Block.forward`).

    grad_sinks: each completed block enters the stream through a GradientSink (`sinks`, one per completed
    block), which the mixes that read it sum its gradient into (kernels/attn_res/sinks.py).
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, grad_sinks: bool = False):
        self.block_size = block_size
        self.completed: list[torch.Tensor] = []
        # NOTE: none without autograd (evaluation): there is no backward to sum in.
        self.sinks: list[GradientSink] | None = [] if grad_sinks and torch.is_grad_enabled() else None
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
