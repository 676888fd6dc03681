"""The largest masked pre-softmax logit per head (QK-Clip's statistic) in plain PyTorch.

Legend: B batch, H heads, T tokens, E query/key width, C a chunk of queries.

Masking is causal and within the document: key j is seen by query i iff
i - pos[b, i] <= j <= i, where pos [B, T] is each token's position inside its
document (`Documents.pos_BT`); pos = None is plain causal (each row one document).
This is the ground truth of the Triton op in `ops.py` and the CPU path; it is
the chunked einsum the model ran before the Triton kernel, with the mask built
from pos chunk by chunk instead of read from a [B, 1, T, T] tensor. Its products
are float32 (float64 for float64 inputs) also under the trainer's bf16 autocast:
they run in `kernels.float32_matmul.matmul_float32`.
"""

import math

import torch

from kernels.float32_matmul import matmul_float32

QUERY_CHUNK = 512


def check_inputs(q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, scale: float, pos_BT: torch.Tensor | None) -> None:
    """Raise ValueError (one line naming the argument) unless q, k [B, H, T, E], scale and pos [B, T] fit together."""
    for name, t in (("q", q_BHTE), ("k", k_BHTE)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating tensor [B, H, T, E], got {got}")
    if k_BHTE.shape != q_BHTE.shape or k_BHTE.dtype != q_BHTE.dtype or k_BHTE.device != q_BHTE.device:
        raise ValueError(
            "q and k must share shape, dtype and device: "
            f"q is {tuple(q_BHTE.shape)} {q_BHTE.dtype} on {q_BHTE.device}, "
            f"k is {tuple(k_BHTE.shape)} {k_BHTE.dtype} on {k_BHTE.device}"
        )
    if not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    if pos_BT is not None:
        B, _, T, _ = q_BHTE.shape
        if not isinstance(pos_BT, torch.Tensor) or pos_BT.shape != (B, T) or pos_BT.is_floating_point() \
                or pos_BT.dtype == torch.bool or pos_BT.is_complex():
            got = f"{tuple(pos_BT.shape)} {pos_BT.dtype}" if isinstance(pos_BT, torch.Tensor) else type(pos_BT).__name__
            raise ValueError(f"pos must be an integer tensor [B, T] = [{B}, {T}] or None, got {got}")
        if pos_BT.device != q_BHTE.device:
            raise ValueError(f"pos must be on q's device {q_BHTE.device}, got {pos_BT.device}")


@torch.no_grad()
def max_logit_per_head_reference(
    q_BHTE: torch.Tensor, k_BHTE: torch.Tensor, scale: float, pos_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """max over b, i, allowed j of scale * <q[b, h, i], k[b, h, j]>, per head: [H].

    float32 for bf16/fp16/fp32 inputs, float64 for float64 ones, products included (exact products of bf16 inputs,
    as the Triton kernel's), whatever autocast surrounds the call; -inf per head when B or T is 0.
    Computed in chunks of QUERY_CHUNK queries, each against every key ([B, H, C, T] scores at a time).
    """
    check_inputs(q_BHTE, k_BHTE, scale, pos_BT)
    B, H, T, _ = q_BHTE.shape
    out_dtype = torch.promote_types(q_BHTE.dtype, torch.float32)
    device = q_BHTE.device
    best_H = torch.full((H,), float("-inf"), dtype=out_dtype, device=device)
    if B == 0:
        return best_H
    keys_T = torch.arange(T, device=device)
    # NOTE: QK-Clip scales a head's weights by tau / max: products in bf16 (up to 0.4% off in
    # tests/kernels/test_max_logit.py) would clip by another factor than the Triton kernel's float32 ones.
    q_BHTE, k_BHTE = q_BHTE.to(out_dtype), k_BHTE.to(out_dtype)
    for start in range(0, T, QUERY_CHUNK):
        stop = min(T, start + QUERY_CHUNK)
        s_BHCT = matmul_float32(q_BHTE[:, :, start:stop], k_BHTE.mT) * scale
        queries_C = keys_T[start:stop]
        allowed_BCT = (keys_T <= queries_C[:, None]).expand(B, -1, -1)
        if pos_BT is not None:
            first_BC = queries_C - pos_BT[:, start:stop]
            allowed_BCT = allowed_BCT & (keys_T >= first_BC[:, :, None])
        s_BHCT = s_BHCT.masked_fill(~allowed_BCT[:, None], float("-inf"))
        best_H = torch.maximum(best_H, s_BHCT.amax(dim=(0, 2, 3)))
    return best_H
