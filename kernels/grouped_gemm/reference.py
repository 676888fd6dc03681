"""Pure-PyTorch references for the grouped expert GEMMs of the LatentMoE.

These are the ground truth of the kernel tests and the model's CPU path, so
they are plain autograd code: correct in float32, bfloat16 and float64, and
fast enough on CPU for small models (one matmul per expert, no per-token loop).

Legend:
    T tokens, k experts per token, S = T * k token-slots, E experts,
    L latent width (expert input/output), F expert hidden width,
    N rows of a grouped GEMM, K its reduction width, M its output width.
"""

import torch

__all__ = ["grouped_mm", "moe_experts", "situ_glu", "route_permutation"]


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU(g, u) = 4 tanh(g/4) * sigmoid(g) * 25 tanh(u/25).

    Computed in float32 (float64 stays float64) and returned in that dtype;
    the caller casts.
    """
    compute = torch.float64 if g.dtype == torch.float64 else torch.float32
    g = g.to(compute)
    u = u.to(compute)
    return 4.0 * torch.tanh(g * 0.25) * torch.sigmoid(g) * (25.0 * torch.tanh(u * 0.04))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[r] = x[r] @ w[e] for the rows r of group e; a per-expert loop.

    x [N, K], w [E, K, M], offsets int32 [E] cumulative row ends (group e owns
    rows offsets[e-1]:offsets[e], group 0 starts at 0). Rows past offsets[-1]
    are zero in y and get zero gradient. Returns y [N, M] in x's dtype.
    """
    n_rows = x.shape[0]
    ends = offsets.tolist()
    pieces = []
    start = 0
    for e, end in enumerate(ends):
        pieces.append(x[start:end] @ w[e].to(x.dtype))
        start = end
    pieces.append(x.new_zeros(n_rows - start, w.shape[2]))
    return torch.cat(pieces, dim=0)


def route_permutation(topk_idx_TK: torch.Tensor, n_experts: int):
    """Sort the T*k token-slots by expert, stably, without a host sync.

    Returns (order_S, offsets_E): order_S int64 [S] lists flat slot ids
    (t * k + j) grouped by expert; offsets_E int32 [E] are the cumulative row
    ends of each expert's group in that order.
    """
    flat_S = topk_idx_TK.reshape(-1)
    sorted_S, order_S = torch.sort(flat_S, stable=True)
    # NOTE: searchsorted instead of bincount: CUDA bincount reads the maximum
    # back to the host to size its output.
    experts_E = torch.arange(n_experts, device=flat_S.device, dtype=sorted_S.dtype)
    offsets_E = torch.searchsorted(sorted_S, experts_E, right=True).to(torch.int32)
    return order_S, offsets_E


def moe_experts(
    x_TL: torch.Tensor,
    w1_ELF: torch.Tensor,
    w3_ELF: torch.Tensor,
    w2_EFL: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weight_TK: torch.Tensor,
) -> torch.Tensor:
    """The routed-expert block: y[t] = sum_j p[t, j] * Expert_{idx[t, j]}(x[t]).

    Expert_e(z) = SiTU-GLU(z @ w1[e], z @ w3[e]) @ w2[e]; an id equal to E
    marks a slot no expert here takes (it adds nothing). The GLU and the
    weighted combine are computed in float32 (float64 for float64 inputs);
    y has x's dtype. Differentiable in x, w1, w3, w2 and topk_weight.
    """
    n_tokens, top_k = topk_idx_TK.shape
    n_experts = w1_ELF.shape[0]
    order_S, offsets_E = route_permutation(topk_idx_TK, n_experts)
    token_S = order_S // top_k
    x_SL = x_TL[token_S]
    dt = x_TL.dtype
    g_SF = grouped_mm(x_SL, w1_ELF, offsets_E)
    u_SF = grouped_mm(x_SL, w3_ELF, offsets_E)
    h_SF = situ_glu(g_SF, u_SF).to(dt)
    out_SL = grouped_mm(h_SF, w2_EFL, offsets_E)
    # NOTE: combine by gathering each token's k slot rows back (inverse
    # permutation) and summing: deterministic, unlike a scatter-add.
    inverse_S = torch.empty_like(order_S)
    inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
    acc = torch.float64 if dt == torch.float64 else torch.float32
    out_TKL = out_SL[inverse_S].view(n_tokens, top_k, x_TL.shape[1]).to(acc)
    y_TL = (out_TKL * topk_weight_TK.to(acc).unsqueeze(-1)).sum(dim=1)
    return y_TL.to(dt)
