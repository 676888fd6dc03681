"""KDA forward in Triton: chunk-local decay, intra-chunk scores, the WY solve, state passing, output.

The math is written out in reference.py's docstring. Pipeline, per chunk of 64
tokens (grid over chunks x heads unless noted):

1. `_decay_kernel`     b = chunk-local cumsum of g (optionally g from the fused safe gate)
2. `_scores_kernel`    M = scale * (decayed q k^T, i >= j), A = (decayed k k^T, i > j), per 16-row block
3. `_solve_kernel`     Ai = (I + diag(beta) A)^-1 by 16x16 block forward substitution
4. `_wy_kernel`        Wk = Ai (beta * exp(b) * k), Wv = Ai (beta * v)
5. `_state_kernel`     sequential over chunks (grid over V tiles x sequences x heads):
                       h_n stored, U = Wv - Wk h, h <- exp(b_last) h + (exp(b_last - b) k)^T U
6. `_output_kernel`    o = (scale * exp(b) q) h + M U

A decayed product sum_c x_ic y_jc exp(b_ic - b_jc) (i >= j) becomes a tensor-core
product once split at a reference row r: (x_i exp(b_i - b_r)) . (y_j exp(b_r - b_j)).
With r at or before every i and at or after every j both factors are <= 1 (b is
non-increasing), which covers the blocks below a 16-row block's diagonal. The
diagonal block takes r at its middle row when its decays stay within 60 of it
(`common.block_references`: every gate above -7.5 per token), factors <= exp(60);
otherwise (a hard reset, say) it is summed exactly, one column at a time.
A fused safe gate whose lower bound keeps every block within 60 of its middle row
(`common.bounded_gate`, lb >= -7.5) compiles the split products alone (BOUNDED).

Legend: T total tokens (packed), H heads, K/V widths, NT chunks, BT 64, BC 16.
Buffers are [T, H, *] row-major; states are [NT or N, H, K, V].
"""

import triton
import triton.language as tl

from kernels.kda.common import (
    block_of, block_references, chunk_bounds, decayed_keys, load_state, middle_reference, sequence_bounds,
)


