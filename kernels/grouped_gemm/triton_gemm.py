"""Triton grouped GEMMs: rows grouped by expert, one weight matrix per expert.

Every kernel finds its work on the device from `offsets` (cumulative row ends
per expert), so no launch reads the group sizes back to the host. The row
dimension is cut into tiles that never straddle two groups; the grid is the
upper bound `cdiv(N, BLOCK_M) + E + 1` row tiles (each group adds at most one
partial tile) and programs past the real tile count do no work after the
schedule.
Rows past offsets[-1] form extra "tail" tiles that store zeros, so every
output row is written.

The row-tiled GEMM (and glu_up, kernels/grouped_gemm/triton_moe.py) has a
persistent variant too (`PERSISTENT` picks it): PROGRAMS_PER_SM programs per SM,
each walking the real tiles pid, pid + P, pid + 2P, ... (P programs) in one loop
that Triton flattens with the K loop, so that the next tile's loads are issued
while the current tile's epilogue runs. Same tiles, same per-tile accumulation
order: for one config the two give the same bits.

Legend: N rows, K reduction width, M output width, E experts.
"""

import os

import triton
import triton.language as tl

from kernels.grouped_gemm.tuned import prune_to_tuned

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

PERSISTENT = {"glu_up": False, "mm": False, "mm_dual": False}
"""Which expert GEMMs launch their persistent variant; the launchers (kernels/grouped_gemm/ops.py) read it at each
call. NOTE: all off until the GPU measurement (benchmarks/expert_tiles.py --persistent) ranks them in the layer."""

INTERPRET_SMS = 3
"""The SM count a persistent launch assumes in the interpreter: few programs, so that each walks several tiles."""


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


