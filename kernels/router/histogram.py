"""The Triton kernels of Quantile Balancing's two histograms: each program counts privately, then adds once.

Legend: T tokens, E experts, NB histogram bins.

NOTE: why privatise. The reference counts with one global int32 atomic per element (index_add): per k3-mini
MoE layer (T 32768, E 176, k 6, NB 1024) 5.8M atomics for the margins (~45 us on an H200) and 197K onto only
176 addresses for the expert ids (~95 us), where reading the inputs takes a few us. Here a program counts a
slice of the elements with `tl.histogram` (within a warp: one ballot per bit of the bin id, then a popcount per
bin a lane owns; across warps: shared-memory atomics) and adds its histogram to the output with one global
atomic per nonzero bin. An output address then takes at most one atomic per program along the counted axis
(8 for the margins, 48 for the ids at k3-mini) instead of one per element.

NOTE: what it should cost; not measured here (benchmarks/qb_histogram.py measures it on the GPU). Compiled for
sm_90 by Triton 3.6, the margins kernel's block of 1024 tokens (8 a thread at 4 warps) is 256 POPC, 88 VOTE and
~620 LOP3 a thread: `tl.histogram` spends NB / 32 popcounts per element and lane. For the ids' 256 bins that is
cheap; for the margins' 1024 bins it is 32 per element, and an SM retires 16 popcounts a clock, so
5.8M x 32 / (132 SMs x 16 x 1.98 GHz) ~ 45 us: the margins may cost about what their atomics cost now, the
counts should fall to a few us. LAUNCH makes the tiles a benchmark setting; the counts are exact at any of them.
"""

import torch
import triton
import triton.language as tl

LAUNCH = {
    # One expert per program by default: a program's column loads touch one 4-byte word per 32-byte sector;
    # the neighbouring experts' programs read the rest of the sector from L2 (s [T, E] is 23 MB at k3-mini).
    "margins": dict(group_e=1, tokens_per_program=4096, block_t=1024, num_warps=4),
    "counts": dict(ids_per_program=4096, block=1024, num_warps=4),
}
MAX_BINS = 4096
"""The most bins a program's histogram holds in registers (at 4096 a few spill; Quantile Balancing uses 1024)."""
COUNT_WINDOW = 1024
"""The ids' histogram counts ids in windows of at most this many (k3 routes over up to 896 experts: one)."""


