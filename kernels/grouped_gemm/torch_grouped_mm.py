"""The routed-expert block on `torch._grouped_mm` (cuBLAS grouped GEMMs, CUDA + bf16 only).

Same permutation and deterministic combine as `moe_experts`; the SiTU-GLU runs
as separate PyTorch ops. It is the public-parts baseline the Triton block is
measured against, and a selectable implementation (`kernels.experts = "grouped_mm"`).
"""

from __future__ import annotations

import torch

from kernels.grouped_gemm.reference import route_permutation, situ_glu


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """Same values stored [E, M, K], viewed [E, K, M]: the layout torch._grouped_mm prefers for mat_b."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def moe_experts_torch_grouped_mm(x_TL, w1_ELF, w3_ELF, w2_EFL, topk_idx_TK, topk_weight_TK):
    """y[t] = sum_j p[t, j] Expert_{idx[t, j]}(x[t]); x bf16 on CUDA, w bf16 or float32. Differentiable."""
    if not (x_TL.is_cuda and x_TL.dtype == torch.bfloat16):
        raise ValueError(f"moe_experts_torch_grouped_mm: needs bf16 CUDA tensors, got {x_TL.dtype} on {x_TL.device}")
    n_tokens, top_k = topk_idx_TK.shape
    order_S, offsets_E = route_permutation(topk_idx_TK, w1_ELF.shape[0])
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    x_SL = x_TL[order_S // top_k]
    w1_ELF, w3_ELF, w2_EFL = (w.to(x_TL.dtype) for w in (w1_ELF, w3_ELF, w2_EFL))  # float32 masters: bf16 products
    g = torch._grouped_mm(x_SL, _column_major(w1_ELF), offs=offsets_E)
    u = torch._grouped_mm(x_SL, _column_major(w3_ELF), offs=offsets_E)
    out_SL = torch._grouped_mm(situ_glu(g, u).to(x_TL.dtype), _column_major(w2_EFL), offs=offsets_E)
    out_TKL = out_SL[inverse_S].view(n_tokens, top_k, -1).float()
    return (out_TKL * topk_weight_TK.float().unsqueeze(-1)).sum(dim=1).to(x_TL.dtype)
