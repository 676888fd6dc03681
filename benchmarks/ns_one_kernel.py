"""The whole Newton-Schulz iteration of each block in one persistent Triton kernel: an experiment, not a path.

Measured slower than the trainer's step-by-step iteration and kept here so that the measurement can be rerun
(`benchmarks/newton_schulz.py --fused`; benchmarks/results/newton_schulz.md, session 28).

The idea: batched over many small blocks (k3-mini's routed experts: 5,808 blocks of 256 x 544), the step-by-step
iteration (`titan_k3.optim.orthogonalise.newton_schulz`: per step the products A = X X^T, B' = a I + b A + c A^2
and X <- B' X, each over every block) streams every block's iterate, Gram matrix and polynomial through HBM
three times per step: ~1.6 MB per block and step at 256 x 544, ~47 GB for the k3-mini update. Here one program
takes one block through all the steps before it takes the next, so a block's X (278 KB), A and B' (128 KB each)
are re-read from the L2 cache the moment after they were written; HBM sees each block's input once and its
update once. What it found: HBM was not the limit. One program walks its tiles one after another, each
product's K loop is only 4-9 tiles long (its pipeline never fills), and B' is re-read from L2 for every column
panel of X; at 3,872 blocks of 256 x 544 it ran 13.5-21.1 ms against 8.5 ms for the step-by-step iteration
(cuBLAS's products and `kernels.muon.ns_polynomial`) on an H200.

Per block and step (m <= n is the wide orientation; the caller's block may be [m, n] or [n, m]):
  A  = X X^T            [m, m], tiles on and above the diagonal (A is symmetric), each stored twice
  B' = s t (a I + b t^2 A + c t^4 A^2)   the same tiles; t = 1 / (||G||_F + eps) on the first step (else 1),
                        ||G||_F^2 = trace(A); s = the update scale on the last step (else 1)
  X  <- B' X            column panels [m, BLOCK_N]: a panel of the new X needs only the same panel of the old one,
                        so X is overwritten in place
Storage precision is the iterate's dtype (bf16 in training) for X, A and B' as in the step-by-step path; every
product accumulates in float32. A and B' live in per-program scratch; the iterate lives in the output.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from kernels.device import triton_runs_on
from kernels.muon.fused import ns_poly_epilogue


@triton.jit
def _ptrs(base, rows, cols, stride, T: tl.constexpr):
    """Pointers to elements (rows[i], cols[j]) of a wide [m, n] matrix stored row-major (T False) or as the
    row-major [n, m] transpose (T True); `stride` is the stored matrix's row stride."""
    if T:
        return base + rows[:, None] + cols[None, :] * stride
    return base + rows[:, None] * stride + cols[None, :]


@triton.jit
def _dot(x, y, acc, IEEE: tl.constexpr):
    """acc + x @ y, in full float32 precision for float32 operands (IEEE; tests) or on the tensor cores."""
    if IEEE:
        return tl.dot(x, y, acc, input_precision="ieee")
    return tl.dot(x, y, acc)


@triton.jit
def _store_symmetric(base, rows, cols, m, val, MIRROR: tl.constexpr):
    """Tile `val` at (rows, cols) of a row-major [m, m] matrix, and (MIRROR) its transpose at (cols, rows)."""
    ok = (rows[:, None] < m) & (cols[None, :] < m)
    tl.store(base + rows[:, None] * m + cols[None, :], val, mask=ok)
    if MIRROR:
        tl.store(base + cols[None, :] * m + rows[:, None], val, mask=ok)


