"""KDA backward in Triton.

With the forward's chunk quantities (reference.py's docstring), per chunk with
state h entering it and dh the gradient of the state leaving it:

    O  = Qd h + M U,  Qd = scale exp(b) q       S' = exp(b_last) h + Kd^T U,  Kd = exp(b_last - b) k
    U  = Ai R,  R = beta v - Xk h,  Xk = beta exp(b) k,  Ai = (I + diag(beta) A)^-1

so that, by chain rule,

    dU  = M^T dO + Kd dh                 dh_in = exp(b_last) dh + Qd^T dO - (Ai Xk)^T dU
    dR  = Ai^T dU                        dL = -dR U^T (strictly lower),  dA = diag(beta) dL
    dM  = dO U^T (i >= j)                dv = beta dR,  dXk = -dR h^T
    dQd = dO h^T,  dKd = U dh^T          d exp(b_last) = rowsum(h * dh)

and every decayed product P_ij = sum_c x_ic y_jc exp(b_ic - b_jc) sends
dx_i = sum_j dP_ij y_j exp(b_i - b_j), dy_j = sum_i dP_ij x_i exp(b_i - b_j),
db_i += x_i dx_i, db_j -= y_j dy_j. Finally dg is the reverse cumsum of db in a chunk.

Kernels: `_dstate_kernel` (sequential, last chunk first), `_dchunk_kernel`
(dense per-chunk terms), `_dintra_kernel` (the decayed products, per 16-row
block, split at reference rows as in fwd.py), `_ddecay_kernel` (reverse cumsum
and the fused gate's derivative). With a bounded safe gate (`common.bounded_gate`)
`_dchunk_kernel` can add the decayed products itself (FUSE_INTRA) and
`_dintra_kernel` is not launched.
"""

import triton
import triton.language as tl

from kernels.kda.common import (
    block_of, block_references, chunk_bounds, decayed_keys, load_state, middle_reference, sequence_bounds,
)


