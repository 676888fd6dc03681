"""Gradient sinks and handoffs: a residual source's gradient summed inside the mixes' backward kernels.

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

The open block's partial sum p has two readers: the next mix (p is its last
source) and the residual add p + sublayer output. `add_handing_off(p, term,
handoff)` is that add with a handoff: its backward, which autograd runs before
the mix's (the mix feeds the term), gives p no gradient and leaves its incoming
gradient in `handoff.grad`; the mix's backward kernel adds it to its own share
for p as it writes that (kernels.attn_res.mix, ADD), so p's gradient comes out
of one kernel instead of a kernel and an add. The handed-off tensor is only
read: autograd also passes it on to the term.

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


class GradientHandoff:
    """The gradient a residual add sends to its first input, left for the mix that reads that input as its last
    source (`add_handing_off`); `taken` once that mix's backward has read it."""

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.taken = False

    def take(self) -> torch.Tensor | None:
        self.taken = True
        grad, self.grad = self.grad, None
        return grad


class _AddHandingOff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, p: torch.Tensor, term: torch.Tensor, handoff: GradientHandoff) -> torch.Tensor:
        ctx.handoff = handoff
        ctx.set_materialize_grads(False)
        return p + term

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if ctx.handoff.taken:
            # NOTE: cannot happen while the mix feeds `term`; if it did, p would silently lose this gradient.
            raise RuntimeError("add_handing_off: the mix that reads p ran its backward before this add's; "
                               "p's gradient from the add would be lost")
        ctx.handoff.grad = grad
        return None, grad, None


def add_handing_off(p: torch.Tensor, term: torch.Tensor, handoff: GradientHandoff) -> torch.Tensor:
    """p + term, whose gradient for p goes to `handoff` for the mix that reads p (its last source) to add."""
    return _AddHandingOff.apply(p, term, handoff)