@triton.jit
def _decay_kernel(
    g, b_out, A_log, dt_bias, chunk_indices, cu_seqlens, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    if t0 >= eos:  # a padding chunk: no rows (common.py)
        return
    rows = t0 + tl.arange(0, BT)
    cols = i_k * BK + tl.arange(0, BK)
    mask = (rows < eos)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * (H * K) + i_h * K + cols[None, :]
    x = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        if HAS_DT_BIAS:
            x += tl.load(dt_bias + i_h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if USE_LOWER_BOUND:
            x = lower_bound * tl.sigmoid(a * x)
        else:
            # softplus with torch's threshold of 20
            x = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        x = tl.where(mask, x, 0.0)
    tl.store(b_out + offs, tl.cumsum(x, axis=0), mask=mask)


@triton.jit
def _scores_kernel(
    q, k, b, M, A, chunk_indices, cu_seqlens, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
    BOUNDED: tl.constexpr,
):
    """Rows [16 s, 16 s + 16) of a chunk's M and A, all 64 columns (zero above the diagonal).

    The decayed products become one tensor-core product per K tile, q_i exp(b_i - b_ref) . k_j exp(b_ref - b_j):
    with the reference at the block's middle row where `block_references` says the block fits (the diagonal
    block included), else at its first row, the diagonal block then summed column by column (exact for any decay).
    BOUNDED: every block fits by construction (`common.bounded_gate`), so the middle row always serves and
    neither the run-time check nor the column loop is compiled.
    """
    i_cs, i_h = tl.program_id(0), tl.program_id(1)
    NS: tl.constexpr = BT // BC
    i_c, i_s = i_cs // NS, i_cs % NS
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    r0 = t0 + i_s * BC
    if r0 < eos:
        o_c = tl.arange(0, BC)
        o_t = tl.arange(0, BT)
        rows = r0 + o_c
        rows_t = t0 + o_t
        m_rows = rows < eos
        acc_m = tl.zeros([BC, BT], dtype=tl.float32)
        acc_a = tl.zeros([BC, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            m_k = cols < K
            m_sk = m_rows[:, None] & m_k[None, :]
            if BOUNDED:
                b_ref = middle_reference(b, r0, eos, i_h, cols, m_k, H, K, BC)
                j_end = r0 + BC
            else:
                fits, b_r0, b_mid = block_references(b, r0, eos, i_h, cols, m_k, H, K, BC)
                b_ref = tl.where(fits, b_mid, b_r0)
                j_end = tl.where(fits, r0 + BC, r0)
            offs_s = rows[:, None] * (H * K) + i_h * K + cols[None, :]
            b_s = tl.load(b + offs_s, mask=m_sk, other=0.0)
            q_s = tl.load(q + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            k_s = tl.load(k + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            e_s = tl.exp(tl.where(m_sk, b_s - b_ref[None, :], 0.0))
            # Columns j: the earlier blocks, and this block too where it fits.
            m_jk = ((rows_t < j_end) & (rows_t < eos))[:, None] & m_k[None, :]
            offs_t = rows_t[:, None] * (H * K) + i_h * K + cols[None, :]
            b_t = tl.load(b + offs_t, mask=m_jk, other=0.0)
            k_j = tl.load(k + offs_t, mask=m_jk, other=0.0).to(tl.float32)
            k_j = tl.trans(k_j * tl.exp(tl.where(m_jk, b_ref[None, :] - b_t, 0.0)))
            acc_m += tl.dot(q_s * e_s, k_j, input_precision=PREC)
            acc_a += tl.dot(k_s * e_s, k_j, input_precision=PREC)
            if not BOUNDED:
                if not fits:
                    for t in range(0, BC):
                        # A column past eos meets only masked rows (i >= t): its clamped load is never used.
                        offs_jt = tl.minimum(r0 + t, eos - 1) * (H * K) + i_h * K + cols
                        b_jt = tl.load(b + offs_jt, mask=m_k, other=0.0)
                        k_jt = tl.load(k + offs_jt, mask=m_k, other=0.0).to(tl.float32)
                        e = tl.exp(tl.where((o_c >= t)[:, None] & m_sk, b_s - b_jt[None, :], float("-inf")))
                        k_e = k_jt[None, :] * e
                        at_t = (o_t == i_s * BC + t)[None, :]
                        acc_m += tl.where(at_t, tl.sum(q_s * k_e, 1)[:, None], 0.0)
                        acc_a += tl.where(at_t, tl.sum(k_s * k_e, 1)[:, None], 0.0)
        out = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
        # NOTE: where, not a product: above the diagonal the fitted product may hold inf (exp(b_i - b_j), i < j).
        tl.store(M + out, tl.where(rows_t[None, :] <= rows[:, None], acc_m * scale, 0.0), mask=m_rows[:, None])
        tl.store(A + out, tl.where(rows_t[None, :] < rows[:, None], acc_a, 0.0), mask=m_rows[:, None])


@triton.jit
def _load_tile(A, beta, t0, eos, i_h, s_row, s_col, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """diag(beta) A restricted to the 16x16 block (s_row, s_col) of a chunk."""
    o_c = tl.arange(0, BC)
    rows = t0 + s_row * BC + o_c
    m = rows < eos
    x = tl.load(A + rows[:, None] * (H * BT) + i_h * BT + s_col * BC + o_c[None, :], mask=m[:, None], other=0.0)
    return x * tl.load(beta + rows * H + i_h, mask=m, other=0.0).to(tl.float32)[:, None]


@triton.jit
def _invert_diag_blocks(A, beta, t0, eos, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """(I + diag(beta) A)^-1 of the four diagonal 16x16 blocks at once, [4, 16, 16], row by row."""
    NS: tl.constexpr = BT // BC
    o_s = tl.arange(0, NS)
    o_c = tl.arange(0, BC)
    inv = tl.zeros([NS, BC, BC], dtype=tl.float32) + tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)[None, :, :]
    for i in range(1, BC):
        rows = t0 + o_s * BC + i
        m = (o_c[None, :] < i) & (rows < eos)[:, None]
        a = tl.load(A + rows[:, None] * (H * BT) + i_h * BT + (o_s * BC)[:, None] + o_c[None, :], mask=m, other=0.0)
        a = a * tl.load(beta + tl.minimum(rows, eos - 1) * H + i_h).to(tl.float32)[:, None]
        new = tl.where(o_c == i, 1.0, 0.0)[None, :] - tl.sum(a[:, :, None] * inv, 1)
        inv = tl.where((o_c == i)[None, :, None], new[:, None, :], inv)
    return inv


@triton.jit
def _store_tile(Ai, x, t0, eos, i_h, s_row, s_col, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    o_c = tl.arange(0, BC)
    rows = t0 + s_row * BC + o_c
    tl.store(Ai + rows[:, None] * (H * BT) + i_h * BT + s_col * BC + o_c[None, :], x, mask=(rows < eos)[:, None])


@triton.jit
def _solve_kernel(
    A, beta, Ai, chunk_indices, cu_seqlens,
    H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
):
    """Ai = (I + diag(beta) A)^-1 for one chunk (A strictly lower), 4x4 blocks of 16, zeros above included."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    if t0 >= eos:  # a padding chunk: no rows (common.py)
        return
    inv = _invert_diag_blocks(A, beta, t0, eos, i_h, H, BT, BC)
    NS: tl.constexpr = BT // BC
    i00, i11, i22, i33 = block_of(inv, 0, NS), block_of(inv, 1, NS), block_of(inv, 2, NS), block_of(inv, 3, NS)
    l10 = _load_tile(A, beta, t0, eos, i_h, 1, 0, H, BT, BC)
    l20 = _load_tile(A, beta, t0, eos, i_h, 2, 0, H, BT, BC)
    l21 = _load_tile(A, beta, t0, eos, i_h, 2, 1, H, BT, BC)
    l30 = _load_tile(A, beta, t0, eos, i_h, 3, 0, H, BT, BC)
    l31 = _load_tile(A, beta, t0, eos, i_h, 3, 1, H, BT, BC)
    l32 = _load_tile(A, beta, t0, eos, i_h, 3, 2, H, BT, BC)
    # Block forward substitution: Ai_ac = -Ai_aa sum_{c <= m < a} L_am Ai_mc.
    i10 = -tl.dot(i11, tl.dot(l10, i00, input_precision=PREC), input_precision=PREC)
    i21 = -tl.dot(i22, tl.dot(l21, i11, input_precision=PREC), input_precision=PREC)
    i20 = -tl.dot(i22, tl.dot(l20, i00, input_precision=PREC) + tl.dot(l21, i10, input_precision=PREC),
                  input_precision=PREC)
    i32 = -tl.dot(i33, tl.dot(l32, i22, input_precision=PREC), input_precision=PREC)
    i31 = -tl.dot(i33, tl.dot(l31, i11, input_precision=PREC) + tl.dot(l32, i21, input_precision=PREC),
                  input_precision=PREC)
    i30 = -tl.dot(
        i33,
        tl.dot(l30, i00, input_precision=PREC) + tl.dot(l31, i10, input_precision=PREC)
        + tl.dot(l32, i20, input_precision=PREC),
        input_precision=PREC,
    )
    _store_tile(Ai, i00, t0, eos, i_h, 0, 0, H, BT, BC)
    _store_tile(Ai, i10, t0, eos, i_h, 1, 0, H, BT, BC)
    _store_tile(Ai, i11, t0, eos, i_h, 1, 1, H, BT, BC)
    _store_tile(Ai, i20, t0, eos, i_h, 2, 0, H, BT, BC)
    _store_tile(Ai, i21, t0, eos, i_h, 2, 1, H, BT, BC)
    _store_tile(Ai, i22, t0, eos, i_h, 2, 2, H, BT, BC)
    _store_tile(Ai, i30, t0, eos, i_h, 3, 0, H, BT, BC)
    _store_tile(Ai, i31, t0, eos, i_h, 3, 1, H, BT, BC)
    _store_tile(Ai, i32, t0, eos, i_h, 3, 2, H, BT, BC)
    _store_tile(Ai, i33, t0, eos, i_h, 3, 3, H, BT, BC)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    for a in tl.static_range(0, NS - 1):
        for c in tl.static_range(a + 1, NS):
            _store_tile(Ai, zero, t0, eos, i_h, a, c, H, BT, BC)


@triton.jit
def _wy_kernel(
    k, v, b, beta, Ai, Wk, Wv, chunk_indices, cu_seqlens,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    if t0 >= eos:  # a padding chunk: no rows (common.py)
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < eos
    ai = tl.load(Ai + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    bt = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    dt = Wk.dtype.element_ty
    for i_v in range(0, tl.cdiv(V, BV)):
        cols = i_v * BV + tl.arange(0, BV)
        m = m_t[:, None] & (cols < V)[None, :]
        offs = rows[:, None] * (H * V) + i_h * V + cols[None, :]
        x = tl.load(v + offs, mask=m, other=0.0).to(tl.float32) * bt[:, None]
        tl.store(Wv + offs, tl.dot(ai.to(dt), x.to(dt), input_precision=PREC).to(dt), mask=m)
    for i_k in range(0, tl.cdiv(K, BK)):
        cols = i_k * BK + tl.arange(0, BK)
        m = m_t[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * (H * K) + i_h * K + cols[None, :]
        x = tl.load(k + offs, mask=m, other=0.0).to(tl.float32) * tl.exp(tl.load(b + offs, mask=m, other=0.0))
        x = x * bt[:, None]
        tl.store(Wk + offs, tl.dot(ai.to(dt), x.to(dt), input_precision=PREC).to(dt), mask=m)


@triton.jit
def _state_kernel(
    k, b, Wk, Wv, U, h, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr,
):
    """Walks one sequence's chunks in order for one head and one V tile; BK covers all of K."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = sequence_bounds(cu_seqlens, chunk_offsets, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, cols < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_offs = o_k[:, None] * V + cols[None, :]
    s = load_state(h0, i_nh, state_offs, m_kv, HAS_H0, K, V, BK, BV)
    dt = Wk.dtype.element_ty
    for i_t in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_t * BT
        rows = t0 + o_t
        m_t = rows < eos
        tl.store(h + ((c0 + i_t) * H + i_h) * K * V + state_offs, s.to(h.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        offs_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        offs_v = rows[:, None] * (H * V) + i_h * V + cols[None, :]
        wk = tl.load(Wk + offs_k, mask=m_tk, other=0.0)
        u = tl.load(Wv + offs_v, mask=m_tv, other=0.0).to(tl.float32)
        u -= tl.dot(wk, s.to(dt), input_precision=PREC)
        tl.store(U + offs_v, u.to(U.dtype.element_ty), mask=m_tv)
        b_last, _, kd = decayed_keys(k, b, offs_k, m_tk, m_k, o_k, t0, eos, i_h, H, K, BT)
        s = s * tl.exp(b_last)[:, None] + tl.dot(tl.trans(kd.to(dt)), u.to(dt), input_precision=PREC)
    if STORE_FINAL:
        tl.store(ht + i_nh * K * V + state_offs, s, mask=m_kv)


@triton.jit
def _output_kernel(
    q, b, h, M, U, o, chunk_indices, cu_seqlens, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    if t0 >= eos:  # a padding chunk: no rows (common.py)
        return
    o_t = tl.arange(0, BT)
    rows = t0 + o_t
    m_t = rows < eos
    cols = i_v * BV + tl.arange(0, BV)
    m_v = cols < V
    dt = U.dtype.element_ty
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        offs_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        qg = tl.load(q + offs_k, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(tl.load(b + offs_k, mask=m_tk, other=0.0))
        s = tl.load(h + (i_c * H + i_h) * K * V + o_k[:, None] * V + cols[None, :],
                    mask=(o_k < K)[:, None] & m_v[None, :], other=0.0)
        acc += tl.dot((qg * scale).to(dt), s.to(dt), input_precision=PREC)
    mm = tl.load(M + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    offs_v = rows[:, None] * (H * V) + i_h * V + cols[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    u = tl.load(U + offs_v, mask=m_tv, other=0.0)
    acc += tl.dot(mm.to(dt), u.to(dt), input_precision=PREC)
    tl.store(o + offs_v, acc.to(o.dtype.element_ty), mask=m_tv)
