"""The pseudo-query mix of Block Attention Residuals (docs/k3.md §2.4) in plain PyTorch.

Legend: N sources, B batch, T tokens, D model width.

Each of N sources v_n [B, T, D] gets a score per token, <RMSNorm(v_n), q>
(RMSNorm without a weight), the scores go through a softmax over n, and the
output is the weighted sum of the sources. This is the ground truth of the
Triton op in `ops.py` and the model's CPU path.
"""

import torch
import torch.nn.functional as F


def check_mix_inputs(sources: list[torch.Tensor], query: torch.Tensor) -> None:
    """Raise ValueError (one line naming the argument) unless N >= 1 sources [..., D] and a query [D] fit together."""
    if not isinstance(sources, (list, tuple)) or not sources:
        got = f"an empty {type(sources).__name__}" if isinstance(sources, (list, tuple)) else type(sources).__name__
        raise ValueError(f"sources must be a non-empty list of [..., D] tensors, got {got}")
    for n, v in enumerate(sources):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"sources must be tensors, source {n} is a {type(v).__name__}")
    # NOTE: dtypes may differ: under bf16 autocast the embedding (source 0) stays float32 while the
    # sublayer outputs are bf16. Every source is read in float32 (float64) and the output takes source 0's dtype.
    first = sources[0]
    for n, v in enumerate(sources):
        if v.shape != first.shape or v.device != first.device:
            raise ValueError(
                f"sources must share one shape and device: source 0 is {tuple(first.shape)} on {first.device}, "
                f"source {n} is {tuple(v.shape)} on {v.device}"
            )
        if not v.is_floating_point():
            raise ValueError(f"sources must be floating tensors, source {n} is {v.dtype}")
    if first.dim() == 0 or first.shape[-1] == 0:
        raise ValueError(f"sources must be tensors [..., D] with D >= 1, got {tuple(first.shape)}")
    if not isinstance(query, torch.Tensor) or query.shape != first.shape[-1:] or not query.is_floating_point():
        got = f"{tuple(query.shape)} {query.dtype}" if isinstance(query, torch.Tensor) else type(query).__name__
        raise ValueError(f"query must be a floating tensor [D] = [{first.shape[-1]}] (the sources' width), got {got}")
    if query.device != first.device:
        raise ValueError(f"query must be on the sources' device {first.device}, got {query.device}")


def check_norm_weight(norm_weight: torch.Tensor | None, query: torch.Tensor) -> None:
    """Raise ValueError (one line) unless norm_weight is None or a floating [D] tensor on the query's device."""
    if norm_weight is None:
        return
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != query.shape or not norm_weight.is_floating_point():
        got = (f"{tuple(norm_weight.shape)} {norm_weight.dtype}" if isinstance(norm_weight, torch.Tensor)
               else type(norm_weight).__name__)
        raise ValueError(f"norm_weight must be a floating tensor [D] = [{query.shape[0]}] (the sources' width), got {got}")
    if norm_weight.device != query.device:
        raise ValueError(f"norm_weight must be on the sources' device {query.device}, got {norm_weight.device}")


def pseudo_query_mix_reference(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, norm_weight: torch.Tensor | None = None,
    norm_eps: float | None = None,
) -> torch.Tensor:
    """sum_n softmax_n(<RMSNorm(v_n), q>) v_n: N sources [B, T, D], query [D] -> [B, T, D].

    Computed in float32 (float64 when a source is float64) and returned in
    source 0's dtype (sources may differ in dtype). One source is returned as it is.
    norm_weight: None, or [D]: the result is RMSNorm(mix) * norm_weight (eps norm_eps, default eps), the norm
    computed before the rounding to source 0's dtype (a lone source is normalised too).
    """
    check_mix_inputs(sources, query)
    check_norm_weight(norm_weight, query)
    compute = torch.float64 if any(v.dtype == torch.float64 for v in sources) else torch.float32
    if len(sources) == 1:
        if norm_weight is None:
            return sources[0]
        mixed = sources[0].to(compute)
    else:
        v_NBTD = torch.stack(sources).to(compute)
        keys_NBTD = F.rms_norm(v_NBTD, (v_NBTD.shape[-1],), None, eps)
        # NOTE: the score is a product and sum, not `keys @ query`: autocast (the trainer's bf16) casts a matmul's
        # operands to bf16 and leaves elementwise ops and sums in float32, so the scores stay float32 under it too.
        weights_NBT = torch.softmax((keys_NBTD * query.to(compute)).sum(-1), dim=0)
        mixed = (weights_NBT.unsqueeze(-1) * v_NBTD).sum(dim=0)
    if norm_weight is not None:
        mixed = F.rms_norm(mixed, (mixed.shape[-1],), norm_weight.to(compute), eps if norm_eps is None else norm_eps)
    return mixed.to(sources[0].dtype)
