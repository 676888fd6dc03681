"""The fused loss's two gradient products in FP8: dH = G W and dW = G^T h, with G = softmax - onehot.

Legend: C rows in one chunk (C16: rounded up to a multiple of 16), V vocabulary, D model width.

Of the fused head + loss's three products (each N x V x D), the forward's logits stay in h's dtype: a logit's
error moves the loss itself. The two backward products take their operands in FP8 through cuBLAS's scaled
matmul (`torch._scaled_mm`), about twice the bf16 rate on an H200 (benchmarks/results/fp8.md):
  G   e5m2, one fixed scale: every entry of softmax - onehot lies in [-1, 1], so 2**15 maps the largest
      possible entry under e5m2's largest value (57,344) with no amax pass, and e5m2's range keeps
      probabilities down to ~1e-9 (e4m3 would flush every probability under ~4e-6 to zero, which is most of
      a 163,840-wide row).
  W, h  e4m3, one scale per column (per d, along the contraction), from each column's largest magnitude.
cuBLAS's FP8 products read both operands contraction-contiguous, so G is written twice (`softmax_grad`):
[C16, V] for dH, and transposed, [V, C16], for dW; W and h are written transposed ([D, V], [D, C16]). cuBLAS
also wants every dimension a multiple of 16: chunks are padded with zero rows.
"""

import torch
import triton
import triton.language as tl

G_DTYPE = torch.float8_e5m2
OPERAND_DTYPE = torch.float8_e4m3fn
G_SCALE = 2.0**15
ALIGN = 16  # cuBLAS's FP8 products: every dimension a multiple of 16

# NOTE: tile shapes from one H200 sweep at a 4,096-row chunk (session 26): the gradient pass 32 x 128 with 4 warps
# (0.53 ms), the transpose 64 x 256 with 8 (0.34 ms).
BLOCK_ROWS, BLOCK_COLS, NUM_WARPS = 32, 128, 4
TRANSPOSE_BLOCK = (64, 256, 8)
CAST_BLOCK_ROWS, CAST_BLOCK_COLS = 128, 64


def fp8_supported(device: torch.device) -> bool:
    """cuBLAS FP8 products exist on CUDA GPUs of compute capability 8.9 and up (torch's CPU build has its own)."""
    if device.type != "cuda":
        return device.type == "cpu"
    return torch.cuda.get_device_capability(device) >= (8, 9)


