"""The Triton top-k of `ops.top_k_rows`: a block of rows in registers, k rounds of (max, lowest index, mask).

Legend: T tokens (rows), E experts (columns), k selected per row.
"""

import torch
import triton
import triton.language as tl

# Elements of x one program holds (rows x padded columns): 32 rows of k3-mini's 176 experts (padded to 256).
TILE_ELEMENTS = 8192


@triton.jit
def _top_k_kernel(x_ptr, values_ptr, indices_ptr, n_rows, n_cols, stride_x,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """values, indices [T, K] (row-major) of x [T, E] (row stride stride_x, unit column stride)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    out = rows.to(tl.int64) * K
    for j in tl.static_range(K):
        v = tl.max(x, axis=1)
        # NOTE: the lowest column holding the maximum (ties go to the lowest id, as the reference's max does);
        # clamped so that a row no column equals (NaN) still names an expert that exists.
        i = tl.minimum(tl.min(tl.where(x == v[:, None], cols[None, :], BLOCK_E), axis=1), n_cols - 1)
        tl.store(values_ptr + out + j, v.to(values_ptr.dtype.element_ty), mask=row_mask)
        tl.store(indices_ptr + out + j, i.to(tl.int64), mask=row_mask)
        x = tl.where(cols[None, :] == i[:, None], float("-inf"), x)


def top_k_forward(x_TE, k: int):
    """(values [T, k] in x's dtype, indices int64 [T, k]) of x [T, E] with unit column stride."""
    n_rows, n_cols = x_TE.shape
    values = torch.empty(n_rows, k, device=x_TE.device, dtype=x_TE.dtype)
    indices = torch.empty(n_rows, k, device=x_TE.device, dtype=torch.int64)
    if n_rows == 0:
        return values, indices
    block_e = triton.next_power_of_2(n_cols)
    block_t = max(1, min(TILE_ELEMENTS // block_e, triton.next_power_of_2(n_rows)))
    _top_k_kernel[(triton.cdiv(n_rows, block_t),)](
        x_TE, values, indices, n_rows, n_cols, x_TE.stride(0), K=k, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=4,
    )
    return values, indices
