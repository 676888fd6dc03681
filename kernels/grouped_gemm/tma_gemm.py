"""The row-tiled grouped GEMM with its operand tiles loaded by the Hopper tensor-memory accelerator (TMA).

The same work as `triton_gemm._grouped_mm_kernel` for rows that are not gathered (C[r] = A[r] @ B[e], and
+ A2[r] @ B2[e] when DUAL): the A tile [BLOCK_M, BLOCK_K] and the weight tile come from tensor descriptors
instead of per-element pointers, so no thread computes addresses or masks in the K loop and each tile is one
bulk copy into shared memory. Rows past the tile's group (the next expert's rows) are loaded and multiplied
but never stored; coordinates past a tensor's end read zeros (the descriptor's bounds), so K need not be a
multiple of BLOCK_K.

Legend: N rows, K reduction width, M output width, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.grouped_gemm.triton_gemm import INTERPRET, row_tile, row_tiles_upper_bound
from kernels.grouped_gemm.triton_moe import _slot_tile, glu_store

TMA_LAUNCH = {
    "mm": dict(enabled=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "mm_dual": dict(enabled=False, BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3),
    "glu_up": dict(enabled=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
}
"""Whether the launchers (kernels/grouped_gemm/ops.py) send each use here, and its launch (tile, warps, pipeline
stages): "mm" the single-product row GEMM, "mm_dual" the two-product one (both for rows that are not gathered),
"glu_up" the up-projection (its x rows gathered by pointers, only the weights through TMA)."""


def tma_launch(kind: str) -> dict:
    """The TMA launch setting of one use ("mm", "mm_dual" or "glu_up": TMA_LAUNCH)."""
    return TMA_LAUNCH[kind]


def tma_applies(a: torch.Tensor, b: torch.Tensor, gather: torch.Tensor | None = None) -> bool:
    """Whether the TMA kernel can run this row GEMM: A's rows in order and contiguous, B [E, K, M] with unit
    stride along M or along K (a transposed weight), one dtype, 16-byte aligned rows."""
    if gather is not None or a.dtype != b.dtype or not a.is_contiguous():
        return False
    size = a.element_size()
    if b.stride(2) == 1:
        inner = b
    elif b.stride(1) == 1:
        inner = b.transpose(1, 2)
    else:
        return False
    return (inner.is_contiguous() and (a.shape[1] * size) % 16 == 0 and (inner.shape[2] * size) % 16 == 0
            and a.data_ptr() % 16 == 0 and inner.data_ptr() % 16 == 0)


def glu_weights_tma_applies(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor) -> bool:
    """Whether the up-projection can read w1 and w3 [E, L, F] through TMA: contiguous, x's dtype, 16-byte rows,
    and x's rows with unit stride along L."""
    return (x.stride(1) == 1 and all(w.is_contiguous() and w.dtype == x.dtype and w.data_ptr() % 16 == 0
                                     for w in (w1, w3)) and (w1.shape[2] * w1.element_size()) % 16 == 0)


def _weight_descriptor(b: torch.Tensor, block_k: int, block_n: int) -> tuple[TensorDescriptor, bool]:
    """(descriptor of B's storage, transposed): B [E, K, M] as stored [E, K, M] or, transposed, [E, M, K]."""
    if b.stride(2) == 1:
        return TensorDescriptor.from_tensor(b, [1, block_k, block_n]), False
    stored = b.transpose(1, 2)
    return TensorDescriptor.from_tensor(stored, [1, block_n, block_k]), True


def launch_mm_tma(a, b, offsets, out, precision: str, a2=None, b2=None):
    """out[r] = a[r] @ b[e] (+ a2[r] @ b2[e]) for rows r of group e; zeros past offsets[-1] (`tma_applies` holds,
    out contiguous)."""
    assert out.stride(1) == 1
    n_rows, n_cols = out.shape
    n_experts, red = b.shape[0], b.shape[1]
    dual = a2 is not None
    launch = tma_launch("mm_dual" if dual else "mm")
    bm, bn, bk = launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"]
    if INTERPRET:
        bm, bn, bk = 32, 32, 32
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc, transposed = _weight_descriptor(b, bk, bn)
    a2_desc, b2_desc = a_desc, b_desc
    if dual:
        a2_desc = TensorDescriptor.from_tensor(a2, [bm, bk])
        b2_desc, transposed2 = _weight_descriptor(b2, bk, bn)
        assert transposed2 == transposed, "b and b2 share a layout"
    grid = (row_tiles_upper_bound(n_rows, n_experts, bm) * triton.cdiv(n_cols, bn),)
    extra = {} if INTERPRET else dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    _grouped_mm_tma_kernel[grid](
        a_desc, a2_desc, b_desc, b2_desc, out, offsets, n_rows, red, n_cols, out.stride(0),
        N_EXPERTS=n_experts, E_POW2=triton.next_power_of_2(n_experts), DUAL=dual, B_TRANSPOSED=transposed,
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra,
    )
    return out


