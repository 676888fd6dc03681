"""The public `pseudo_query_mix`: the Triton forward and backward as two custom ops joined by autograd.

Legend: N sources, R rows (tokens), D width.

Both halves are `torch.library` custom ops with fake kernels, so `torch.compile`
sees each as one opaque call (no graph break) and autograd saves only what the
backward reads: the sources, and float32 scores, rstd [N, R] and largest score [R].
"""

import torch

from kernels.attn_res.mix import MAX_SOURCES, mix_backward, mix_forward
from kernels.attn_res.reference import check_mix_inputs, check_norm_weight
from kernels.attn_res.sinks import GradientHandoff, GradientSink
from kernels.device import triton_runs_on

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("attn_res::mix_fwd", mutates_args=())
def _mix_fwd_op(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, norm_weight: torch.Tensor | None, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return mix_forward(sources, query, eps, norm_weight, norm_eps)


@_mix_fwd_op.register_fake
def _(sources, query, eps, norm_weight, norm_eps):
    N, R = len(sources), sources[0].numel() // query.shape[0]
    f32 = dict(dtype=torch.float32)
    return torch.empty_like(sources[0]), query.new_empty(N, R, **f32), query.new_empty(N, R, **f32), query.new_empty(R, **f32)


@torch.library.custom_op("attn_res::mix_bwd", mutates_args=())
def _mix_bwd_op(
    sources: list[torch.Tensor], query: torch.Tensor, dout: torch.Tensor,
    score: torch.Tensor, rstd: torch.Tensor, smax: torch.Tensor, norm_weight: torch.Tensor | None, norm_eps: float,
) -> list[torch.Tensor]:
    return mix_backward(sources, query, dout.contiguous(), score, rstd, smax, norm_weight=norm_weight,
                        norm_eps=norm_eps)


@_mix_bwd_op.register_fake
def _(sources, query, dout, score, rstd, smax, norm_weight, norm_eps):
    return [torch.empty_like(v) for v in sources] + [torch.empty_like(query)] + (
        [] if norm_weight is None else [torch.empty_like(norm_weight)])


def _setup_context(ctx, inputs, output):
    sources, query, _, norm_weight, ctx.norm_eps = inputs
    _, score, rstd, smax = output
    ctx.n_sources = len(sources)
    ctx.save_for_backward(*sources, query, score, rstd, smax, norm_weight)


def _backward(ctx, dout, _dscore, _drstd, _dsmax):
    saved = ctx.saved_tensors
    sources, (query, score, rstd, smax, norm_weight) = list(saved[: ctx.n_sources]), saved[ctx.n_sources :]
    if dout is None:
        dout = torch.zeros_like(sources[0])
    grads = _mix_bwd_op(sources, query, dout, score, rstd, smax, norm_weight, ctx.norm_eps)
    dnorm_weight = None if norm_weight is None else grads.pop()
    *dsources, dquery = grads
    return dsources, _query_grad(dquery, len(sources)), None, dnorm_weight, None


def _query_grad(dquery: torch.Tensor, n_sources: int) -> torch.Tensor | None:
    """A lone source (mixed only to be normalised) has weight 1 whatever the query: its gradient is None, as when
    no mix ran, not a zero the optimizer would step on."""
    return dquery if n_sources > 1 else None


_mix_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _MixIntoSinks(torch.autograd.Function):
    """The mix whose backward adds the gradients of the sources that have a sink into it, and the gradient handed
    off for its last source to that source's (kernels/attn_res/sinks.py).

    An eager autograd Function, not the custom ops above: sinks and handoffs are Python objects, which a custom
    op cannot take. The model runs the Triton mix eagerly anyway (parallelize.apply_compile leaves it uncompiled).
    """

    @staticmethod
    def forward(ctx, query: torch.Tensor, eps: float, sinks: list, handoff: GradientHandoff | None,
                norm_weight: torch.Tensor | None, norm_eps: float, *sources: torch.Tensor) -> torch.Tensor:
        out, score, rstd, smax = mix_forward(list(sources), query, eps, norm_weight, norm_eps)
        ctx.sinks, ctx.handoff, ctx.norm_eps = sinks, handoff, norm_eps
        ctx.save_for_backward(*sources, query, score, rstd, smax, norm_weight)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        *sources, query, score, rstd, smax, norm_weight = ctx.saved_tensors
        into = [None if sink is None else sink.grad for sink in ctx.sinks]
        add_last = None if ctx.handoff is None else ctx.handoff.take()
        grads = mix_backward(sources, query, dout.contiguous(), score, rstd, smax, into=into,
                             add_last=None if add_last is None else add_last.contiguous(),
                             norm_weight=norm_weight, norm_eps=ctx.norm_eps)
        dnorm_weight = None if norm_weight is None else grads.pop()
        *dsources, dquery = grads
        for n, sink in enumerate(ctx.sinks):
            if sink is not None:
                sink.grad, dsources[n] = dsources[n], None
        return _query_grad(dquery, len(sources)), None, None, None, dnorm_weight, None, *dsources


def pseudo_query_mix(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, sinks: list[GradientSink | None] | None = None,
    handoff: GradientHandoff | None = None, norm_weight: torch.Tensor | None = None, norm_eps: float | None = None,
) -> torch.Tensor:
    """sum_n softmax_n(<RMSNorm(v_n), q>) v_n in Triton, differentiable in every source and the query.

    sources: N (1..MAX_SOURCES) tensors [..., D] (the model's [B, T, D]) of one shape and device, each
    bfloat16, float16 or float32 (they may differ); query [D], any of those dtypes. Statistics, softmax and
    accumulation are float32; the output has source 0's dtype, each gradient its source's, and one source
    is returned as it is.
    sinks: per source, None or the GradientSink that source's gradient is added into by the backward kernel
    (kernels/attn_res/sinks.py: the source must have passed through `collect` with that sink); None: autograd
    sums every source's gradient. handoff: where the residual add that also reads the last source leaves that
    source's gradient (`sinks.add_handing_off`), for the backward kernel to add to the mix's own share.
    norm_weight: None, or [D] (any of those dtypes): the output is RMSNorm(mix) * norm_weight (eps norm_eps, default
    eps), the norm done by the same kernels on the float32 mix (the sublayer's pre-norm folded in:
    `kernels.attn_res_norm_in_mix`), and norm_weight gets its gradient; a lone source is normalised by them too
    (its query gets no gradient).
    Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU; `kernels.attn_res.pseudo_query_mix_reference` is the
    CPU path (and the float64 one).
    """
    check_mix_inputs(sources, query)
    check_norm_weight(norm_weight, query)
    N = len(sources)
    if N > MAX_SOURCES:
        raise ValueError(f"pseudo_query_mix takes at most {MAX_SOURCES} sources (kernel pointer arguments), got N={N}")
    operands = [*sources, query] + ([norm_weight] if norm_weight is not None else [])
    dtypes = sorted({str(t.dtype) for t in operands})
    if any(t.dtype not in DTYPES for t in operands):
        raise ValueError(
            f"pseudo_query_mix needs bfloat16/float16/float32 sources, query and norm weight, got {', '.join(dtypes)}; "
            "float64 runs in kernels.attn_res.pseudo_query_mix_reference"
        )
    if not triton_runs_on(sources[0].device):
        raise ValueError(
            f"pseudo_query_mix runs Triton kernels and needs CUDA tensors, got device {sources[0].device}; "
            "use kernels.attn_res.pseudo_query_mix_reference on CPU"
        )
    if sinks is not None:
        _check_sinks(sinks, N)
    if handoff is not None and N == 1 and norm_weight is None:
        # NOTE: a lone source without a norm is returned as it is, with no backward of ours to add the handed-off
        # gradient: the source would silently lose it.
        raise ValueError("pseudo_query_mix: a handoff needs a mix of two or more sources (or a norm weight)")
    norm_eps = float(eps if norm_eps is None else norm_eps)
    if N == 1 and norm_weight is None:
        return sources[0]
    if norm_weight is not None:
        norm_weight = norm_weight.contiguous()
    if handoff is not None or (sinks is not None and any(sink is not None for sink in sinks)):
        return _MixIntoSinks.apply(query.contiguous(), float(eps), list(sinks or [None] * N), handoff,
                                   norm_weight, norm_eps, *[v.contiguous() for v in sources])
    out, *_ = _mix_fwd_op([v.contiguous() for v in sources], query.contiguous(), float(eps), norm_weight, norm_eps)
    return out


def _check_sinks(sinks: list, n_sources: int) -> None:
    if len(sinks) != n_sources:
        raise ValueError(f"pseudo_query_mix: sinks has {len(sinks)} entries for {n_sources} sources")
    if any(sink is not None and not isinstance(sink, GradientSink) for sink in sinks):
        raise ValueError("pseudo_query_mix: each sink must be None or a kernels.attn_res.sinks.GradientSink")
    named = [id(sink) for sink in sinks if sink is not None]
    if len(set(named)) != len(named):
        raise ValueError("pseudo_query_mix: two sources share one GradientSink (each source needs its own)")
