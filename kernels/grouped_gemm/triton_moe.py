"""Triton kernels around the expert GEMMs: gathered SiTU-GLU up-projection,
its pointwise backward (with the routing weights' gradient), and the
deterministic weighted combine.

Legend: T tokens, k experts per token, S = T * k token-slots sorted by
expert, E experts, L latent width, F expert hidden width.
"""

import triton
import triton.language as tl

from kernels.grouped_gemm.triton_gemm import INTERPRET, epilogue_configs, row_tile, tuned_autotune


@triton.jit
def _tanh(z):
    # NOTE: tanh through sigmoid: one formula that both the interpreter and
    # every Triton version provide; its absolute error (~1e-7) is far below bf16.
    return 2.0 * tl.sigmoid(2.0 * z) - 1.0


# NOTE: below this g the gate is taken at the bound, a(-50) ~ -8e-22: with e = exp(-g/2) <= 7.2e10 the product
# (1 + e)(1 + e^2) stays finite (an unbounded e reads inf / inf = NaN once g < -177).
GATE_FLOOR = tl.constexpr(-50.0)


@triton.jit
def _gate_exp(g):
    """e = exp(-g/2), g clamped at GATE_FLOOR: tanh(g/4) = (1 - e) / (1 + e) and sigmoid(g) = 1 / (1 + e^2).

    NOTE: both of a(g)'s factors from one exponential: the up-projection's epilogue evaluated three sigmoid-style
    exponentials per element, and the special functions were ~0.1 ms of its ~0.61 ms at k3-mini's shape
    (benchmarks/results/moe.md, session 26).
    """
    return tl.exp(-0.5 * tl.maximum(g, GATE_FLOOR))


@triton.jit
def _gate(g):
    """a(g) = 4 tanh(g/4) sigmoid(g) = 4 (1 - e) / ((1 + e)(1 + e^2)), e = `_gate_exp(g)`: one exponential and one
    division."""
    e = _gate_exp(g)
    return 4.0 * (1.0 - e) / ((1.0 + e) * (1.0 + e * e))