@triton.jit
def _margin_histogram_kernel(s_ptr, bias_ptr, alpha_ptr, half_range_ptr, out_ptr, n_tokens, n_experts,
                             stride_s, stride_bias, stride_alpha, tokens_per_program,
                             NB: tl.constexpr, NB_PAD: tl.constexpr, GROUP_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """out [E, NB] int32 (zeroed) += the histogram of s[t, e] + bias[e] - alpha[t] over this program's tokens
    and GROUP_E experts; s has unit column stride."""
    t_start = tl.program_id(1) * tokens_per_program
    t_end = tl.minimum(t_start + tokens_per_program, n_tokens)
    half_range = tl.load(half_range_ptr)
    # NOTE: the reference's float32 arithmetic, operation for operation: (s + b) - a, then (m - lo) / width
    # with width = (2 * half_range) / NB, correctly rounded (div_rn: Triton's `/` is the approximate
    # div.full.f32, inductor's too), so that every element lands in the reference's bin, edges included.
    lo = -half_range
    width = tl.math.div_rn(2.0 * half_range, NB * 1.0)
    bins = tl.arange(0, NB_PAD)
    for g in tl.static_range(GROUP_E):
        e = tl.program_id(0) * GROUP_E + g
        bias = tl.load(bias_ptr + tl.minimum(e, n_experts - 1) * stride_bias)
        t_stop = tl.where(e < n_experts, t_end, t_start)  # the last group's experts past E count no tokens
        counts = tl.zeros([NB_PAD], dtype=tl.int32)
        for start in range(t_start, t_stop, BLOCK_T):
            t = start + tl.arange(0, BLOCK_T)
            ok = t < t_stop
            s = tl.load(s_ptr + t.to(tl.int64) * stride_s + e, mask=ok, other=0.0)
            alpha = tl.load(alpha_ptr + t.to(tl.int64) * stride_alpha, mask=ok, other=0.0)
            margin = s + bias - alpha
            bin_f = tl.floor(tl.math.div_rn(margin - lo, width))
            counts += tl.histogram(tl.minimum(tl.maximum(bin_f, 0.0), NB - 1.0).to(tl.int32), NB_PAD, mask=ok)
        tl.atomic_add(out_ptr + e * NB + bins, counts, mask=(counts > 0) & (bins < NB), sem="relaxed")


@triton.jit
def _counts_kernel(ids_ptr, out_ptr, n_ids, n_cols, stride_row, stride_col, n, ids_per_program,
                   WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    """out [n] int64 (zeroed) += the counts of this program's slice of ids [R, C] (flat index i = r * C + c)."""
    i_start = tl.program_id(0) * ids_per_program
    i_end = tl.minimum(i_start + ids_per_program, n_ids)
    bins = tl.arange(0, WINDOW)
    for base in range(0, n, WINDOW):
        counts = tl.zeros([WINDOW], dtype=tl.int32)
        for start in range(i_start, i_end, BLOCK):
            i = start + tl.arange(0, BLOCK)
            ok = i < i_end
            offset = (i // n_cols).to(tl.int64) * stride_row + (i % n_cols).to(tl.int64) * stride_col
            local = tl.load(ids_ptr + offset, mask=ok, other=-1) - base
            ok = ok & (local >= 0) & (local < WINDOW)  # ids below the window, or above it, wait for their own
            counts += tl.histogram(local.to(tl.int32), WINDOW, mask=ok)
        tl.atomic_add(out_ptr + base + bins, counts.to(tl.int64), mask=(counts > 0) & (base + bins < n),
                      sem="relaxed")


def margin_histogram_forward(s_TE, bias_E, alpha_T, half_range, n_bins: int) -> torch.Tensor:
    """int32 [E, n_bins] of float32 s [T, E] (unit column stride), bias [E], alpha [T] and 0-dim half_range."""
    n_tokens, n_experts = s_TE.shape
    out = torch.zeros(n_experts, n_bins, device=s_TE.device, dtype=torch.int32)
    if n_tokens == 0 or n_experts == 0:
        return out
    launch = LAUNCH["margins"]
    group_e, per_program = launch["group_e"], launch["tokens_per_program"]
    grid = (triton.cdiv(n_experts, group_e), triton.cdiv(n_tokens, per_program))
    _margin_histogram_kernel[grid](
        s_TE, bias_E, alpha_T, half_range, out, n_tokens, n_experts, s_TE.stride(0), bias_E.stride(0),
        alpha_T.stride(0), per_program, NB=n_bins, NB_PAD=max(32, triton.next_power_of_2(n_bins)),
        GROUP_E=group_e, BLOCK_T=launch["block_t"], num_warps=launch["num_warps"],
    )
    return out


def counts_forward(ids_RC, n: int) -> torch.Tensor:
    """int64 [n]: the counts of the ids in [0, n) of an integer [R, C] tensor (any strides)."""
    out = torch.zeros(n, device=ids_RC.device, dtype=torch.int64)
    n_ids = ids_RC.numel()
    if n_ids == 0:
        return out
    launch = LAUNCH["counts"]
    per_program = launch["ids_per_program"]
    _counts_kernel[(triton.cdiv(n_ids, per_program),)](
        ids_RC, out, n_ids, ids_RC.shape[1], ids_RC.stride(0), ids_RC.stride(1), n, per_program,
        WINDOW=max(32, min(COUNT_WINDOW, triton.next_power_of_2(n))), BLOCK=launch["block"],
        num_warps=launch["num_warps"],
    )
    return out
