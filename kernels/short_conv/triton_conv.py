"""Triton kernels of the causal depthwise convolution + SiLU, forward and backward.

Legend: N rows (B * T tokens, each batch row starting a document), C channels, W taps.
x, y, dy, dx are [N, C] with contiguous rows; w is [C, W] (tap W-1 is the current token);
pos [N] is each token's position inside its document: tap j reads row t - j iff pos[t] >= j.
Products and sums in float32; w is rounded to x's dtype first, as the reference does.

The backward runs in two passes: the first recomputes the pre-activation z, writes
dz = dy * silu'(z) (float32) and each row block's partial weight gradient; the second
gathers dx[t] = sum_j w[j] dz[t + j] from the rows that read t. A tile never needs a
neighbour's registers, so no pass holds more than one [BLOCK_T, BLOCK_C] tile per tap.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# NOTE: 32 rows x 128 channels, 4 warps: one 16-byte bf16 load per thread per tap.
BLOCK_T = 16 if INTERPRET else 32
BLOCK_C = 32 if INTERPRET else 128
NUM_WARPS = 4


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
def conv_silu_bwd_dz_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dz_ptr, dw_part_ptr, N, C,
                            W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dz = dy * silu'(z) (float32, [N, C]) and this row block's weight gradient dw_part[pid_t] [C, W]."""
    pid_t = tl.program_id(0)
    rows, cols, row_mask, col_mask = _tile(pid_t, tl.program_id(1), N, C, BLOCK_T, BLOCK_C)
    pos = tl.load(pos_ptr + rows, mask=row_mask, other=0)
    z = _preactivation(x_ptr, w_ptr, pos, rows, cols, row_mask, col_mask, C, W, BLOCK_T, BLOCK_C)
    mask = row_mask[:, None] & col_mask[None, :]
    offs = rows[:, None] * C + cols[None, :]
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(z)
    dz = dy * s * (1.0 + z * (1.0 - s))
    tl.store(dz_ptr + offs, dz, mask=mask)
    part = dw_part_ptr + pid_t.to(tl.int64) * C * W
    for j in tl.static_range(W):
        src = rows - j
        m = (row_mask & (pos >= j) & (src >= 0))[:, None] & col_mask[None, :]
        xv = tl.load(x_ptr + src[:, None] * C + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(part + cols * W + (W - 1 - j), tl.sum(dz * xv, axis=0), mask=col_mask)


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
        dz = tl.load(dz_ptr + dst[:, None] * C + cols[None, :], mask=m, other=0.0)
        wv = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_mask, other=0.0)
        dx += dz * wv.to(dx_ptr.dtype.element_ty).to(tl.float32)[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(dx_ptr + rows[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
