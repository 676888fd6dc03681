"""The public `top_k_rows`, `expert_counts` and `expert_margin_histogram`: Triton kernels as torch.library
custom ops, with no autograd.

Legend: T tokens, E experts, k selected per token, NB histogram bins.

Each op has a fake kernel, so `torch.compile` sees one opaque call (no graph break). None registers a
backward: the router selects, and Quantile Balancing counts, under torch.no_grad (the router weights'
gradient flows through a gather of the scores at the chosen ids, not through these values).
"""

import torch

from kernels.device import triton_runs_on
from kernels.router.histogram import MAX_BINS, counts_forward, margin_histogram_forward
from kernels.router.kernel import top_k_forward
from kernels.router.reference import check_counts_inputs, check_histogram_inputs, check_inputs

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 8192
"""The widest row the kernel holds in registers (k3 routes over 896 experts)."""


@torch.library.custom_op("k3_router::top_k_rows", mutates_args=())
def _top_k_op(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return top_k_forward(x, k)


@_top_k_op.register_fake
def _(x, k):
    return x.new_empty(x.shape[0], k), x.new_empty(x.shape[0], k, dtype=torch.int64)


def top_k_rows(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of x [T, E] and their indices, largest first: ([T, k] in x's dtype,
    int64 [T, k]); ties go to the lowest index; not differentiable.

    x: bfloat16, float16 or float32, E <= MAX_EXPERTS, any row stride. A row holding NaN gets indices that
    exist (in [0, E)) but are otherwise unspecified. Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU;
    `kernels.router.top_k_rows_reference` is the CPU path (and the float64 one).
    """
    check_inputs(x_TE, k)
    if x_TE.dtype not in DTYPES:
        raise ValueError(f"top_k_rows needs bfloat16/float16/float32 x, got {x_TE.dtype}; "
                         "float64 runs in kernels.router.top_k_rows_reference")
    if x_TE.shape[1] > MAX_EXPERTS:
        raise ValueError(f"top_k_rows holds rows of up to {MAX_EXPERTS} experts, got x {tuple(x_TE.shape)}")
    if not triton_runs_on(x_TE.device):
        raise ValueError(f"top_k_rows runs a Triton kernel and needs CUDA tensors, got device {x_TE.device}; "
                         "use kernels.router.top_k_rows_reference on CPU")
    x = x_TE.detach()
    if x.stride(1) != 1:
        x = x.contiguous()
    return _top_k_op(x, k)


@torch.library.custom_op("k3_router::expert_counts", mutates_args=())
def _expert_counts_op(ids: torch.Tensor, n: int) -> torch.Tensor:
    return counts_forward(ids, n)


@_expert_counts_op.register_fake
def _(ids, n):
    return ids.new_empty(n, dtype=torch.int64)


@torch.library.custom_op("k3_router::expert_margin_histogram", mutates_args=())
def _margin_histogram_op(s: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, half_range: torch.Tensor,
                         n_bins: int) -> torch.Tensor:
    return margin_histogram_forward(s, bias, alpha, half_range, n_bins)


@_margin_histogram_op.register_fake
def _(s, bias, alpha, half_range, n_bins):
    return s.new_empty(s.shape[1], n_bins, dtype=torch.int32)


def expert_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each id in [0, n) occurs in ids (int64 or int32, any shape and strides); the same
    counts as `kernels.router.expert_counts_reference` (moe.count_ids). Ids outside [0, n) are not counted
    (the reference raises on them). Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU.
    """
    check_counts_inputs(ids, n)
    _check_device("expert_counts", ids.device, "expert_counts_reference")
    if ids.numel() >= 2**31:
        raise ValueError(f"expert_counts counts fewer than 2**31 ids, got {tuple(ids.shape)}")
    if ids.numel() == 0:
        return torch.zeros(n, dtype=torch.int64, device=ids.device)
    # NOTE: read as a matrix [R, C] with its strides: the router's experts_TK is a column slice of the top-k
    # ids [T, k + 1], which a flat view would copy.
    ids_RC = ids.detach().reshape(-1, ids.shape[-1]) if ids.dim() >= 2 else ids.detach().reshape(-1, 1)
    return _expert_counts_op(ids_RC, n)


def expert_margin_histogram(s_TE: torch.Tensor, bias_E: torch.Tensor, alpha_T: torch.Tensor,
                            half_range: torch.Tensor, n_bins: int) -> torch.Tensor:
    """int32 [E, n_bins]: per expert, the histogram of its margins s + bias - alpha over [-half_range,
    half_range] in n_bins equal bins, those outside counted in the end bins; not differentiable.

    s float32 [T, E] (any row stride), bias float32 [E], alpha float32 [T] (any strides), half_range a float32
    0-dim tensor on s's device (read by the kernel, never on the host), n_bins <= MAX_BINS. The margins are
    computed in registers, never written, with the float32 arithmetic of
    `kernels.router.expert_margin_histogram_reference`, so the counts equal its counts for finite inputs and a
    positive, normal half_range (a NaN margin lands in some bin, where the reference's index_add fails).
    `.to(torch.float64)` of the counts is moe.margin_histogram. Needs CUDA tensors, or TRITON_INTERPRET=1 on CPU.
    """
    check_histogram_inputs(s_TE, bias_E, alpha_T, half_range, n_bins)
    if n_bins > MAX_BINS:
        raise ValueError(f"expert_margin_histogram holds up to {MAX_BINS} bins, got n_bins = {n_bins}")
    _check_device("expert_margin_histogram", s_TE.device, "expert_margin_histogram_reference")
    s = s_TE.detach()
    if s.stride(1) != 1:
        s = s.contiguous()
    return _margin_histogram_op(s, bias_E.detach(), alpha_T.detach(), half_range.detach(), n_bins)


def _check_device(name: str, device: torch.device, reference: str) -> None:
    if not triton_runs_on(device):
        raise ValueError(f"{name} runs a Triton kernel and needs CUDA tensors, got device {device}; "
                         f"use kernels.router.{reference} on CPU")
