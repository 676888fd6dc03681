"""Triton grouped GEMMs: rows grouped by expert, one weight matrix per expert.

Every kernel finds its work on the device from `offsets` (cumulative row ends
per expert), so no launch reads the group sizes back to the host. The row
dimension is cut into tiles that never straddle two groups; the grid is the
upper bound `cdiv(N, BLOCK_M) + E + 1` row tiles (each group adds at most one
partial tile) and programs past the real tile count do no work after the
schedule.
Rows past offsets[-1] form extra "tail" tiles that store zeros, so every
output row is written.

Legend: N rows, K reduction width, M output width, E experts.
"""

import os

import triton
import triton.language as tl

from kernels.grouped_gemm.tuned import prune_to_tuned

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _cfg(block_m, block_n, block_k, warps, stages, names=("BLOCK_M", "BLOCK_N", "BLOCK_K")):
    return triton.Config(dict(zip(names, (block_m, block_n, block_k))), num_warps=warps, num_stages=stages)


# NOTE: candidate tiles were chosen by ptxas stack usage for sm_90 (cuobjdump
# -res-usage): a tile whose epilogue holds 64 float32 values per thread next
# to a second accumulator (or g and u) spills hundreds of bytes per thread; on
# an H200 at the k3-mini shape the GLU backward went from 2.18 to 0.99 ms when
# limited to tiles of 32 values per thread. The plain GEMM keeps large tiles.
def mm_configs():
    """Autotune candidates for the plain row-tiled GEMM (one small config in the interpreter)."""
    if INTERPRET:
        return [_cfg(32, 32, 32, 4, 1)]
    return [_cfg(128, 128, 64, 8, 3), _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4), _cfg(128, 256, 64, 8, 3)]


def epilogue_configs():
    """Candidates for the row-tiled kernels with two accumulators or a GLU epilogue."""
    if INTERPRET:
        return [_cfg(32, 32, 32, 4, 1)]
    return [_cfg(128, 64, 64, 8, 3), _cfg(64, 128, 64, 8, 3), _cfg(64, 64, 64, 4, 3), _cfg(128, 128, 64, 8, 3)]


def wgrad_configs(dual: bool):
    """Candidates for the per-expert weight-gradient kernels (two outputs when dual)."""
    names = ("BLOCK_K", "BLOCK_N", "BLOCK_R")
    if INTERPRET:
        return [_cfg(32, 32, 32, 4, 1, names)]
    if dual:
        return [_cfg(128, 64, 64, 8, 3, names), _cfg(64, 128, 64, 8, 3, names), _cfg(64, 64, 64, 4, 4, names),
                _cfg(128, 64, 64, 4, 4, names)]
    return [_cfg(128, 128, 64, 8, 3, names), _cfg(64, 128, 64, 4, 4, names), _cfg(128, 64, 64, 4, 4, names),
            _cfg(128, 256, 64, 8, 3, names)]


def row_tiles_upper_bound(n_rows: int, n_experts: int, block_m: int) -> int:
    """Row tiles any offsets can need: one partial tile per group plus the tail."""
    return triton.cdiv(n_rows, block_m) + n_experts + 1