@triton.jit
def _weight_tile(desc, e, k0, col0, B_TRANSPOSED: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """B[e][k0:k0+BLOCK_K, col0:col0+BLOCK_N] as a [BLOCK_K, BLOCK_N] tile."""
    if B_TRANSPOSED:
        return tl.trans(desc.load([e, col0, k0]).reshape(BLOCK_N, BLOCK_K))
    return desc.load([e, k0, col0]).reshape(BLOCK_K, BLOCK_N)


@triton.jit
def _grouped_mm_tma_kernel(
    a_desc, a2_desc, b_desc, b2_desc, c_ptr, offsets_ptr, n_rows, K, M, stride_cm,
    N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, DUAL: tl.constexpr, B_TRANSPOSED: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[r] = A[r] @ B[e] (+ A2[r] @ B2[e] when DUAL) for rows r of group e; rows outside every group store zeros."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(M, BLOCK_N)
    expert, row_start, row_end = row_tile(pid // n_col_tiles, offsets_ptr, n_rows, N_EXPERTS, E_POW2, BLOCK_M)
    col0 = (pid % n_col_tiles) * BLOCK_N
    # NOTE: tail tiles (expert -1) and idle tiles run no K loop and store zeros.
    k_end = tl.where((expert >= 0) & (row_start < row_end), K, 0)
    e = tl.maximum(expert, 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        acc = tl.dot(a_desc.load([row_start, k0]), _weight_tile(b_desc, e, k0, col0, B_TRANSPOSED, BLOCK_K, BLOCK_N),
                     acc, input_precision=PRECISION)
        if DUAL:
            acc = tl.dot(a2_desc.load([row_start, k0]),
                         _weight_tile(b2_desc, e, k0, col0, B_TRANSPOSED, BLOCK_K, BLOCK_N), acc,
                         input_precision=PRECISION)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = (rows < row_end)[:, None] & (cols < M)[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


def launch_glu_up_tma(x, w1, w3, offsets, token, h, g, u, precision: str):
    """`ops._launch_glu_up` with the weights' tiles through TMA (w1, w3 [E, L, F] contiguous, x's dtype)."""
    (n_experts, latent, hidden), n_slots = w1.shape, h.shape[0]
    launch = tma_launch("glu_up")
    bm, bn, bk = (32, 32, 32) if INTERPRET else (launch["BLOCK_M"], launch["BLOCK_N"], launch["BLOCK_K"])
    w1_desc = TensorDescriptor.from_tensor(w1, [1, bk, bn])
    w3_desc = TensorDescriptor.from_tensor(w3, [1, bk, bn])
    grid = (row_tiles_upper_bound(n_slots, n_experts, bm) * triton.cdiv(hidden, bn),)
    extra = {} if INTERPRET else dict(num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    _glu_up_tma_kernel[grid](
        x, w1_desc, w3_desc, h, h if g is None else g, h if u is None else u, offsets, token,
        n_slots, latent, hidden, x.stride(0), h.stride(0),
        N_EXPERTS=n_experts, E_POW2=triton.next_power_of_2(n_experts), STORE_GU=g is not None,
        PRECISION=precision, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **extra,
    )


@triton.jit
def _glu_up_tma_kernel(
    x_ptr, w1_desc, w3_desc, h_ptr, g_ptr, u_ptr, offsets_ptr, token_ptr, n_rows, L, F, stride_xt, stride_s,
    N_EXPERTS: tl.constexpr, E_POW2: tl.constexpr, STORE_GU: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """`triton_moe.glu_up_kernel` with w1 and w3 tiles loaded through TMA descriptors (x rows gathered by pointers:
    TMA on this GPU has no row gather). x's rows have unit stride along L."""
    expert, row_start, row_end, local, row_mask, cols, col_mask = _slot_tile(
        tl.program_id(0), offsets_ptr, n_rows, F, N_EXPERTS, E_POW2, BLOCK_M, BLOCK_N
    )
    if (expert < 0) | (row_start >= row_end):
        return  # the tail, or a tile past the last group's: nothing to read or write
    tokens = tl.load(token_ptr + row_start + local, mask=row_mask, other=0)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt
    col0 = (tl.program_id(0) % tl.cdiv(F, BLOCK_N)) * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < L)[None, :], other=0.0)
        acc_g = tl.dot(a, w1_desc.load([expert, k0, col0]).reshape(BLOCK_K, BLOCK_N), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, w3_desc.load([expert, k0, col0]).reshape(BLOCK_K, BLOCK_N), acc_u, input_precision=PRECISION)
    glu_store(acc_g, acc_u, h_ptr, g_ptr, u_ptr, row_start, local, row_mask, cols, col_mask, stride_s, STORE_GU)
