"""Triton kernel: cross-entropy of a chunk of logit rows, and its gradient in place.

Legend: C rows in the chunk, V vocabulary.

One program owns one row. The first pass over the row keeps an online
max / sum-of-exponentials in float32 (one exponential per logit), which gives
the row's log-sum-exp; the loss is `lse - logit[target]`. When the gradient is
wanted, a second pass overwrites the logits with `softmax - onehot(target)`
(zero for ignored rows), so the caller can feed the same buffer to the two
gradient matmuls with no extra memory.

The kernel is memory-bound: two reads and one write of the chunk, at about
4 TB/s on an H200. Fewer programs looping over rows, so that the rows in
flight would fit in L2 for the second read, measured slower (1.1-3.0 ms
against 1.0 ms for a 4096-row chunk): the lost parallelism costs more than L2
saves.
"""

import torch

import triton
import triton.language as tl

# NOTE: 4096 logits per step and 8 warps give each thread 16 bf16 values (two
# 16-byte loads); blocks of 2048-16384 with 4-16 warps all ran within 10% of
# this on an H200 (benchmarks/results/fused_ce.md).
BLOCK_V = 4096
NUM_WARPS = 8


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    loss_ptr,
    lse_ptr,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    # NOTE: 64-bit row offsets: a chunk of 16K rows x 163,840 logits passes 2**31.
    row_ptr = logits_ptr + row * tl.cast(stride_row, tl.int64)
    offs = tl.arange(0, BLOCK)

    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    if STORE_LSE:
        tl.store(lse_ptr + row, lse)

    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    # NOTE: an ignored row may carry any target value; read column 0 instead. A target out of
    # range (possible only when the caller skipped the host check) makes the row's loss NaN:
    # loud at the step's finiteness check, never a read outside the row.
    safe_target = tl.where(valid & in_range, target, 0)
    target_logit = tl.load(row_ptr + safe_target).to(tl.float32)
    row_loss = tl.where(in_range, lse - target_logit, float("nan"))
    tl.store(loss_ptr + row, tl.where(valid, row_loss, 0.0))

    if WRITE_GRAD:
        row_scale = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == safe_target, p - 1.0, p) * row_scale
            tl.store(row_ptr + cols, p.to(row_ptr.dtype.element_ty), mask=mask)


def ce_rows(logits_CV, targets_C, loss_C, ignore_index: int, write_grad: bool, lse_C=None) -> None:
    """Per-row loss of `logits_CV` into `loss_C`; if `write_grad`, logits become dloss/dlogits.

    logits_CV [C, V] (rows contiguous, float32/bf16/fp16), targets_C [C] int64
    contiguous, loss_C [C] float32 contiguous (written); lse_C [C] float32
    contiguous, if given, receives each row's log-sum-exp (for a gradient pass
    of its own, `kernels.fused_ce.grad_fp8`).
    """
    assert logits_CV.stride(1) == 1 and targets_C.is_contiguous() and loss_C.is_contiguous()
    assert lse_C is None or (lse_C.is_contiguous() and lse_C.dtype == torch.float32)
    n_rows, n_cols = logits_CV.shape
    if n_rows == 0:
        return
    _ce_rows_kernel[(n_rows,)](
        logits_CV,
        logits_CV.stride(0),
        targets_C,
        loss_C,
        loss_C if lse_C is None else lse_C,
        n_cols,
        ignore_index,
        WRITE_GRAD=write_grad,
        STORE_LSE=lse_C is not None,
        BLOCK=BLOCK_V,
        num_warps=NUM_WARPS,
    )