@triton.jit
def _gram_tile(x, x_stride, rows, cols, m, n, X_T: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """X[rows, :] @ X[cols, :]^T [BLOCK_T, BLOCK_T] in float32, X a wide [m, n] matrix (stored as `_ptrs` says)."""
    acc = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
    for k0 in range(0, n, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xi = tl.load(_ptrs(x, rows, ks, x_stride, X_T), mask=(rows[:, None] < m) & (ks[None, :] < n), other=0.0)
        xj = tl.load(_ptrs(x, cols, ks, x_stride, X_T), mask=(cols[:, None] < m) & (ks[None, :] < n), other=0.0)
        acc = _dot(xi, tl.trans(xj), acc, IEEE)
    return acc


@triton.jit
def _gram(x, x_stride, a, m, n, X_T: tl.constexpr, IEEE: tl.constexpr, M_PAD: tl.constexpr,
          BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """A = X X^T into scratch `a` (row-major [m, m], X's dtype); returns trace(A) in float32."""
    trace = 0.0
    for ti in tl.static_range(M_PAD // BLOCK_T):
        for tj in tl.static_range(ti, M_PAD // BLOCK_T):
            rows = ti * BLOCK_T + tl.arange(0, BLOCK_T)
            cols = tj * BLOCK_T + tl.arange(0, BLOCK_T)
            acc = _gram_tile(x, x_stride, rows, cols, m, n, X_T, IEEE, BLOCK_T, BLOCK_K)
            val = acc.to(a.dtype.element_ty)
            _store_symmetric(a, rows, cols, m, val, tj > ti)
            if tj == ti:
                trace += tl.sum(tl.where(rows[:, None] == cols[None, :], val.to(tl.float32), 0.0))
    return trace


@triton.jit
def _polynomial(a, b, m, t, s, ca, cb, cc, HAS_T: tl.constexpr, IEEE: tl.constexpr, M_PAD: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """B' = s t (a I + b t^2 A + c t^4 A^2) from scratch `a` into scratch `b` (both row-major [m, m]; t = 1
    unless HAS_T)."""
    for ti in tl.static_range(M_PAD // BLOCK_T):
        for tj in tl.static_range(ti, M_PAD // BLOCK_T):
            rows = ti * BLOCK_T + tl.arange(0, BLOCK_T)
            cols = tj * BLOCK_T + tl.arange(0, BLOCK_T)
            # NOTE: A^2 = A A^T: A is symmetric, stored with both triangles.
            acc = _gram_tile(a, m, rows, cols, m, m, False, IEEE, BLOCK_T, BLOCK_K)
            ok = (rows[:, None] < m) & (cols[None, :] < m)
            av = tl.load(a + rows[:, None] * m + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            val = ns_poly_epilogue(acc, av, rows, cols, t, s, ca, cb, cc, HAS_T)
            _store_symmetric(b, rows, cols, m, val.to(b.dtype.element_ty), tj > ti)


@triton.jit
def _apply(b, x, x_stride, y, y_stride, m, n, X_T: tl.constexpr, Y_T: tl.constexpr, IEEE: tl.constexpr,
           M_PAD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y = B' X, one column panel [m, BLOCK_N] at a time (Y may be X: a panel reads only its own columns)."""
    rows = tl.arange(0, M_PAD)
    for n0 in range(0, n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, m, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            bt = tl.load(b + rows[:, None] * m + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < m), other=0.0)
            xt = tl.load(_ptrs(x, ks, cols, x_stride, X_T), mask=(ks[:, None] < m) & (cols[None, :] < n), other=0.0)
            acc = _dot(bt, xt, acc, IEEE)
        tl.store(_ptrs(y, rows, cols, y_stride, Y_T), acc.to(y.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))


@triton.jit
def _ns_blocks_kernel(g_ptr, out_ptr, scratch_ptr, n_blocks, m, n, g_block_stride, g_stride, out_block_stride,
                      out_stride, ca, cb, cc, scale, eps, STEPS: tl.constexpr, G_T: tl.constexpr,
                      OUT_T: tl.constexpr, IEEE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    a = scratch_ptr + pid.to(tl.int64) * 2 * m * m
    b = a + m * m
    for blk in range(pid, n_blocks, tl.num_programs(0)):
        blk64 = (blk + pid * 0).to(tl.int64)  # the interpreter's range yields ints
        g = g_ptr + blk64 * g_block_stride
        x = out_ptr + blk64 * out_block_stride
        # NOTE: every phase reads what the program's other warps wrote in the phase before (scratch or the
        # iterate), hence a barrier between phases; the first step reads G and writes the iterate into the output.
        sumsq = _gram(g, g_stride, a, m, n, G_T, IEEE, M_PAD, BLOCK_T, BLOCK_K)
        tl.debug_barrier()
        t = 1.0 / (tl.sqrt(sumsq) + eps)
        _polynomial(a, b, m, t, scale if STEPS == 1 else 1.0, ca, cb, cc, True, IEEE, M_PAD, BLOCK_T, BLOCK_K)
        tl.debug_barrier()
        _apply(b, g, g_stride, x, out_stride, m, n, G_T, OUT_T, IEEE, M_PAD, BLOCK_K, BLOCK_N)
        tl.debug_barrier()
        # NOTE: a runtime loop, not an unrolled one: each unrolled step is nine pipelined matmul loops to compile.
        for step in range(1, STEPS):
            _gram(x, out_stride, a, m, n, OUT_T, IEEE, M_PAD, BLOCK_T, BLOCK_K)
            tl.debug_barrier()
            _polynomial(a, b, m, 1.0, tl.where(step == STEPS - 1, scale, 1.0), ca, cb, cc, False, IEEE, M_PAD,
                        BLOCK_T, BLOCK_K)
            tl.debug_barrier()
            _apply(b, x, out_stride, x, out_stride, m, n, OUT_T, OUT_T, IEEE, M_PAD, BLOCK_K, BLOCK_N)
            tl.debug_barrier()


# NOTE: the iterate's column panels are [256, BLOCK_N] float32 accumulators (64 registers a thread at 8 warps for
# BLOCK_N = 64) and the Gram tiles [128, 128]; blocks wider than MAX_M would need more of either than one program
# holds.
MAX_M = 256


def _layout(x: torch.Tensor) -> tuple[bool, int] | None:
    """(stored transposed relative to the wide orientation, row stride) of x [B, r, c], or None when neither of
    its last two dims is contiguous."""
    r, c = x.shape[-2:]
    wide_first = r <= c  # the wide orientation [m, n] is x's own
    if x.stride(-1) == 1 or c == 1:
        return (not wide_first), x.stride(-2)
    if x.stride(-2) == 1 or r == 1:
        return wide_first, x.stride(-1)
    return None


def newton_schulz_blocks(
    G: torch.Tensor, steps: int, coeffs: tuple[float, float, float], *, scale: float = 1.0, eps: float = 1e-7,
    out: torch.Tensor | None = None, programs: int | None = None, config: dict | None = None,
) -> torch.Tensor:
    """Newton-Schulz of every block of G [B, r, c] (min(r, c) <= MAX_M) in one persistent launch -> [B, r, c].

    The same math as the step-by-step `newton_schulz` in G's dtype: each block counts as divided by its Frobenius
    norm (+ eps), the quintic (a, b, c) = `coeffs` runs `steps` times on the wide orientation, and the last step's
    B' carries `scale`. `out` [B, r, c] (contiguous in either of its last two dims; may be G itself, then G is
    overwritten) receives the result; None: a new contiguous tensor. `programs`: how many blocks are in flight
    (default one per SM). `config`: tile sizes (M_PAD, BLOCK_T, BLOCK_K, BLOCK_N) and launch settings (num_warps,
    num_stages), for tests and tuning. Runs on CUDA, or on CPU in Triton's interpreter (float32 there).
    """
    if G.ndim != 3:
        raise ValueError(f"newton_schulz_blocks: G must be [B, r, c]; got shape {tuple(G.shape)}")
    if steps < 1:
        raise ValueError(f"newton_schulz_blocks: steps={steps}; must be >= 1")
    if not triton_runs_on(G.device):
        raise ValueError(f"newton_schulz_blocks needs a CUDA tensor (or TRITON_INTERPRET=1); got one on {G.device}")
    k, r, c = G.shape
    m, n = min(r, c), max(r, c)
    if m > MAX_M:
        raise ValueError(f"newton_schulz_blocks: blocks [{r}, {c}] are wider than {MAX_M} on their short side")
    if _layout(G) is None:
        G = G.contiguous()
    if out is None:
        out = torch.empty((k, r, c), dtype=G.dtype, device=G.device)
    elif out.shape != G.shape or out.dtype != G.dtype or _layout(out) is None:
        raise ValueError(f"newton_schulz_blocks: out must be [B, r, c] = {list(G.shape)} in {G.dtype}, contiguous in "
                         f"one of its last two dims; got {list(out.shape)} in {out.dtype}, strides {out.stride()}")
    if k == 0:
        return out
    g_t, g_stride = _layout(G)
    out_t, out_stride = _layout(out)
    m_pad = max(16, triton.next_power_of_2(m))
    # NOTE: the fastest settings measured (benchmarks/results/newton_schulz.md, session 28).
    cfg = dict(M_PAD=m_pad, BLOCK_T=min(m_pad, 128), BLOCK_K=64 if m_pad >= 64 else m_pad, BLOCK_N=128,
               num_warps=8, num_stages=3)
    cfg.update(config or {})
    if programs is None:
        programs = torch.cuda.get_device_properties(G.device).multi_processor_count if G.is_cuda else 4
    programs = max(1, min(programs, k))
    scratch = torch.empty((programs, 2, m, m), dtype=G.dtype, device=G.device)
    a, b, cc = coeffs
    _ns_blocks_kernel[(programs,)](
        G, out, scratch, k, m, n, G.stride(0), g_stride, out.stride(0), out_stride, float(a), float(b), float(cc),
        float(scale), float(eps), STEPS=steps, G_T=g_t, OUT_T=out_t, IEEE=G.dtype == torch.float32, **cfg)
    return out
