"""Triton kernel: cross-entropy of a chunk of logit rows, and its gradient in place.

Legend: C rows in the chunk, V vocabulary.

A program owns one row at a time. The first pass over the row keeps an online
max / sum-of-exponentials in float32 (one exponential per logit), which gives
the row's log-sum-exp; the loss is `lse - logit[target]`. When the gradient is
wanted, a second pass overwrites the logits with `softmax - onehot(target)`
(zero for ignored rows), so the caller can feed the same buffer to the two
gradient matmuls with no extra memory.

The kernel is memory-bound: two reads and one write of the chunk, at about
4 TB/s on an H200 with one program per row (`RowsLaunch()`). The default launch
(`LAUNCH`) instead runs one program per SM that loops over the rows, and walks
the second pass backwards: the part of a row the first pass read last is then
the part most likely still in L2 (a forward second pass starts with the part
read longest ago, which a cache holding less than the rows in flight has
dropped). benchmarks/fused_ce.py --rows-launch times each launch on one chunk.
"""

from typing import NamedTuple

import torch

import triton
import triton.language as tl


class RowsLaunch(NamedTuple):
    """How `ce_rows` launches its kernel.

    block: logits per step of a pass; warps: per program; programs_per_sm: 0 for one
    program per row, else this many programs per SM, each looping over the rows; reverse:
    the second pass walks the row from its end; prefetch: each pass loads its next step
    before it reduces the current one (two steps in flight per program); l2_hints: the
    first pass's loads ask L2 to keep their lines, the second pass's loads and stores to
    drop theirs first.
    """

    block: int = 4096
    warps: int = 8
    programs_per_sm: int = 0
    reverse: bool = False
    prefetch: bool = False
    l2_hints: bool = False


# NOTE: one program of 32 warps per SM, 32,768 logits per step, the second
# pass backwards with two steps in flight and the L2 hints: 1.167-1.173 against
# 1.357-1.371 ms for session 44's launch (two programs of 16 warps per SM,
# 16,384 logits per step) and 1.492 for one program per row, on a 4,096-row
# chunk of V 163,840 on an H100, the fastest of 28 launches in two calls; -0.3
# to -1.3 ms per k3-mini update against session 44's launch, and session 44's
# -0.8 to -1.0 against one program per row (benchmarks/results/fused_ce.md,
# train_throughput.md, sessions 44-45).
LAUNCH = RowsLaunch(block=32768, warps=32, programs_per_sm=1, reverse=True, prefetch=True, l2_hints=True)


