"""Triton kernel: cross-entropy of a chunk of logit rows, and its gradient in place.

Legend: C rows in the chunk, V vocabulary.

Each program walks rows pid, pid + P, pid + 2P, ... (P programs). The first
pass over a row keeps an online max / sum-of-exponentials in float32 (one
exponential per logit), which gives the row's log-sum-exp; the loss is
`lse - logit[target]`. When the gradient is wanted, a second pass overwrites
the logits with `softmax - onehot(target)` (zero for ignored rows), so the
caller can feed the same buffer to the two gradient matmuls with no extra
memory.

The kernel is memory-bound: two reads and one write of the chunk. With few
programs (a few per SM) the rows in flight fit in L2, so the second read of a
row can come from L2 rather than HBM.
"""

import torch

import triton
import triton.language as tl

# NOTE: 4096 logits per step and 8 warps give each thread 16 bf16 values (two
# 16-byte loads) and a long enough loop to hide memory latency; see
# benchmarks/results/fused_ce.md for the sweep.
BLOCK_V = 4096
NUM_WARPS = 8
# NOTE: None launches one program per row; an integer k launches k programs per
# SM, each looping over rows (see the module docstring).
PROGRAMS_PER_SM: int | None = None


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    loss_ptr,
    n_rows,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    # NOTE: 64-bit row offsets: a chunk of 16K rows x 163,840 logits passes 2**31.
    stride_row = tl.cast(stride_row, tl.int64)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row_ptr = logits_ptr + row * stride_row
        _ce_one_row(row_ptr, targets_ptr + row, loss_ptr + row, offs, n_cols, ignore_index, WRITE_GRAD, BLOCK)


@triton.jit
def _ce_one_row(
    row_ptr,
    target_ptr,
    loss_ptr,
    offs,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    m = float("-inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + offs
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)

    target = tl.load(target_ptr)
    valid = target != ignore_index
    # NOTE: an ignored row may carry any target value; read column 0 instead.
    safe_target = tl.where(valid, target, 0)
    target_logit = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr, tl.where(valid, lse - target_logit, 0.0))

    if WRITE_GRAD:
        row_scale = tl.where(valid, 1.0, 0.0)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == safe_target, p - 1.0, p) * row_scale
            tl.store(row_ptr + cols, p.to(row_ptr.dtype.element_ty), mask=mask)


def ce_rows(logits_CV, targets_C, loss_C, ignore_index: int, write_grad: bool) -> None:
    """Per-row loss of `logits_CV` into `loss_C`; if `write_grad`, logits become dloss/dlogits.

    logits_CV [C, V] (rows contiguous, float32/bf16/fp16), targets_C [C] int64
    contiguous, loss_C [C] float32 contiguous (written).
    """
    assert logits_CV.stride(1) == 1 and targets_C.is_contiguous() and loss_C.is_contiguous()
    n_rows, n_cols = logits_CV.shape
    if n_rows == 0:
        return
    n_programs = n_rows
    if PROGRAMS_PER_SM is not None:
        # NOTE: on CPU (Triton's interpreter) count one SM, so tests exercise the row loop.
        sms = torch.cuda.get_device_properties(logits_CV.device).multi_processor_count if logits_CV.is_cuda else 1
        n_programs = min(n_rows, sms * PROGRAMS_PER_SM)
    _ce_rows_kernel[(n_programs,)](
        logits_CV,
        logits_CV.stride(0),
        targets_C,
        loss_C,
        n_rows,
        n_cols,
        ignore_index,
        WRITE_GRAD=write_grad,
        BLOCK=BLOCK_V,
        num_warps=NUM_WARPS,
    )
