"""Triton kernels of the causal depthwise convolution + SiLU, forward and backward.

Legend: N rows (B * T tokens, each batch row starting a document), C channels, W taps.
x, y, dy, dx are [N, C] with contiguous rows; w is [C, W] (tap W-1 is the current token);
pos [N] is each token's position inside its document: tap j reads row t - j iff pos[t] >= j.
Products and sums in float32; w is rounded to x's dtype first, as the reference does.

The backward runs in two passes: the first recomputes the pre-activation z, writes
dz = dy * silu'(z) (rounded to x's dtype) and, walking TILES row tiles of one channel block, adds the
weight gradient's products dz[t] * x[t-i] up elementwise, summing them over rows once per
program (one partial per program); the second gathers dx[t] = sum_j w[j] dz[t + j] from
the rows that read t. A tile never needs a neighbour's registers.
NOTE: a one-pass backward that recomputes dz for the W shifted rows from cache instead of
storing it measured slower (0.19-1.35 ms against 0.14 ms for these two passes at k3-mini's
B8 T4096 C512 on an H200: benchmarks/results/short_conv.md).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# NOTE: forward and dx pass: 32 rows x 128 channels, 4 warps: one 16-byte bf16 load per thread per tap.
BLOCK_T = 16 if INTERPRET else 32
BLOCK_C = 32 if INTERPRET else 128
NUM_WARPS = 4
# The dz pass's tile and the row tiles one program walks (one weight-gradient partial per TILES * BLOCK_T rows):
# 8 x 128, 16 tiles, 4 warps ran 0.142 ms for the whole backward against 0.177 ms with a partial per 32-row tile
# (k3-mini's B8 T4096 C512, H200; `benchmarks/short_conv.py --sweep`).
DZ_LAUNCH = (dict(BLOCK_T=4, BLOCK_C=32, TILES=3, num_warps=4) if INTERPRET
             else dict(BLOCK_T=8, BLOCK_C=128, TILES=16, num_warps=4))


@triton.jit
def _tile(pid_t, pid_c, N, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = pid_t.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    return rows, cols, rows < N, cols < C


@triton.jit
def _preactivation(x_ptr, w_ptr, pos, rows, cols, row_mask, col_mask, C,
                   W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """z [BLOCK_T, BLOCK_C] float32: sum over taps j of w[c, W-1-j] * x[t-j, c] where pos[t] >= j."""
    z = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        src = rows - j
        m = (row_mask & (pos >= j) & (src >= 0))[:, None] & col_mask[None, :]
        xv = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_mask, other=0.0)
        z += xv * wv.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
    return z


@triton.jit
def conv_silu_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, N, C,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """y = silu(z) for one [BLOCK_T, BLOCK_C] tile."""
    rows, cols, row_mask, col_mask = _tile(tl.program_id(0), tl.program_id(1), N, C, BLOCK_T, BLOCK_C)
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    z = _preactivation(x_ptr, w_ptr, pos, rows, cols, row_mask, col_mask, C, W, BLOCK_T, BLOCK_C)
    y = z * tl.sigmoid(z)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(y_ptr + rows[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W: tl.constexpr, i: tl.constexpr):
    """(x[t-i] where pos[t] >= i, else 0; w[c, W-1-i] rounded to x's dtype), both float32."""
    m = (row_mask & (pos >= i) & (rows - i >= 0))[:, None] & col_mask[None, :]
    xv = tl.load(x_ptr + (rows - i)[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
    wv = tl.load(w_ptr + cols * W + (W - 1 - i), mask=col_mask, other=0.0)
    return xv, wv.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def conv_silu_bwd_dz_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dz_ptr, dw_part_ptr, N, C,
                            W: tl.constexpr, TAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                            TILES: tl.constexpr):
    """dz = dy * silu'(z) ([N, C], stored in dz's dtype) for TILES row tiles, and their weight gradient
    dw_part[:, :, pid_t] (from dz before its rounding).

    NOTE: taps 0..3 keep their products dz * x in [BLOCK_T, BLOCK_C] accumulators, summed over rows once at
    the end; a row sum per tile and tap (what taps past 3 do, into a [TAPS, BLOCK_C] accumulator) made the
    pass slower than its loads.
    """
    pid_t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    taps = tl.arange(0, TAPS)
    a0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    a3 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    more = tl.zeros((TAPS, BLOCK_C), dtype=tl.float32)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_mask = rows < N
        pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
        x0, w0 = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, 0)
        z = x0 * w0[None, :]
        if W > 1:
            x1, w1 = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, 1)
            z += x1 * w1[None, :]
        if W > 2:
            x2, w2 = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, 2)
            z += x2 * w2[None, :]
        if W > 3:
            x3, w3 = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, 3)
            z += x3 * w3[None, :]
        for i in tl.static_range(4, W):
            xi, wi = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, i)
            z += xi * wi[None, :]
        mask = row_mask[:, None] & col_mask[None, :]
        offs = rows[:, None] * C + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(z)
        dz = dy * s * (1.0 + z * (1.0 - s))
        tl.store(dz_ptr + offs, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        a0 += dz * x0
        if W > 1:
            a1 += dz * x1
        if W > 2:
            a2 += dz * x2
        if W > 3:
            a3 += dz * x3
        for i in tl.static_range(4, W):
            xi, wi = _tap(x_ptr, w_ptr, rows, row_mask, pos, cols, col_mask, C, W, i)
            more += tl.where(taps[:, None] == i, tl.sum(dz * xi, axis=0)[None, :], 0.0)
    # NOTE: the partials are stored [C, W, programs], so the caller's sum runs over the last (contiguous) dim:
    # torch sums a [P, C * W] float32 partial over P about twice as slowly (an H200, session 22).
    P = tl.num_programs(0)
    part = dw_part_ptr + cols.to(tl.int64) * W * P + pid_t
    tl.store(part + (W - 1) * P, tl.sum(a0, axis=0), mask=col_mask)
    if W > 1:
        tl.store(part + (W - 2) * P, tl.sum(a1, axis=0), mask=col_mask)
    if W > 2:
        tl.store(part + (W - 3) * P, tl.sum(a2, axis=0), mask=col_mask)
    if W > 3:
        tl.store(part + (W - 4) * P, tl.sum(a3, axis=0), mask=col_mask)
    if W > 4:
        tl.store(part[None, :] + ((W - 1 - taps) * P)[:, None], more,
                 mask=(taps >= 4)[:, None] & (taps < W)[:, None] & col_mask[None, :])


@triton.jit
def conv_silu_bwd_dx_kernel(dz_ptr, w_ptr, pos_ptr, dx_ptr, N, C,
                            W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dx[t] = sum over taps j of w[c, W-1-j] * dz[t+j, c] where pos[t+j] >= j (the rows whose tap j read t)."""
    rows, cols, row_mask, col_mask = _tile(tl.program_id(0), tl.program_id(1), N, C, BLOCK_T, BLOCK_C)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        dst = rows + j
        dst_ok = row_mask & (dst < N)
        pos = tl.load(pos_ptr + dst, mask=dst_ok, other=0)
        m = (dst_ok & (pos >= j))[:, None] & col_mask[None, :]
        dz = tl.load(dz_ptr + dst[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_mask, other=0.0)
        dx += dz * wv.to(dx_ptr.dtype.element_ty).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(dx_ptr + rows[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