@triton.jit
def row_step(row_ptr, t, n_cols, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Columns and float32 values of step t of a row (-inf outside it: t may be one step past either end)."""
    cols = t * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(row_ptr + cols, mask=(cols >= 0) & (cols < n_cols), other=float("-inf"), eviction_policy=EVICT)
    return cols, x.to(tl.float32)


@triton.jit
def row_target(row_ptr, targets_ptr, row, n_cols, ignore_index):
    """The row's target: (valid, in_range, safe_target, the target's float32 logit).

    NOTE: an ignored row may carry any target value; read column 0 instead. A target out of range (possible only
    when the caller skipped the host check) makes the row's loss NaN (`in_range` false): loud at the step's
    finiteness check, never a read outside the row.
    """
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_cols)
    safe_target = tl.where(valid & in_range, target, 0)
    return valid, in_range, safe_target, tl.load(row_ptr + safe_target).to(tl.float32)


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    loss_ptr,
    lse_ptr,
    n_rows,
    n_cols,
    ignore_index,
    WRITE_GRAD: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    PREFETCH: tl.constexpr,
    KEEP: tl.constexpr,
    DROP: tl.constexpr,
):
    n_tiles = tl.cdiv(n_cols, BLOCK)
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        # NOTE: 64-bit row offsets: a chunk of 16K rows x 163,840 logits passes 2**31.
        row_ptr = logits_ptr + row * tl.cast(stride_row, tl.int64)

        m = float("-inf")
        s = 0.0
        if PREFETCH:
            cols, x_next = row_step(row_ptr, 0, n_cols, BLOCK, KEEP)
        for t in range(0, n_tiles):
            if PREFETCH:
                x = x_next
                cols, x_next = row_step(row_ptr, t + 1, n_cols, BLOCK, KEEP)
            else:
                cols, x = row_step(row_ptr, t, n_cols, BLOCK, KEEP)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)
        if STORE_LSE:
            tl.store(lse_ptr + row, lse)

        valid, in_range, safe_target, target_logit = row_target(row_ptr, targets_ptr, row, n_cols, ignore_index)
        row_loss = tl.where(in_range, lse - target_logit, float("nan"))
        tl.store(loss_ptr + row, tl.where(valid, row_loss, 0.0))

        if WRITE_GRAD:
            # NOTE: every warp has read the target's logit before any warp overwrites the row. Without the
            # barrier a warp that ran ahead could store the gradient over that logit before the warp that
            # computes the loss loaded it, and the row's loss (never its gradient) came out wrong at random:
            # on an H100 two trainers of one process reported losses up to 4e-4 apart with bit-equal grad
            # norms until this barrier (benchmarks/results/fused_ce.md, session 44).
            tl.debug_barrier()
            row_scale = tl.where(valid, 1.0, 0.0)
            # NOTE: backwards, step -1 is the one past the end: masked like n_tiles forwards.
            first = n_tiles - 1 if REVERSE else 0
            step = -1 if REVERSE else 1
            if PREFETCH:
                cols_next, x_next = row_step(row_ptr, first, n_cols, BLOCK, DROP)
            for i in range(0, n_tiles):
                if PREFETCH:
                    cols, x = cols_next, x_next
                    cols_next, x_next = row_step(row_ptr, first + (i + 1) * step, n_cols, BLOCK, DROP)
                else:
                    cols, x = row_step(row_ptr, first + i * step, n_cols, BLOCK, DROP)
                p = tl.exp(x - lse)
                p = tl.where(cols == safe_target, p - 1.0, p) * row_scale
                tl.store(row_ptr + cols, p.to(row_ptr.dtype.element_ty), mask=(cols >= 0) & (cols < n_cols),
                         eviction_policy=DROP)


def row_programs(n_rows: int, device: torch.device, programs_per_sm: int) -> int:
    """Programs of a launch over n_rows rows: one per row (programs_per_sm = 0), else that many per SM."""
    if not programs_per_sm:
        return n_rows
    # NOTE: Triton's CPU interpreter has no SMs; two "SMs" there still run the loop over rows.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return min(n_rows, programs_per_sm * sms)


def ce_rows(logits_CV, targets_C, loss_C, ignore_index: int, write_grad: bool, lse_C=None,
            launch: RowsLaunch | None = None) -> None:
    """Per-row loss of `logits_CV` into `loss_C`; if `write_grad`, logits become dloss/dlogits.

    logits_CV [C, V] (rows contiguous, float32/bf16/fp16), targets_C [C] int64
    contiguous, loss_C [C] float32 contiguous (written); lse_C [C] float32
    contiguous, if given, receives each row's log-sum-exp (for a gradient pass
    of its own, `kernels.fused_ce.grad_fp8`). launch: the module's LAUNCH if None.
    """
    assert logits_CV.stride(1) == 1 and targets_C.is_contiguous() and loss_C.is_contiguous()
    assert lse_C is None or (lse_C.is_contiguous() and lse_C.dtype == torch.float32)
    launch = LAUNCH if launch is None else launch
    n_rows, n_cols = logits_CV.shape
    if n_rows == 0:
        return
    _ce_rows_kernel[(row_programs(n_rows, logits_CV.device, launch.programs_per_sm),)](
        logits_CV,
        logits_CV.stride(0),
        targets_C,
        loss_C,
        loss_C if lse_C is None else lse_C,
        n_rows,
        n_cols,
        ignore_index,
        WRITE_GRAD=write_grad,
        STORE_LSE=lse_C is not None,
        BLOCK=launch.block,
        REVERSE=launch.reverse,
        PREFETCH=launch.prefetch,
        KEEP="evict_last" if launch.l2_hints else "",
        DROP="evict_first" if launch.l2_hints else "",
        num_warps=launch.warps,
    )