@triton.jit
def _slot_tile(pid, offsets_ptr, n_rows, F, N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid's tile of the [S, F] slot matrix: BLOCK_M slots of one expert by BLOCK_N columns.

    Returns (expert, row_start, row_end) as `row_tile` gives them, local [BLOCK_M] row
    offsets from row_start with row_mask, and the tile's columns cols [BLOCK_N] with col_mask.
    """
    n_col_tiles = tl.cdiv(F, BLOCK_N)
    expert, row_start, row_end = row_tile(pid // n_col_tiles, offsets_ptr, n_rows, N_EXPERTS, E_POW2, BLOCK_M)
    local = tl.arange(0, BLOCK_M)
    row_mask = local < row_end - row_start
    cols = (pid % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < F
    return expert, row_start, row_end, local, row_mask, cols, col_mask


@tuned_autotune("glu_up", epilogue_configs(), key=["L", "F", "N_EXPERTS", "STORE_GU"])
@triton.jit
def glu_up_kernel(
    x_ptr, w1_ptr, w3_ptr, h_ptr, g_ptr, u_ptr, offsets_ptr, token_ptr,
    n_rows, L, F,
    stride_xt, stride_xl, stride_we, stride_wl, stride_wf, stride_s,
    N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, STORE_GU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[s] = SiTU-GLU(x[token[s]] @ w1[e], x[token[s]] @ w3[e]) for slots s of expert e.

    x rows are gathered in the A-load (no permuted copy of x); both products
    share that load; the GLU runs in float32 on the accumulators. g and u
    (rounded to h's dtype) are stored for the backward when STORE_GU.
    h, g, u are [S, F] with row stride stride_s.
    NOTE: slots past offsets[-1] (the tail: under the EP all_gather dispatch,
    the other ranks' half of the slots) are left unwritten: every consumer
    (the w2 GEMM, its weight gradient, the GLU backward) skips the tail, and writing
    zeros there cost 3 x [S/2, F] of memory traffic per EP2 layer. The tail's
    programs return at once: under EP2 they are half the grid, and running
    the GLU epilogue on empty tiles made one EP rank's glu_up 1.45x slower
    than the whole block's on one GPU (benchmarks/moe.py --ep 2).
    """
    expert, row_start, row_end, local, row_mask, cols, col_mask = _slot_tile(
        tl.program_id(0), offsets_ptr, n_rows, F, N_EXPERTS, E_POW2, BLOCK_M, BLOCK_N
    )
    if (expert < 0) | (row_start >= row_end):
        return  # the tail, or a tile past the last group's: nothing to read or write
    tokens = tl.load(token_ptr + row_start + local, mask=row_mask, other=0)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    w_off = expert.to(tl.int64) * stride_we
    w1_tile = w1_ptr + w_off + cols[None, :] * stride_wf
    w3_tile = w3_ptr + w_off + cols[None, :] * stride_wf
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < L
        a = tl.load(x_rows + ks[None, :] * stride_xl, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b_mask = k_mask[:, None] & col_mask[None, :]
        # NOTE: weight tiles rounded to x's dtype as they load (float32 masters: `moe_experts(cast_in_kernel=True)`).
        w1 = tl.load(w1_tile + ks[:, None] * stride_wl, mask=b_mask, other=0.0).to(a.dtype)
        w3 = tl.load(w3_tile + ks[:, None] * stride_wl, mask=b_mask, other=0.0).to(a.dtype)
        acc_g = tl.dot(a, w1, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, w3, acc_u, input_precision=PRECISION)
    h = _gate(acc_g) * (25.0 * _tanh(acc_u * 0.04))
    base = row_start.to(tl.int64) * stride_s
    s_off = local[:, None] * stride_s + cols[None, :]
    s_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(h_ptr + base + s_off, h.to(h_ptr.dtype.element_ty), mask=s_mask)
    if STORE_GU:
        tl.store(g_ptr + base + s_off, acc_g.to(g_ptr.dtype.element_ty), mask=s_mask)
        tl.store(u_ptr + base + s_off, acc_u.to(u_ptr.dtype.element_ty), mask=s_mask)


GLU_BWD_LAUNCH = dict(rows=32, cols=64, num_warps=8)
"""The GLU backward's pointwise pass: 32 rows x 64 columns per step along F, 8 warps.
NOTE: a step of the whole row would mask 47% of its lanes at k3-mini's F = 544 (the next power of two is 1024);
64-wide steps mask 6% (nine steps), and each row's weight gradient adds up across them."""


def glu_bwd_launch(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_S, BLOCK_F, num_warps) of the GLU backward's pointwise pass at hidden width F (GLU_BWD_LAUNCH)."""
    if INTERPRET:
        return 4, 16, 4
    return (GLU_BWD_LAUNCH["rows"], min(GLU_BWD_LAUNCH["cols"], triton.next_power_of_2(hidden)),
            GLU_BWD_LAUNCH["num_warps"])


@triton.jit
def glu_bwd_pointwise_kernel(
    dh_ptr, g_ptr, u_ptr, du_ptr, hp_ptr, weight_ptr, order_ptr, dweight_ptr, offsets_ptr, n_rows, F,
    N_EXPERTS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """The SiTU-GLU backward and the routing weights' gradient, per slot row s (all [S, F] tensors contiguous).

    dh [S, F] holds dout[s] @ w2^T with dout[s] = dy[token(s)] unweighted. With a(g) = 4 tanh(g/4) sigmoid(g),
    b(u) = 25 tanh(u/25), h = a(g) b(u) and p = weight[order[s]] the slot's routing weight:
    dweight[order[s]] = <dh[s], h[s]> (float32: the gradient of p, since y[t] sums p * h[s] @ w2);
    dg = p dh b(u) a'(g) (written over dh), du = p dh a(g) b'(u); hp = p h (the w2 weight gradient is
    hp^T @ dout). h is rebuilt from g and u as stored, so the forward keeps neither h nor its output rows;
    it differs from the forward's h, computed before g and u were rounded, by that rounding.
    Rows past offsets[-1] (the tail) are skipped; offsets[-1] is clamped to n_rows, as `row_tile` clamps.
    """
    start = tl.program_id(0).to(tl.int64) * BLOCK_S
    end = tl.minimum(tl.load(offsets_ptr + N_EXPERTS - 1), n_rows).to(tl.int64)
    if start >= end:
        return  # the tail: nothing to read or write
    rows = start + tl.arange(0, BLOCK_S)
    row_mask = rows < end
    flat = tl.load(order_ptr + rows, mask=row_mask, other=0)
    p = tl.load(weight_ptr + flat, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    dweight = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_mask[:, None] & (cols < F)[None, :]
        offs = rows[:, None] * F + cols[None, :]
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        e = _gate_exp(g)
        tg = (1.0 - e) / (1.0 + e)
        sg = 1.0 / (1.0 + e * e)
        tu = _tanh(u * 0.04)
        act_g = 4.0 * tg * sg
        act_u = 25.0 * tu
        h = act_g * act_u
        dweight += tl.sum(dh * h, axis=1)
        d_act_g = (1.0 - tg * tg) * sg + act_g * (1.0 - sg)
        d_act_u = 1.0 - tu * tu
        dh = dh * p
        tl.store(dh_ptr + offs, (dh * act_u * d_act_g).to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + offs, (dh * act_g * d_act_u).to(du_ptr.dtype.element_ty), mask=mask)
        tl.store(hp_ptr + offs, (h * p).to(hp_ptr.dtype.element_ty), mask=mask)
    tl.store(dweight_ptr + flat, dweight, mask=row_mask)


def combine_block_sizes(width: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_L) for the combine kernels: whole rows up to 256 wide."""
    if INTERPRET:
        return 32, 32
    return 16, min(triton.next_power_of_2(width), 256)


@triton.jit
def combine_kernel(
    src_ptr, inverse_ptr, weight_ptr, y_ptr,
    n_tokens, L, stride_src, stride_y,
    TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """y[t] = sum_j p[t, j] * src[inverse[t*k + j]] in float32 (p = 1 unless WEIGHTED).

    Gathering each token's k slot rows (rather than scattering slots into
    tokens) keeps the sum's order fixed: deterministic, no atomics.
    src [S, L] sorted by expert; inverse [T*k] maps flat slot -> sorted row.
    """
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    t_mask = tokens < n_tokens
    mask = t_mask[:, None] & (cols < L)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_L), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.load(inverse_ptr + tokens * TOP_K + j, mask=t_mask, other=0).to(tl.int64)
        v = tl.load(src_ptr + slot[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            p = tl.load(weight_ptr + tokens * TOP_K + j, mask=t_mask, other=0.0).to(tl.float32)
            v = v * p[:, None]
        acc += v
    tl.store(y_ptr + tokens.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
