"""The router's scores x W^T as a float32 product on the tensor cores: the Triton kernel of `ops.router_scores`.

Legend: T tokens (rows), D model width (the reduction), E experts (columns).

docs/k3.md §2.3 asks for the router's scores in float32. cuBLAS's float32 product runs on the CUDA cores (~27
TFLOP/s on an H100, ~0.17-0.22 ms per k3-mini layer: benchmarks/results/router_logits.md). Under bf16 compute
the tokens x are bf16 already, and the float32 master weight w splits exactly into three bf16 pieces,
w = w0 + w1 + w2 (w0 = bf16(w); each rounding leaves a residual with at most 16, then 8, significant bits, which
the next piece holds whole; bf16 has float32's exponent range). Each product of bf16 values is exact in float32
(8 x 8 significant bits), so three tensor-core products summed in float32 accumulators give the float32 product
x w^T, up to the accumulators' rounding. Each step over D keeps its three products in an accumulator of its own,
added to the total in float32 after: 4.0e-7 against the float64 product at k3-mini's router, where cuBLAS's float32
kernel errs 2.4e-6 and one accumulator over all of D erred 5.4e-6. The pieces are cut from each float32 weight
tile in registers, so the kernel reads w as it is and no piece is ever stored (`reference.weight_pieces` is the same
split in torch).

NOTE: a weight in x's dtype (FSDP2's bf16 gather) needs one piece. The kernel also takes float32 x as one float32
product at float32's precision ("ieee", not tf32), slower than cuBLAS's: `ops.router_scores` hands float32 x to
torch instead.
"""

import torch
import triton
import triton.language as tl

# Launch settings, fixed (no autotune pause): 128 tokens x 64 experts per program (k3-mini's 176 experts in three
# column tiles), 64-wide steps over D: 0.061 ms per k3-mini layer on an H100; `benchmarks/router_logits.py --sweep`
# timed others within 5 us of it, or slower (benchmarks/results/router_logits.md).
LAUNCH = dict(block_t=128, block_e=64, block_d=64, num_warps=4, num_stages=3)


@triton.jit
def _router_scores_kernel(x_ptr, w_ptr, out_ptr, n_rows, n_cols, width, stride_x, stride_w, stride_out,
                          PIECES: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr):
    """out [T, E] float32 = x [T, D] @ w [E, D]^T, w read in PIECES pieces of x's dtype (1 or 3)."""
    # NOTE: the column tile varies fastest: the programs of one row tile run together and read x's tile from L2.
    pid_e = tl.program_id(0)
    pid_t = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for d0 in range(0, width, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < width
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + ds[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # w^T's tile [BLOCK_D, BLOCK_E]: w is [E, D] row-major.
        w = tl.load(w_ptr + cols[None, :] * stride_w + ds[:, None], mask=d_ok[:, None] & col_ok[None, :], other=0.0)
        hi = w.to(x.dtype)
        if PIECES == 3:
            rest = w - hi.to(tl.float32)
            mid = rest.to(x.dtype)
            lo = (rest - mid.to(tl.float32)).to(x.dtype)
            # NOTE: each step's three products in an accumulator of their own, smallest piece first, then added to
            # the total in float32: the tensor cores' accumulation then runs over 3 x BLOCK_D terms, not all of D.
            part = tl.dot(x, lo, input_precision=PRECISION)
            part = tl.dot(x, mid, part, input_precision=PRECISION)
            acc += tl.dot(x, hi, part, input_precision=PRECISION)
        else:
            acc = tl.dot(x, hi, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def pieces_for(x_dtype: torch.dtype, w_dtype: torch.dtype) -> int:
    """How many pieces of x's dtype hold w exactly: 1 when w is in x's dtype, 3 for a float32 w under bf16 / fp16."""
    return 1 if w_dtype == x_dtype else 3


def scores_forward(x_TD: torch.Tensor, w_ED: torch.Tensor, launch: dict | None = None) -> torch.Tensor:
    """float32 [T, E] = x [T, D] @ w [E, D]^T; x with unit column stride, w contiguous (`ops.router_scores`)."""
    n_rows, width = x_TD.shape
    n_cols = w_ED.shape[0]
    out = torch.empty(n_rows, n_cols, device=x_TD.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    opts = {**LAUNCH, **(launch or {})}
    grid = (triton.cdiv(n_cols, opts["block_e"]), triton.cdiv(n_rows, opts["block_t"]))
    _router_scores_kernel[grid](
        x_TD, w_ED, out, n_rows, n_cols, width, x_TD.stride(0), w_ED.stride(0), out.stride(0),
        PIECES=pieces_for(x_TD.dtype, w_ED.dtype), PRECISION="ieee" if x_TD.dtype == torch.float32 else "tf32",
        BLOCK_T=opts["block_t"], BLOCK_E=opts["block_e"], BLOCK_D=opts["block_d"],
        num_warps=opts["num_warps"], num_stages=opts["num_stages"],
    )
    return out