@triton.jit
def _dstate_kernel(
    q, k, b, M, Wk, do, dht, dh, dU, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr, PREC: tl.constexpr,
):
    """Walks one sequence's chunks from last to first for one head and one V tile; BK covers all of K."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, c0 = sequence_bounds(cu_seqlens, chunk_offsets, i_n)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    cols = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, cols < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_offs = o_k[:, None] * V + cols[None, :]
    ds = load_state(dht, i_nh, state_offs, m_kv, HAS_DHT, K, V, BK, BV)
    dt = Wk.dtype.element_ty
    NT = tl.cdiv(eos - bos, BT)
    for i in range(0, NT):
        i_t = NT - 1 - i
        t0 = bos + i_t * BT
        rows = t0 + o_t
        m_t = rows < eos
        tl.store(dh + ((c0 + i_t) * H + i_h) * K * V + state_offs, ds.to(dh.dtype.element_ty), mask=m_kv)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        offs_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        offs_v = rows[:, None] * (H * V) + i_h * V + cols[None, :]
        b_last, b_t, kd = decayed_keys(k, b, offs_k, m_tk, m_k, o_k, t0, eos, i_h, H, K, BT)
        qd = tl.load(q + offs_k, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(b_t) * scale
        mm = tl.load(M + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
        d_o = tl.load(do + offs_v, mask=m_tv, other=0.0)
        du = tl.dot(tl.trans(mm.to(dt)), d_o.to(dt), input_precision=PREC)
        du += tl.dot(kd.to(dt), ds.to(dt), input_precision=PREC)
        tl.store(dU + offs_v, du.to(dU.dtype.element_ty), mask=m_tv)
        wk = tl.load(Wk + offs_k, mask=m_tk, other=0.0)
        ds = ds * tl.exp(b_last)[:, None] + tl.dot(tl.trans(qd.to(dt)), d_o.to(dt), input_precision=PREC)
        ds -= tl.dot(tl.trans(wk), du.to(dt), input_precision=PREC)
    if HAS_H0:
        tl.store(dh0 + i_nh * K * V + state_offs, ds, mask=m_kv)


@triton.jit
def _dchunk_kernel(
    q, k, v, b, beta, A, Ai, h, dh, U, dU, do,
    dq, dk, dv, db, dbeta, dM, dA,
    chunk_indices, cu_seqlens, scale, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, PREC: tl.constexpr, FUSE_INTRA: tl.constexpr,
):
    """The dense per-chunk gradient terms for one K tile, walking V in tiles.

    The K-independent results (dv, dM, dA and their beta terms) come from the first K
    tile alone; dbeta is written per K tile ([NK, T, H]) and summed by the caller.
    dq, dk, db are written in float32 for `_dintra_kernel` to complete.
    FUSE_INTRA (the bounded safe gate only, `common.bounded_gate`): every K tile forms dM and dA itself
    and adds its decayed-product gradients as `_dintra_kernel` would, so that dq, dk are final (stored in
    their own dtype), db is complete, and neither dM, dA nor float32 dq, dk make a round trip through memory.
    """
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    if t0 >= eos:  # a padding chunk: no rows (common.py)
        return
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    rows = t0 + o_t
    m_t, m_k = rows < eos, o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    offs_tt = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
    ai = tl.load(Ai + offs_tt, mask=m_t[:, None], other=0.0)
    bt = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    dt = k.dtype.element_ty
    d_qd = tl.zeros([BT, BK], dtype=tl.float32)
    d_kd = tl.zeros([BT, BK], dtype=tl.float32)
    d_xk = tl.zeros([BT, BK], dtype=tl.float32)
    d_exp = tl.zeros([BK], dtype=tl.float32)
    d_m = tl.zeros([BT, BT], dtype=tl.float32)
    d_l = tl.zeros([BT, BT], dtype=tl.float32)
    d_beta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        cols = i_v * BV + tl.arange(0, BV)
        m_v = cols < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        offs_v = rows[:, None] * (H * V) + i_h * V + cols[None, :]
        offs_s = (i_c * H + i_h) * K * V + o_k[:, None] * V + cols[None, :]
        s = tl.load(h + offs_s, mask=m_kv, other=0.0)
        ds = tl.load(dh + offs_s, mask=m_kv, other=0.0)
        d_o = tl.load(do + offs_v, mask=m_tv, other=0.0)
        u = tl.load(U + offs_v, mask=m_tv, other=0.0)
        du = tl.load(dU + offs_v, mask=m_tv, other=0.0)
        d_qd += tl.dot(d_o.to(dt), tl.trans(s.to(dt)), input_precision=PREC)
        d_kd += tl.dot(u.to(dt), tl.trans(ds.to(dt)), input_precision=PREC)
        d_exp += tl.sum(s.to(tl.float32) * ds.to(tl.float32), 1)
        dr = tl.dot(tl.trans(ai.to(dt)), du.to(dt), input_precision=PREC)
        d_xk -= tl.dot(dr.to(dt), tl.trans(s.to(dt)), input_precision=PREC)
        if FUSE_INTRA:
            d_m += tl.dot(d_o.to(dt), tl.trans(u.to(dt)), input_precision=PREC)
            d_l -= tl.dot(dr.to(dt), tl.trans(u.to(dt)), input_precision=PREC)
        else:
            if i_k == 0:
                d_m += tl.dot(d_o.to(dt), tl.trans(u.to(dt)), input_precision=PREC)
                d_l -= tl.dot(dr.to(dt), tl.trans(u.to(dt)), input_precision=PREC)
        if i_k == 0:
            vv = tl.load(v + offs_v, mask=m_tv, other=0.0).to(tl.float32)
            tl.store(dv + offs_v, (dr * bt[:, None]).to(dv.dtype.element_ty), mask=m_tv)
            d_beta += tl.sum(vv * dr, 1)
    # dM: the gradient of the unscaled decayed product q k^T that M scales; dA that of decayed k k^T.
    d_mm = tl.where(o_t[:, None] >= o_t[None, :], d_m * scale, 0.0)
    d_l = tl.where(o_t[:, None] > o_t[None, :], d_l, 0.0)
    d_aa = d_l * bt[:, None]
    if i_k == 0:
        if not FUSE_INTRA:
            tl.store(dM + offs_tt, d_mm, mask=m_t[:, None])
            tl.store(dA + offs_tt, d_aa, mask=m_t[:, None])
        d_beta += tl.sum(d_l * tl.load(A + offs_tt, mask=m_t[:, None], other=0.0), 1)

    offs_k = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
    last = tl.minimum(t0 + BT, eos) - 1
    b_last = tl.load(b + last * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
    b_t = tl.load(b + offs_k, mask=m_tk, other=0.0)
    e_b = tl.exp(b_t)
    e_d = tl.exp(tl.where(m_tk, b_last[None, :] - b_t, 0.0))
    qq = tl.load(q + offs_k, mask=m_tk, other=0.0).to(tl.float32)
    kk = tl.load(k + offs_k, mask=m_tk, other=0.0).to(tl.float32)
    kd_dkd = kk * e_d * d_kd
    xk_dxk = kk * e_b * d_xk
    d_beta += tl.sum(xk_dxk, 1)
    tl.store(dbeta + i_k * T * H + rows * H + i_h, d_beta, mask=m_t)
    d_q = scale * e_b * d_qd
    d_k = e_d * d_kd + bt[:, None] * e_b * d_xk
    d_b = scale * qq * e_b * d_qd - kd_dkd + bt[:, None] * xk_dxk
    # b_last enters through exp(b_last) h and through every Kd row.
    d_last = tl.sum(kd_dkd, 0) + tl.exp(b_last) * d_exp
    d_b += tl.where((rows == last)[:, None], d_last[None, :], 0.0)
    if FUSE_INTRA:
        # Per 16-row block s, the rows of dM, dA, of their transposes and of the dense terms, picked
        # out of [NS, BC, *] reshapes (register tensors cannot be sliced); then `_dintra_kernel`'s
        # bounded split products, the reference at the block's middle row.
        NS: tl.constexpr = BT // BC
        o_c = tl.arange(0, BC)
        dm3 = tl.reshape(d_mm, [NS, BC, BT])
        da3 = tl.reshape(d_aa, [NS, BC, BT])
        dmT3 = tl.reshape(tl.trans(d_mm), [NS, BC, BT])
        daT3 = tl.reshape(tl.trans(d_aa), [NS, BC, BT])
        dq3 = tl.reshape(d_q, [NS, BC, BK])
        dk3 = tl.reshape(d_k, [NS, BC, BK])
        db3 = tl.reshape(d_b, [NS, BC, BK])
        for i_s in tl.static_range(NS):
            r0 = t0 + i_s * BC
            rows_s = r0 + o_c
            m_sk = (rows_s < eos)[:, None] & m_k[None, :]
            offs_s = rows_s[:, None] * (H * K) + i_h * K + o_k[None, :]
            b_mid = middle_reference(b, r0, eos, i_h, o_k, m_k, H, K, BC)
            b_s = tl.load(b + offs_s, mask=m_sk, other=0.0)
            q_s = tl.load(q + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            k_s = tl.load(k + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            m_j = (rows < r0 + BC)[:, None] & m_tk
            m_i = (rows >= r0)[:, None] & m_tk
            # NOTE: the chunk's tiles are loaded again (cache hits) rather than kept live across the blocks.
            dq_row, dk_row, dk_col = decayed_grads(
                block_of(dm3, i_s, NS), block_of(da3, i_s, NS), block_of(dmT3, i_s, NS), block_of(daT3, i_s, NS),
                b_s, tl.load(q + offs_k, mask=m_tk, other=0.0).to(tl.float32),
                tl.load(k + offs_k, mask=m_tk, other=0.0).to(tl.float32), tl.load(b + offs_k, mask=m_tk, other=0.0),
                b_mid, b_mid, m_j, m_i, m_sk, PREC,
            )
            tl.store(dq + offs_s, (block_of(dq3, i_s, NS) + dq_row).to(dq.dtype.element_ty), mask=m_sk)
            tl.store(dk + offs_s, (block_of(dk3, i_s, NS) + dk_row + dk_col).to(dk.dtype.element_ty), mask=m_sk)
            tl.store(db + offs_s, block_of(db3, i_s, NS) + q_s * dq_row + k_s * (dk_row - dk_col), mask=m_sk)
    else:
        tl.store(dq + offs_k, d_q, mask=m_tk)
        tl.store(dk + offs_k, d_k, mask=m_tk)
        tl.store(db + offs_k, d_b, mask=m_tk)


@triton.jit
def decayed_grads(dm_r, da_r, dm_c, da_c, b_s, q_t, k_t, b_t, b_row, b_col, m_j, m_i, m_sk, PREC: tl.constexpr):
    """(dq_row, dk_row, dk_col) [BC, BK] of one 16-row block: its decayed-product gradients as rows and columns,
    the products in the intra-chunk precision PREC (`intra_dot`).

    dm_r, da_r [BC, BT] are the block's rows of dM, dA, dm_c, da_c [BC, BT] its columns (transposed); b_s [BC, BK]
    its decays; q_t, k_t, b_t [BT, BK] the chunk's. The row terms take the chunk's rows m_j [BT, BK] as columns j,
    split at b_row; the column terms its rows m_i as rows i, split at b_col (module docstring).
    """
    k_j = k_t * tl.exp(tl.where(m_j, b_row[None, :] - b_t, float("-inf")))
    e_i = tl.exp(tl.where(m_i, b_t - b_col[None, :], float("-inf")))
    e_row = tl.exp(tl.where(m_sk, b_s - b_row[None, :], 0.0))
    e_col = tl.exp(tl.where(m_sk, b_col[None, :] - b_s, 0.0))
    dq_row = e_row * intra_dot(dm_r, k_j, PREC)
    dk_row = e_row * intra_dot(da_r, k_j, PREC)
    dk_col = e_col * (intra_dot(dm_c, q_t * e_i, PREC) + intra_dot(da_c, k_t * e_i, PREC))
    return dq_row, dk_row, dk_col


@triton.jit
def intra_dot(a, b, PREC: tl.constexpr):
    """a @ b of float32 tiles for the decayed-product gradients: "ieee" where PREC asks for it (float32 calls), three
    TF32 passes for "tf32" (bfloat16 / float16 calls), or PREC itself ("bf16x3": `ops.intra_precision`).

    NOTE: db takes every pair of a block's rows once as a row term and once as a column term, and the gate's
    gradient is a chunk's reverse sum of db, so behind a steeply decaying token the pairs after it must cancel.
    One-pass TF32 rounds the two terms differently, and the residue outweighed the true sum: with the softplus
    gate on fla's packed cases (A = exp(A_log) up to 16) dt_bias came 0.57-1.1% off on an H200. The CPU
    interpreter with TF32-rounded products reproduced it (float16: dt_bias 1.1e-2, A_log 2.7e-2) and placed it
    in these products alone (TF32 everywhere else: 4.5e-4; TF32 here alone: 7.5e-3); in three passes the H200
    gave 2.5e-4 to 4.8e-4 (float16), 2.6e-3 to 3.2e-3 (bfloat16) on those cases (benchmarks/results/kda.md).
    """
    if PREC == "tf32":
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _dintra_kernel(
    q, k, b, dM, dA, dq, dk, db, dq_out, dk_out, chunk_indices, cu_seqlens,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Decayed-product gradients of the 16 rows of block s, as rows (i) and as columns (j) of M and A.

    dM is the gradient of decayed q k^T (M / scale), dA that of decayed k k^T; adds to the float32 dq, dk, db
    that `_dchunk_kernel` wrote, storing the sums of dq and dk in dq_out and dk_out (q's dtype).
    Per K tile, the row terms are one tensor-core product against the chunk's earlier rows and the
    column terms one against its later rows, each split at a reference row: the block's middle row where
    `block_references` says the block fits (the diagonal block included), else the block's first row for
    the row terms and the next block's first row for the column terms, the diagonal block then summed
    column by column (exact for any decay).
    Runs on the exact path only (a bounded safe gate fuses these terms into `_dchunk_kernel`, FUSE_INTRA; the
    bounded forward with this unfused backward is refused: see kernels/kda/ops.py).
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
        m_rows, m_t = rows < eos, rows_t < eos
        # This block's rows of dM and dA [BC, BT], and its columns [BT, BC].
        offs_r = rows[:, None] * (H * BT) + i_h * BT + o_t[None, :]
        dm_r = tl.load(dM + offs_r, mask=m_rows[:, None], other=0.0)
        da_r = tl.load(dA + offs_r, mask=m_rows[:, None], other=0.0)
        offs_c = rows_t[:, None] * (H * BT) + i_h * BT + i_s * BC + o_c[None, :]
        dm_c = tl.trans(tl.load(dM + offs_c, mask=m_t[:, None], other=0.0))
        da_c = tl.trans(tl.load(dA + offs_c, mask=m_t[:, None], other=0.0))
        r1 = tl.minimum(r0 + BC, tl.minimum(t0 + BT, eos) - 1)  # the next block's first row, or the chunk's last
        for i_k in range(0, tl.cdiv(K, BK)):
            cols = i_k * BK + tl.arange(0, BK)
            m_k = cols < K
            m_sk = m_rows[:, None] & m_k[None, :]
            fits, b_r0, b_mid = block_references(b, r0, eos, i_h, cols, m_k, H, K, BC)
            b_r1 = tl.load(b + r1 * (H * K) + i_h * K + cols, mask=m_k, other=0.0)
            b_row = tl.where(fits, b_mid, b_r0)
            b_col = tl.where(fits, b_mid, b_r1)
            j_end = tl.where(fits, r0 + BC, r0)
            i_start = tl.where(fits, r0, r0 + BC)
            offs_s = rows[:, None] * (H * K) + i_h * K + cols[None, :]
            b_s = tl.load(b + offs_s, mask=m_sk, other=0.0)
            q_s = tl.load(q + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            k_s = tl.load(k + offs_s, mask=m_sk, other=0.0).to(tl.float32)
            m_tk = m_t[:, None] & m_k[None, :]
            offs_t = rows_t[:, None] * (H * K) + i_h * K + cols[None, :]
            b_t = tl.load(b + offs_t, mask=m_tk, other=0.0)
            k_t = tl.load(k + offs_t, mask=m_tk, other=0.0).to(tl.float32)
            q_t = tl.load(q + offs_t, mask=m_tk, other=0.0).to(tl.float32)
            # Columns j of the row terms, rows i of the column terms (this block's own where it fits).
            m_j = (rows_t < j_end)[:, None] & m_tk
            m_i = (rows_t >= i_start)[:, None] & m_tk
            dq_row, dk_row, dk_col = decayed_grads(
                dm_r, da_r, dm_c, da_c, b_s, q_t, k_t, b_t, b_row, b_col, m_j, m_i, m_sk, PREC,
            )
            if not fits:
                for t in range(0, BC):
                    # Row t of the diagonal block as column j = t of the row terms and as row i = t of the
                    # column terms; a row t past eos meets only masked rows, so its clamped loads are unused.
                    r_t = tl.minimum(r0 + t, eos - 1)
                    offs_jt = r_t * (H * K) + i_h * K + cols
                    b_jt = tl.load(b + offs_jt, mask=m_k, other=0.0)
                    q_jt = tl.load(q + offs_jt, mask=m_k, other=0.0).to(tl.float32)
                    k_jt = tl.load(k + offs_jt, mask=m_k, other=0.0).to(tl.float32)
                    at_col = rows * (H * BT) + i_h * BT + i_s * BC + t
                    dm_jt = tl.load(dM + at_col, mask=m_rows, other=0.0)
                    da_jt = tl.load(dA + at_col, mask=m_rows, other=0.0)
                    at_row = r_t * (H * BT) + i_h * BT + i_s * BC + o_c
                    dm_it = tl.load(dM + at_row)
                    da_it = tl.load(dA + at_row)
                    e = tl.exp(tl.where((o_c >= t)[:, None] & m_sk, b_s - b_jt[None, :], float("-inf")))
                    dq_row += dm_jt[:, None] * k_jt[None, :] * e
                    dk_row += da_jt[:, None] * k_jt[None, :] * e
                    live = r0 + t < eos
                    e = tl.exp(tl.where((o_c <= t)[:, None] & m_sk & live, b_jt[None, :] - b_s, float("-inf")))
                    dk_col += (dm_it[:, None] * q_jt[None, :] + da_it[:, None] * k_jt[None, :]) * e
            d_q = tl.load(dq + offs_s, mask=m_sk, other=0.0) + dq_row
            d_k = tl.load(dk + offs_s, mask=m_sk, other=0.0) + dk_row + dk_col
            tl.store(dq_out + offs_s, d_q.to(dq_out.dtype.element_ty), mask=m_sk)
            tl.store(dk_out + offs_s, d_k.to(dk_out.dtype.element_ty), mask=m_sk)
            d_b = q_s * dq_row + k_s * (dk_row - dk_col)
            tl.store(db + offs_s, tl.load(db + offs_s, mask=m_sk, other=0.0) + d_b, mask=m_sk)


@triton.jit
def _ddecay_kernel(
    db, g, A_log, dt_bias, dg, dA_log_part, ddt_part, chunk_indices, cu_seqlens, lower_bound,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    HAS_GATE: tl.constexpr, HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    """dg = reverse cumsum of db inside the chunk, then through the fused gate if any (stored in dg's dtype).

    With the gate, dg is the raw gate's gradient; this chunk's sums of the A_log gradient
    (dA_log_part [NT, NK, H]) and of the dt_bias gradient (ddt_part [H, K, NT], float32) are
    left for the caller to add up: every chunk writes its rows of both, zeros for a padding chunk.
    NOTE: ddt_part is stored [H, K, NT] (chunks last): torch sums a [NT, H * K] float32 partial over NT 2-3x
    more slowly than a [H * K, NT] one over its last dimension (k3-mini: NT ~ 530, H * K = 512; H200, session 22).
    """
    i_c, i_k, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, eos, t0 = chunk_bounds(chunk_indices, cu_seqlens, i_c, BT)
    rows = t0 + tl.arange(0, BT)
    cols = i_k * BK + tl.arange(0, BK)
    mask = (rows < eos)[:, None] & (cols < K)[None, :]
    offs = rows[:, None] * (H * K) + i_h * K + cols[None, :]
    x = tl.load(db + offs, mask=mask, other=0.0)
    d = tl.sum(x, 0)[None, :] - tl.cumsum(x, axis=0) + x  # zero on masked rows
    if HAS_GATE:
        z = tl.load(g + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            z += tl.load(dt_bias + i_h * K + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if USE_LOWER_BOUND:
            sg = tl.sigmoid(a * z)
            d_pre = d * lower_bound * sg * (1.0 - sg)  # d/d(a z)
            d_a = d_pre * a * z
            d = d_pre * a
        else:
            sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
            d_a = -d * a * sp
            d = -d * a * tl.sigmoid(z)
        tl.store(dA_log_part + (i_c * tl.num_programs(1) + i_k) * H + i_h, tl.sum(tl.sum(d_a, 1), 0))
        if HAS_DT_BIAS:
            tl.store(ddt_part + (i_h * K + cols) * tl.num_programs(0) + i_c, tl.sum(d, 0), mask=cols < K)
    tl.store(dg + offs, d.to(dg.dtype.element_ty), mask=mask)
