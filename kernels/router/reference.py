"""The router's top-k selection and Quantile Balancing's two histograms in plain PyTorch: the ground truth of
`ops.top_k_rows`, `ops.expert_counts` and `ops.expert_margin_histogram`, and their CPU path.

Legend: T tokens, E experts, k selected per token, NB histogram bins.
"""

import torch


def check_inputs(x_TE: torch.Tensor, k: int) -> None:
    """Raise ValueError (one line naming the argument) unless x is a floating [T, E] tensor and 1 <= k <= E."""
    if not isinstance(x_TE, torch.Tensor) or x_TE.dim() != 2 or not x_TE.is_floating_point():
        got = f"{tuple(x_TE.shape)} {x_TE.dtype}" if isinstance(x_TE, torch.Tensor) else type(x_TE).__name__
        raise ValueError(f"top_k_rows: x must be a floating tensor [T, E], got {got}")
    if not isinstance(k, int) or not 1 <= k <= x_TE.shape[1]:
        raise ValueError(f"top_k_rows: k = {k!r} must be an int in [1, E = {x_TE.shape[1]}]")


def top_k_rows_reference(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row and their indices, largest first ([T, k] each, x's dtype and int64); ties:
    the lowest index.

    NOTE: k rounds of (row max, mask the winner) instead of torch.topk: for k3-mini's [32768, 176] scores and
    k = 7, topk's per-row radix select and gather took 0.68 ms per MoE layer on an H200 (7.2 ms of a 184 ms
    step), while inductor fuses these rounds into one kernel (91 us per layer; the Triton op 40 us).
    """
    check_inputs(x_TE, k)
    cols = torch.arange(x_TE.shape[-1], device=x_TE.device)
    values, indices = [], []
    for _ in range(k):
        v_T, i_T = x_TE.max(dim=-1)
        values.append(v_T)
        indices.append(i_T)
        x_TE = torch.where(cols == i_T[:, None], float("-inf"), x_TE)
    return torch.stack(values, dim=-1), torch.stack(indices, dim=-1)


def check_histogram_inputs(s_TE, bias_E, alpha_T, half_range, n_bins, dtypes=(torch.float32,)) -> None:
    """Raise ValueError (one line naming the argument) unless s [T, E], bias [E], alpha [T] and the 0-dim
    half_range are tensors of `dtypes` on one device and n_bins is an int >= 1 (the kernel: float32 only; the
    reference also float64, as a float64 model routes)."""
    kinds = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    if not isinstance(s_TE, torch.Tensor) or s_TE.dim() != 2 or s_TE.dtype not in dtypes:
        raise ValueError(f"expert_margin_histogram: s must be a {kinds} tensor [T, E], got {_described(s_TE)}")
    T, E = s_TE.shape
    for name, x, shape in (("bias", bias_E, (E,)), ("alpha", alpha_T, (T,)), ("half_range", half_range, ())):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape or x.dtype not in dtypes:
            raise ValueError(f"expert_margin_histogram: {name} must be a {kinds} tensor {list(shape)} "
                             f"(s is [{T}, {E}]), got {_described(x)}")
        if x.device != s_TE.device:
            raise ValueError(f"expert_margin_histogram: {name} is on {x.device}, s on {s_TE.device}")
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"expert_margin_histogram: n_bins = {n_bins!r} must be an int >= 1")


def check_counts_inputs(ids, n) -> None:
    """Raise ValueError (one line naming the argument) unless ids is an int64 or int32 tensor and n an int >= 1."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"expert_counts: ids must be an int64 or int32 tensor, got {_described(ids)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"expert_counts: n = {n!r} must be an int >= 1")


def _described(x) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__


def _count(flat: torch.Tensor, n: int) -> torch.Tensor:
    """int32 [n]: how often each id in [0, n) occurs in the 1-D flat.

    NOTE: titan_k3.models.k3.moe.count_ids' formula: an index_add of ones (one global atomic per id on CUDA),
    not torch.bincount (which reads the maximum back to the host: a device sync), counted in int32 (inductor
    has no int64 atomic add).
    """
    ones = torch.ones_like(flat, dtype=torch.int32)
    return torch.zeros(n, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones)


def expert_counts_reference(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each id in [0, n) occurs in ids (int64 or int32, any shape); moe.count_ids."""
    check_counts_inputs(ids, n)
    return _count(ids.reshape(-1), n).to(torch.int64)


def expert_margin_histogram_reference(s_TE: torch.Tensor, bias_E: torch.Tensor, alpha_T: torch.Tensor,
                                      half_range: torch.Tensor, n_bins: int) -> torch.Tensor:
    """int32 [E, n_bins]: per expert, the histogram of its margins s + bias - alpha over [-half_range, half_range]
    in n_bins equal bins, those outside counted in the end bins.

    s float32 [T, E], bias float32 [E], alpha float32 [T], half_range a float32 0-dim tensor (never read on
    the host); float64 too (a float64 model's router), promoted as torch promotes. moe.margin_histogram's formula
    on moe.QuantileBalancedRouter's margins, in float32:
    `margin_histogram(s + bias - alpha[:, None], half_range)` is this with n_bins = QB_BINS, as float64.
    """
    check_histogram_inputs(s_TE, bias_E, alpha_T, half_range, n_bins, (torch.float32, torch.float64))
    E = s_TE.shape[1]
    margins_TE = s_TE + bias_E - alpha_T[:, None]
    lo, width = -half_range, 2 * half_range / n_bins
    bins_TE = ((margins_TE - lo) / width).floor().clamp_(0, n_bins - 1).long()
    flat = (bins_TE + torch.arange(E, device=bins_TE.device) * n_bins).flatten()
    return _count(flat, E * n_bins).view(E, n_bins)
