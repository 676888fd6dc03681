"""Triton kernels of the causal depthwise convolution + SiLU, forward and backward.

Legend: N rows (B * T tokens, each batch row starting a document), C channels, W taps.
x, y, dy, dx are [N, C] with contiguous rows; w is [C, W] (tap W-1 is the current token);
pos [N] is each token's position inside its document: tap j reads row t - j iff pos[t] >= j.
Products and sums in float32; w is rounded to x's dtype first, as the reference does.

The backward is one pass: each program walks TILES row tiles of one channel block, recomputes
dz = dy * silu'(z) for every row its dx reads (the current row and the W-1 after it, from x
and dy, which the shifted tiles read again from cache), writes dx, and adds the weight
gradient's products up elementwise; it sums them over rows once, into one partial per program.
So dz never goes through memory, and the partials are few (summed by the caller).
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# NOTE: forward: 32 rows x 128 channels, 4 warps: one 16-byte bf16 load per thread per tap.
BLOCK_T = 16 if INTERPRET else 32
BLOCK_C = 32 if INTERPRET else 128
NUM_WARPS = 4
# The backward's tile and the row tiles one program walks (TILES * BLOCK_T rows: one weight-gradient partial each).
BWD_LAUNCH = (dict(BLOCK_T=4, BLOCK_C=32, TILES=2, num_warps=4) if INTERPRET
              else dict(BLOCK_T=16, BLOCK_C=128, TILES=16, num_warps=8))


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
def conv_silu_bwd_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, dx_ptr, dw_part_ptr, N, C,
                         W: tl.constexpr, TAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         TILES: tl.constexpr):
    """dx for TILES consecutive row tiles of one channel block, and their weight gradient's partial dw_part[pid_t].

    dx[t] = sum over taps j of w[c, W-1-j] * dz[t+j] where pos[t+j] >= j, and dz[s] = dy[s] * silu'(z[s]) is
    recomputed for each shifted row s = t + j from x (TAPS >= W rows per tile, [TAPS, BLOCK_T, BLOCK_C]), so dz
    never goes through memory. The weight gradient dz[t] * x[t-i] adds up elementwise over the tiles and is
    summed over rows once, at the end (dw_part [programs, C, W], summed by the caller).
    """
    pid_t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    taps = tl.arange(0, TAPS)  # tap i of row s reads row s - i with weight w[c, W-1-i]
    tap_ok = taps < W
    w_mask = tap_ok[:, None] & col_mask[None, :]
    wv = tl.load(w_ptr + cols[None, :] * W + (W - 1 - taps)[:, None], mask=w_mask, other=0.0)
    wv = wv.to(x_ptr.dtype.element_ty).to(tl.float32)
    dw = tl.zeros((TAPS, BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tile in range(TILES):
        rows = (pid_t * TILES + tile).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            s = rows + j
            s_ok = s < N
            pos = tl.load(pos_ptr + s, mask=s_ok, other=0)
            src = s[None, :] - taps[:, None]
            reads = tap_ok[:, None] & s_ok[None, :] & (pos[None, :] >= taps[:, None]) & (src >= 0)
            xv = tl.load(x_ptr + src[:, :, None] * C + cols[None, None, :],
                         mask=reads[:, :, None] & col_mask[None, None, :], other=0.0).to(tl.float32)
            z = tl.sum(xv * wv[:, None, :], axis=0)
            dy = tl.load(dy_ptr + s[:, None] * C + cols[None, :], mask=s_ok[:, None] & col_mask[None, :],
                         other=0.0).to(tl.float32)
            sig = tl.sigmoid(z)
            dz = dy * sig * (1.0 + z * (1.0 - sig))  # zero on rows past N (dy is)
            if j == 0:
                dw += dz[None, :, :] * xv
            wj = tl.load(w_ptr + cols * W + (W - 1 - j), mask=col_mask, other=0.0)
            dx += tl.where((pos >= j)[:, None], dz, 0.0) * wj.to(x_ptr.dtype.element_ty).to(tl.float32)[None, :]
        mask = (rows < N)[:, None] & col_mask[None, :]
        tl.store(dx_ptr + rows[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    part = dw_part_ptr + pid_t.to(tl.int64) * C * W
    tl.store(part + cols[None, :] * W + (W - 1 - taps)[:, None], tl.sum(dw, axis=1), mask=w_mask)
