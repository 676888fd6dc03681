"""Triton kernel: cross-entropy of a chunk of logit rows and its gradient in one pass over the logits.

Legend: C rows in the chunk, V vocabulary.

`ce_rows` (ce_rows.py) reads each row twice: once for its log-sum-exp, once to
write `softmax - onehot(target)`. This kernel reads it once. Each row is
written over as E = exp(z - r) for a reference r taken from the row's first
step (the max of its first BLOCK logits), and the row's gradient is
G = c * E' with c = 1 / sum(E) and E' = E except at the target, where E' holds
E[target] - sum(E) (so c * E'[target] = softmax[target] - 1). The caller
applies c, one float32 per row (`scale_C`), to the narrow side of the two
gradient products: dH = diag(c) (E' W) and dW = E'^T (diag(c) h). Ignored
rows get c = 0.

Why r is safe: r is one of the row's own logits, so r <= max(z) and every
E[v] >= exp(z[v] - max(z)), the value an exact softmax would round: nothing
underflows that the two-pass kernel keeps. E stays finite while no logit
exceeds r by more than `RESCALE_AT` (e^32: sum(E) < 163,840 e^32 ~ 1.3e19, far
from float32's and bf16's 3.4e38); a later step whose max does is rare
(a logit 32 above the max of the row's first BLOCK columns), and then the
row's stored steps are multiplied by exp(r - r_new) (read and written once
more) and r moves up: the same numbers up to one more rounding of those steps.

Rows are looped over by a fixed number of programs (`RowsLaunch.programs_per_sm`,
0: one program per row); a launch's `reverse` and `l2_hints` do not apply (there
is no second pass to reverse or to keep lines for).
"""

import torch

import triton
import triton.language as tl

from kernels.fused_ce.ce_rows import RowsLaunch, row_programs, row_step, row_target

# NOTE: one program of 32 warps per SM looping over the rows, 32,768 logits per step, no prefetch: the fastest of
# nine launches on an H100, 1.022 ms per 4,096-row chunk with the two [C, D] row scalings against 1.161 ms for the
# two-pass kernel's launch; with the prefetch at this size 1.24 ms (more values in flight than the registers hold),
# the rest 1.02-1.10 ms (benchmarks/results/fused_ce.md, session 46).
LAUNCH = RowsLaunch(block=32768, warps=32, programs_per_sm=1)
RESCALE_AT = 32.0
"""A step whose max exceeds the row's reference by more than this moves the reference (the module docstring)."""


@triton.jit
def _ce_one_pass_kernel(
    logits_ptr,
    stride_row,
    targets_ptr,
    loss_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    ignore_index,
    RESCALE_AT: tl.constexpr,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    n_tiles = tl.cdiv(n_cols, BLOCK)
    dtype = logits_ptr.dtype.element_ty
    for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
        # NOTE: 64-bit row offsets: a chunk of 16K rows x 163,840 logits passes 2**31.
        row_ptr = logits_ptr + row * tl.cast(stride_row, tl.int64)
        valid, in_range, safe_target, target_logit = row_target(row_ptr, targets_ptr, row, n_cols, ignore_index)
        # NOTE: every warp has read the target's logit before any warp overwrites the row (the race ce_rows had).
        tl.debug_barrier()

        cols, x = row_step(row_ptr, 0, n_cols, BLOCK, "")
        if PREFETCH:
            cols_next, x_next = row_step(row_ptr, 1, n_cols, BLOCK, "")
        ref = tl.max(x, axis=0)
        e = tl.exp(x - ref)
        s = tl.sum(e, axis=0)
        tl.store(row_ptr + cols, e.to(dtype), mask=cols < n_cols)
        for t in range(1, n_tiles):
            if PREFETCH:
                cols, x = cols_next, x_next
                cols_next, x_next = row_step(row_ptr, t + 1, n_cols, BLOCK, "")
            else:
                cols, x = row_step(row_ptr, t, n_cols, BLOCK, "")
            m = tl.max(x, axis=0)
            if m - ref > RESCALE_AT:
                # Rare: bring the steps already stored to the new reference before going on.
                f = tl.exp(ref - m)
                tl.debug_barrier()
                for u in range(0, t):
                    ucols = u * BLOCK + tl.arange(0, BLOCK)
                    umask = ucols < n_cols
                    y = tl.load(row_ptr + ucols, mask=umask, other=0.0).to(tl.float32)
                    tl.store(row_ptr + ucols, (y * f).to(dtype), mask=umask)
                s = s * f
                ref = m
            e = tl.exp(x - ref)
            s += tl.sum(e, axis=0)
            tl.store(row_ptr + cols, e.to(dtype), mask=cols < n_cols)

        row_loss = tl.where(in_range, ref + tl.log(s) - target_logit, float("nan"))
        tl.store(loss_ptr + row, tl.where(valid, row_loss, 0.0))
        tl.store(scale_ptr + row, tl.where(valid, 1.0 / s, 0.0))
        # NOTE: the step holding the target is stored by every warp before its entry is replaced.
        tl.debug_barrier()
        e_target = tl.exp(target_logit - ref)
        tl.store(row_ptr + safe_target, (e_target - s).to(dtype), mask=valid & in_range)


def ce_rows_one_pass(logits_CV, targets_C, loss_C, scale_C, ignore_index: int, launch: RowsLaunch | None = None,
                     rescale_at: float | None = None) -> None:
    """Per-row loss of `logits_CV` into `loss_C`; the logits become E' and `scale_C` c, with dloss/dlogits = c * E'.

    logits_CV [C, V] (rows contiguous, float32/bf16/fp16), targets_C [C] int64 contiguous, loss_C and scale_C [C]
    float32 contiguous (written). launch: the module's LAUNCH if None; rescale_at: RESCALE_AT if None (tests lower it
    to make every row move its reference).
    """
    assert logits_CV.stride(1) == 1 and targets_C.is_contiguous()
    assert loss_C.is_contiguous() and scale_C.is_contiguous() and scale_C.dtype == torch.float32
    launch = LAUNCH if launch is None else launch
    n_rows, n_cols = logits_CV.shape
    if n_rows == 0:
        return
    _ce_one_pass_kernel[(row_programs(n_rows, logits_CV.device, launch.programs_per_sm),)](
        logits_CV, logits_CV.stride(0), targets_C, loss_C, scale_C, n_rows, n_cols, ignore_index,
        RESCALE_AT=RESCALE_AT if rescale_at is None else rescale_at, BLOCK=launch.block, PREFETCH=launch.prefetch,
        num_warps=launch.warps,
    )