def persistent_configs(configs, per_sm=None):
    """`configs` for a persistent kernel, each with PROGRAMS_PER_SM (programs per SM) from `per_sm`: by default 1 and
    2, 1 alone in the interpreter."""
    if per_sm is None:
        per_sm = (1,) if INTERPRET else (1, 2)
    return [triton.Config({**c.kwargs, "PROGRAMS_PER_SM": n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in configs for n in per_sm]


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
def group_tiles(offsets_ptr, n_rows, N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """The groups' row tiles: (row_base, ends, tile_ends), int32 [E_POW2] each, zero past N_EXPERTS.

    Group e owns row tiles tile_ends[e-1] <= t < tile_ends[e] (tile_ends: cumulative tile counts); tile t starts
    at row row_base[e] + t * BLOCK_M, and the group's rows end at ends[e]. The groups hold tl.max(tile_ends, 0)
    tiles; rows from tl.max(ends, 0) on are the tail. Offsets are clamped to n_rows so that bad offsets never
    address past the tensor.
    """
    e = tl.arange(0, E_POW2)
    real = e < N_EXPERTS
    ends = tl.minimum(tl.load(offsets_ptr + e, mask=real, other=0), n_rows)
    starts = tl.minimum(tl.load(offsets_ptr + e - 1, mask=real & (e > 0), other=0), n_rows)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    return starts - (tile_ends - tiles) * BLOCK_M, ends, tile_ends


@triton.jit
def group_tile(tile, row_base, ends, tile_ends, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, row_start, row_end) of the groups' row tile `tile` < tl.max(tile_ends, 0), from `group_tiles`."""
    expert = tl.sum((tile_ends <= tile).to(tl.int32), 0)
    mine = tl.arange(0, E_POW2) == expert
    row_start = tl.sum(tl.where(mine, row_base, 0), 0) + tile * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    return expert, row_start, row_end


@triton.jit
def row_tile(tile, offsets_ptr, n_rows, N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map row tile `tile` to (expert, row_start, row_end).

    expert is -1 for the tail past offsets[-1] (store zeros there); a tile past
    all real tiles gets row_start >= row_end (nothing to do). Offsets are
    clamped to n_rows (`group_tiles`).
    """
    row_base, ends, tile_ends = group_tiles(offsets_ptr, n_rows, N_EXPERTS, E_POW2, BLOCK_M)
    n_group_tiles = tl.max(tile_ends, 0)
    expert, row_start, row_end = group_tile(tile, row_base, ends, tile_ends, E_POW2, BLOCK_M)
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
def _mm_products(a_ptr, a2_ptr, b_ptr, b2_ptr, a_rows, row_mask, cols, col_mask, K,
                 stride_ak, stride_bk, stride_bn, DUAL: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A[a_rows, :K] @ B[:K, cols] (+ A2[a_rows] @ B2 when DUAL) in float32, summed in `_mm_accumulate`'s order
    (A's K steps, then A2's), in one loop of cdiv(K, BLOCK_K) steps per product.

    NOTE: one loop, not one per product: Triton flattens a persistent tile loop only around a single inner loop
    (FuseNestedLoops), so DUAL's second product continues the same loop, reading A2 and B2 from step
    cdiv(K, BLOCK_K) on. The tiles' row and column pointers are made before the loop, and the flattened loop
    carries them from tile to tile as pointers, which keep their known alignment: column offsets carried as
    integers lost their contiguity, and with it B's vector loads and its software pipelining (the w2 product's
    sm_90 code from Triton 3.6 and 3.9). DUAL picks its operands with Python conditionals (one scalar selects
    whole tensors), not tl.where: after that elementwise select Triton 3.9 pipelined no load of the loop.
    """
    n_k = tl.cdiv(K, BLOCK_K)
    a_tile = a_ptr + a_rows[:, None]
    b_tile = b_ptr + cols[None, :] * stride_bn
    a2_tile = a2_ptr + a_rows[:, None]
    b2_tile = b2_ptr + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, n_k * (2 if DUAL else 1)):
        a_step, b_step, k_step = a_tile, b_tile, step
        if DUAL:
            second = step >= n_k
            a_step = a2_tile if second else a_tile
            b_step = b2_tile if second else b_tile
            k_step = step - n_k if second else step
        ks = k_step * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_step + ks[None, :] * stride_ak, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_step + ks[:, None] * stride_bk, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _a_rows(gather_ptr, rows, row_mask, stride_am, GATHER: tl.constexpr):
    """int64 offsets of the A rows that output rows `rows` read: gather[rows] when GATHER, else the rows."""
    if GATHER:
        rows = tl.load(gather_ptr + rows, mask=row_mask, other=0)
    return rows.to(tl.int64) * stride_am


@triton.jit
def _store_rows(c_ptr, values, rows, row_mask, cols, col_mask, stride_cm, stride_cn):
    """C[rows, cols] = values (rounded to C's dtype), masked to row_mask x col_mask."""
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, values.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


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
    a_rows = _a_rows(gather_ptr, rows, row_mask, stride_am, GATHER)
    # NOTE: tail tiles (expert -1) and idle tiles run no K loop and store zeros.
    k_end = tl.where((expert >= 0) & (row_start < row_end), K, 0)
    b_off = tl.maximum(expert, 0).to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _mm_accumulate(acc, a_ptr, b_ptr + b_off, a_rows, row_mask, cols, col_mask, k_end, K,
                         stride_ak, stride_bk, stride_bn, PRECISION, BLOCK_K)
    if DUAL:
        acc = _mm_accumulate(acc, a2_ptr, b2_ptr + b_off, a_rows, row_mask, cols, col_mask, k_end, K,
                             stride_ak, stride_bk, stride_bn, PRECISION, BLOCK_K)
    _store_rows(c_ptr, acc, rows, row_mask, cols, col_mask, stride_cm, stride_cn)


@triton.jit
def _grouped_mm_persistent_kernel(
    a_ptr, a2_ptr, b_ptr, b2_ptr, c_ptr, offsets_ptr, gather_ptr,
    n_rows, K, M,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
    GATHER: tl.constexpr, DUAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
):
    """`_grouped_mm_kernel` (same arguments, tiles and sums: the same C) on a persistent grid.

    The groups' tiles (row tiles x column tiles, counted on the device from offsets) go round robin over the
    programs, in one loop that Triton flattens with the K loop; the tail's tiles (rows past offsets[-1], zeros
    and no K loop) continue the round robin in a second loop. PROGRAMS_PER_SM only sizes the launch (the
    launcher's grid reads it); the programs stride by tl.num_programs(0).
    NOTE: the stores take their columns from a second counter, store_tile, equal to tile. Columns computed once
    for the loads and the stores are carried by the flattened loop from a tile's start to its end as integers,
    and Triton's alignment analysis loses their contiguity there: glu_up's stores split into 2-byte pieces
    (its sm_90 code from Triton 3.6 and 3.9). Triton's persistent-matmul tutorial counts its epilogue's tiles
    apart too.
    """
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    row_base, ends, tile_ends = group_tiles(offsets_ptr, n_rows, N_EXPERTS, E_POW2, BLOCK_M)
    n_col_tiles = tl.cdiv(M, BLOCK_N)
    n_tiles = tl.max(tile_ends, 0) * n_col_tiles
    store_tile = pid - n_programs
    for tile in tl.range(pid, n_tiles, n_programs, flatten=True):
        expert, row_start, row_end = group_tile(tile // n_col_tiles, row_base, ends, tile_ends, E_POW2, BLOCK_M)
        rows = row_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        cols = (tile % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        b_off = expert.to(tl.int64) * stride_be
        acc = _mm_products(a_ptr, a2_ptr, b_ptr + b_off, b2_ptr + b_off,
                           _a_rows(gather_ptr, rows, row_mask, stride_am, GATHER), row_mask, cols, cols < M, K,
                           stride_ak, stride_bk, stride_bn, DUAL, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        store_tile += n_programs
        store_cols = (store_tile % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_rows(c_ptr, acc, rows, row_mask, store_cols, store_cols < M, stride_cm, stride_cn)
    tail_start = tl.max(ends, 0)
    n_tail_tiles = tl.cdiv(n_rows - tail_start, BLOCK_M) * n_col_tiles
    for tile in tl.range((pid - n_tiles % n_programs + n_programs) % n_programs, n_tail_tiles, n_programs):
        rows = tail_start + (tile // n_col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        _store_rows(c_ptr, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), rows, rows < n_rows, cols, cols < M,
                    stride_cm, stride_cn)


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
grouped_mm_persistent_kernel = tuned_autotune("mm_persistent", persistent_configs(mm_configs()))(
    _grouped_mm_persistent_kernel)
grouped_mm_dual_persistent_kernel = tuned_autotune("mm_dual_persistent", persistent_configs(epilogue_configs()))(
    _grouped_mm_persistent_kernel)
_WGRAD_KEY = [*_KEY, "GATHER_B"]
grouped_wgrad_kernel = tuned_autotune("wgrad", wgrad_configs(dual=False), _WGRAD_KEY)(_grouped_wgrad_kernel)
grouped_wgrad_dual_kernel = tuned_autotune("wgrad_dual", wgrad_configs(dual=True), _WGRAD_KEY)(_grouped_wgrad_kernel)