@triton.jit
def row_tile(tile, offsets_ptr, n_rows, N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map row tile `tile` to (expert, row_start, row_end).

    expert is -1 for the tail past offsets[-1] (store zeros there); a tile past
    all real tiles gets row_start >= row_end (nothing to do). Offsets are
    clamped to n_rows so that bad offsets never address past the tensor.
    """
    e = tl.arange(0, E_POW2)
    real = e < N_EXPERTS
    ends = tl.minimum(tl.load(offsets_ptr + e, mask=real, other=0), n_rows)
    starts = tl.minimum(tl.load(offsets_ptr + e - 1, mask=real & (e > 0), other=0), n_rows)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    n_group_tiles = tl.sum(tiles, 0)
    expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    mine = e == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    is_tail = tile >= n_group_tiles
    row_start = tl.where(is_tail, tl.max(ends, 0) + (tile - n_group_tiles) * BLOCK_M, row_start)
    row_end = tl.where(is_tail, n_rows, row_end)
    expert = tl.where(is_tail, -1, expert)
    return expert, row_start, row_end


@triton.jit
def _mm_accumulate(acc, a_ptr, b_ptr, a_rows, row_mask, cols, col_mask, k_end, K,
                   stride_ak, stride_bk, stride_bn, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += A[a_rows, :K] @ B[:K, cols], A rows given as int64 row offsets; B's tiles rounded to A's dtype as they
    load (float32 master weights with bf16 rows: no cast pass over the weights)."""
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] + ks[None, :] * stride_ak, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _grouped_mm_kernel(
    a_ptr, a2_ptr, b_ptr, b2_ptr, c_ptr, offsets_ptr, gather_ptr,
    n_rows, K, M,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    GATHER: tl.constexpr, DUAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[r] = A[g(r)] @ B[e] (+ A2[g(r)] @ B2[e] when DUAL) for rows r of group e.

    g(r) = gather[r] when GATHER (token rows read straight from x), else r.
    A2/B2 share A/B's strides. Rows outside every group are stored as zeros.
    """
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(M, BLOCK_N)
    expert, row_start, row_end = row_tile(pid // n_col_tiles, offsets_ptr, n_rows, N_EXPERTS, E_POW2, BLOCK_M)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    cols = (pid % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < M
    if GATHER:
        a_rows = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64) * stride_am
    else:
        a_rows = rows.to(tl.int64) * stride_am
    # NOTE: tail tiles (expert -1) and idle tiles run no K loop and store zeros.
    k_end = tl.where((expert >= 0) & (row_start < row_end), K, 0)
    b_off = tl.maximum(expert, 0).to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _mm_accumulate(acc, a_ptr, b_ptr + b_off, a_rows, row_mask, cols, col_mask, k_end, K,
                         stride_ak, stride_bk, stride_bn, PRECISION, BLOCK_K)
    if DUAL:
        acc = _mm_accumulate(acc, a2_ptr, b2_ptr + b_off, a_rows, row_mask, cols, col_mask, k_end, K,
                             stride_ak, stride_bk, stride_bn, PRECISION, BLOCK_K)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, b2_ptr, c_ptr, c2_ptr, offsets_ptr, gather_ptr,
    n_rows, K, M,
    stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    N_EXPERTS: tl.constexpr, GATHER: tl.constexpr, GATHER_B: tl.constexpr, DUAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """C[e] = A[g(rows_e)]^T @ B[h(rows_e)] (and C2[e] with B2) over the rows of group e.

    g(r) = gather[r] when GATHER, h(r) = gather[r] when GATHER_B (token rows read straight from the token
    tensor), else r. One program per (expert, K tile, M tile); an empty group stores zeros.
    B2/C2 share B/C's strides.
    """
    pid = tl.program_id(0)
    n_k_tiles = tl.cdiv(K, BLOCK_K)
    n_n_tiles = tl.cdiv(M, BLOCK_N)
    expert = pid // (n_k_tiles * n_n_tiles)
    ks = ((pid // n_n_tiles) % n_k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = (pid % n_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    n_mask = ns < M
    end = tl.minimum(tl.load(offsets_ptr + expert), n_rows)
    start = tl.minimum(tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0), end)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_mask = rows < end
        a_rows = rows.to(tl.int64)
        b_rows = rows.to(tl.int64)
        if GATHER:
            a_rows = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        if GATHER_B:
            b_rows = tl.load(gather_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        a = tl.load(a_ptr + a_rows[None, :] * stride_am + ks[:, None] * stride_ak,
                    mask=k_mask[:, None] & row_mask[None, :], other=0.0)
        b_off = b_rows[:, None] * stride_bm + ns[None, :] * stride_bn
        bn_mask = row_mask[:, None] & n_mask[None, :]
        acc = tl.dot(a, tl.load(b_ptr + b_off, mask=bn_mask, other=0.0), acc, input_precision=PRECISION)
        if DUAL:
            acc2 = tl.dot(a, tl.load(b2_ptr + b_off, mask=bn_mask, other=0.0), acc2, input_precision=PRECISION)
    c_off = expert.to(tl.int64) * stride_ce + ks[:, None] * stride_ck + ns[None, :] * stride_cn
    c_mask = k_mask[:, None] & n_mask[None, :]
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    if DUAL:
        tl.store(c2_ptr + c_off, acc2.to(c2_ptr.dtype.element_ty), mask=c_mask)


_KEY = ["K", "M", "N_EXPERTS", "GATHER", "DUAL"]
# One jitted body, tuned separately for the single- and two-accumulator uses.


def tuned_autotune(kernel: str, configs, key=_KEY):
    """triton.autotune over `configs`, down to the known winner for keys measured before (kernels/grouped_gemm/tuned.py)."""
    return triton.autotune(configs=configs, key=key, prune_configs_by={"early_config_prune": prune_to_tuned(kernel, key)})


grouped_mm_kernel = tuned_autotune("mm", mm_configs())(_grouped_mm_kernel)
grouped_mm_dual_kernel = tuned_autotune("mm_dual", epilogue_configs())(_grouped_mm_kernel)
_WGRAD_KEY = [*_KEY, "GATHER_B"]
grouped_wgrad_kernel = tuned_autotune("wgrad", wgrad_configs(dual=False), _WGRAD_KEY)(_grouped_wgrad_kernel)
grouped_wgrad_dual_kernel = tuned_autotune("wgrad_dual", wgrad_configs(dual=True), _WGRAD_KEY)(_grouped_wgrad_kernel)