def padded_rows(rows: int) -> int:
    """Rows rounded up to a multiple of ALIGN (the zero-padded chunk cuBLAS's FP8 products take)."""
    return -(-rows // ALIGN) * ALIGN


@triton.jit
def _softmax_grad_kernel(
    logits_ptr, stride_row, lse_ptr, targets_ptr, g_ptr,
    n_rows, n_rows_padded, n_cols, ignore_index, scale,
    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """One [BLOCK_R, BLOCK_V] tile of scale * (softmax - onehot) into g [n_rows_padded, V]; rows past n_rows
    (padding) and ignored rows are zero."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    real = rows < n_rows
    col_mask = cols < n_cols
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :],
                mask=real[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=real, other=0.0)
    target = tl.load(targets_ptr + rows, mask=real, other=ignore_index)
    keep = tl.where(real & (target != ignore_index), scale, 0.0)
    p = tl.exp(x - lse[:, None])
    p = tl.where(cols[None, :] == target[:, None], p - 1.0, p) * keep[:, None]
    tl.store(g_ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :], p.to(g_ptr.dtype.element_ty),
             mask=(rows < n_rows_padded)[:, None] & col_mask[None, :])


@triton.jit
def _transpose_kernel(src_ptr, stride_row, inv_scale_ptr, dst_ptr, n_rows, n_cols, n_rows_padded,
                      SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """One [BLOCK_R, BLOCK_C] tile of src [R, C] stored transposed into dst [C, R'] (zero past n_rows): the values as
    they are, or (SCALED) times each column's inverse scale and cast to dst's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    src = src_ptr + rows.to(tl.int64)[:, None] * stride_row + cols[None, :]
    x = tl.load(src, mask=(rows < n_rows)[:, None] & col_ok[None, :], other=0.0)
    if SCALED:
        x = x.to(tl.float32) * tl.load(inv_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    tl.store(dst_ptr + cols.to(tl.int64)[:, None] * n_rows_padded + rows[None, :],
             tl.trans(x.to(dst_ptr.dtype.element_ty)), mask=col_ok[:, None] & (rows < n_rows_padded)[None, :])


def softmax_grad(logits_CV: torch.Tensor, lse_C: torch.Tensor, targets_C: torch.Tensor, ignore_index: int,
                 scale: float, g_CV: torch.Tensor, gt_VC: torch.Tensor) -> None:
    """g = scale * (softmax(logits) - onehot(target)) in g's dtype, and its transpose gt; zero for ignored rows.

    logits_CV [C, V] (rows contiguous), lse_C [C] float32 (each row's log-sum-exp, `ce_rows`), targets_C [C] int64;
    g_CV [C16, V] and gt_VC [V, C16] contiguous, C16 >= C: the rows past C are written as zeros (cuBLAS's padding).
    NOTE: two passes, g from the logits and then gt from g: one pass storing both layouts took 1.10-1.13 ms per
    4,096-row chunk at k3-mini's vocabulary on an H200 at every tile shape tried, these two 0.53 + 0.34
    (benchmarks/results/fp8.md, session 26).
    """
    n_rows, n_cols = logits_CV.shape
    padded = g_CV.shape[0]
    assert logits_CV.stride(1) == 1 and g_CV.shape == (padded, n_cols) and gt_VC.shape == (n_cols, padded)
    assert g_CV.is_contiguous() and gt_VC.is_contiguous() and padded >= n_rows
    _softmax_grad_kernel[(triton.cdiv(padded, BLOCK_ROWS), triton.cdiv(n_cols, BLOCK_COLS))](
        logits_CV, logits_CV.stride(0), lse_C, targets_C, g_CV, n_rows, padded, n_cols, ignore_index, scale,
        BLOCK_R=BLOCK_ROWS, BLOCK_V=BLOCK_COLS, num_warps=NUM_WARPS,
    )
    rows, cols, warps = TRANSPOSE_BLOCK
    _transpose_kernel[(triton.cdiv(padded, rows), triton.cdiv(n_cols, cols))](
        g_CV, n_cols, g_CV, gt_VC, padded, n_cols, padded, SCALED=False, BLOCK_R=rows, BLOCK_C=cols, num_warps=warps,
    )


def columns_to_fp8(x_RD: torch.Tensor, rows_padded: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x^T [D, R'] in e4m3, row-major, R' = rows_padded (zero columns past R) or R; scale [1, D] float32): one
    scale per column of x, its largest magnitude over e4m3's largest value, so x ~ (x8^T)^T * scale.
    x_RD: rows contiguous. One reduction and one Triton pass (the torch version in `reference` takes five passes:
    1.36 ms against 0.18 for k3-mini's head on an H200)."""
    rows, dim = x_RD.shape
    assert x_RD.stride(1) == 1
    scale = column_scales(x_RD)
    out = torch.empty(dim, rows_padded or rows, dtype=OPERAND_DTYPE, device=x_RD.device)
    grid = (triton.cdiv(out.shape[1], CAST_BLOCK_ROWS), triton.cdiv(dim, CAST_BLOCK_COLS))
    _transpose_kernel[grid](x_RD, x_RD.stride(0), 1.0 / scale, out, rows, dim, out.shape[1], SCALED=True,
                            BLOCK_R=CAST_BLOCK_ROWS, BLOCK_C=CAST_BLOCK_COLS, num_warps=4)
    return out, scale[None, :]


def column_scales(x_RD: torch.Tensor) -> torch.Tensor:
    """[D] float32: each column's largest magnitude over e4m3's largest value (never zero)."""
    amax = torch.linalg.vector_norm(x_RD, ord=float("inf"), dim=0).float()
    return (amax / torch.finfo(OPERAND_DTYPE).max).clamp(min=torch.finfo(torch.float32).tiny)


def g_scales(rows: int, device: torch.device) -> torch.Tensor:
    """[rows, 1] float32 of 1 / G_SCALE: the dequantisation scale of every row of G (or of G^T)."""
    return torch.full((rows, 1), 1.0 / G_SCALE, dtype=torch.float32, device=device)
