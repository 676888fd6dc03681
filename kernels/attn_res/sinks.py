"""Gradient sinks: one residual source's gradient summed in place by the mixes that read it.

Legend: N sources, R rows (tokens), D width.

A completed block of the residual stream is a source of every later mix. Left
to autograd, each mix's backward writes that block's share of the gradient to
a new [R, D] tensor and autograd adds the shares two at a time: per extra
reader, one more tensor written and an add that reads two and writes one.
With a sink, the block enters the mixes through `collect(x, sink)`, an
identity whose backward runs after every reader's (autograd runs a node once
all its outputs' consumers have run); each mix's backward kernel writes its
share into `sink.grad` (the first reader in backward order) or adds it there
(`kernels.attn_res.mix`, bit n of ACC), and gives autograd no gradient for
that source; `collect`'s backward then hands the sum on, with whatever other
readers sent through autograd added.

The sum is the same up to rounding: each share is added in float32 to the
running sum and rounded once, where autograd rounds the share and then the sum.
"""

from __future__ import annotations

import torch


class GradientSink:
    """Where the mixes' backward kernels sum one source's gradient ([R, D], the source's dtype); None until the
    first share, and again once `collect`'s backward has handed it on."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None


class _Collect(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sink: GradientSink) -> torch.Tensor:
        ctx.sink = sink
        ctx.set_materialize_grads(False)  # every reader a mix: no gradient arrives through autograd, and no zeros
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        summed, ctx.sink.grad = ctx.sink.grad, None
        if summed is None:
            return grad, None
        return (summed if grad is None else summed.add_(grad)), None


def collect(x: torch.Tensor, sink: GradientSink) -> torch.Tensor:
    """x as it is, with the gradient that mixes add into `sink` handed to x's own gradient in backward."""
    return _Collect.apply(x, sink)
