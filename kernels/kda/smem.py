"""Shared memory of each KDA kernel, computed from the tiles it holds, against the H200's per-block limit.

Triton stages every tensor-core operand in shared memory, and a loop software-pipelined over S stages
keeps S - 1 more copies of every tile it loads (the next iterations' loads in flight). The need of a
kernel is bounded by

    sum over its dot operands (each distinct tile once) + (S - 1) * sum over the tiles loaded in its loop
    + the scratch of its largest reduction or scan (float32)

which ignores that Triton reuses a buffer once its value is dead (but for the fused backward's two phases),
so it over-counts: a launch that fits this bound fits the GPU. tests/gpu/test_kda_fla_gpu.py checks the bound
against Triton's own allocation (`CompiledKernel.metadata.shared`) for every kernel the GPU compiled;
tests/kernels/test_kda_smem.py against the numbers an H200 gave.

Legend: BT chunk (64), BC sub-block (16), BK / BV tile widths, KF all of K (a power of two), e the
input dtype's bytes (q, k, v and the tiles derived from them), f 4 (float32 buffers: b, M, A, Ai, dM, dA).
"""

import torch
import triton

from kernels.kda.common import BC, BT

# The largest dynamic shared memory one block may use on an H200 (sm_90): 227 KiB.
SHARED_LIMIT = 232_448
F32 = 4


def tile(rows: int, cols: int, nbytes: int) -> int:
    return rows * cols * nbytes


def shared_bytes(kernel: str, K: int, V: int, dtype: torch.dtype, opts: dict) -> int:
    """The bound above for `kernel` (a key of ops.LAUNCH) with its launch settings `opts` (BK, BV, num_stages)."""
    e = dtype.itemsize
    f = F32
    S = opts["num_stages"]
    BK = opts.get("BK", 0)
    BV = opts.get("BV", 0)
    KF = max(16, triton.next_power_of_2(K))
    # The decayed-product gradients (dintra, dfused's own) multiply float32 tiles in three TF32 passes for
    # bfloat16 / float16 calls (bwd.intra_dot), holding each operand as a high and a low part (TF32 or bfloat16).
    split = 1 if dtype == torch.float32 else 2
    if kernel in ("decay", "ddecay"):
        # no dot; the chunk's cumulative sum (forward or reverse) over a [BT, BK] float32 tile
        return tile(BT, BK, f)
    if kernel == "scores":
        operands = 2 * tile(BC, BK, f) + tile(BK, BT, f)  # decayed q and k rows, decayed keys (transposed)
        loads = tile(BC, BK, f + 2 * e) + tile(BT, BK, f + e)  # b, q, k of the block; b, k of the chunk
        return operands + (S - 1) * loads
    if kernel == "solve":
        # every float32 16x16 tile of the block substitution: 4 inverted diagonal blocks, 6 blocks of
        # diag(beta) A below them, 6 results; no loop
        return 16 * tile(BC, BC, f)
    if kernel == "wy":
        operands = tile(BT, BT, e) + tile(BT, BV, e) + tile(BT, BK, e)  # Ai, beta v, beta exp(b) k
        loads = tile(BT, BV, e) + tile(BT, BK, e + f)  # v; k and b
        return operands + (S - 1) * loads
    if kernel == "state":
        operands = tile(BT, KF, e) + tile(KF, BV, e) + tile(KF, BT, e) + tile(BT, BV, e)  # Wk, h, Kd^T, U
        loads = tile(BT, KF, 2 * e + f) + tile(BT, BV, e) + KF * f  # Wk, k, b; Wv; b at the last row
        return operands + (S - 1) * loads
    if kernel == "output":
        operands = tile(BT, BK, e) + tile(BK, BV, e) + tile(BT, BT, e) + tile(BT, BV, e)  # Qd, h, M, U
        loads = tile(BT, BK, e + f) + tile(BK, BV, e)  # q, b; h
        return operands + (S - 1) * loads
    if kernel == "dstate":
        # M^T, dO, Kd, dh, Qd^T, Wk^T, dU
        operands = tile(BT, BT, e) + 2 * tile(BT, BV, e) + 3 * tile(BT, KF, e) + tile(KF, BV, e)
        loads = tile(BT, KF, 3 * e + f) + tile(BT, BT, f) + tile(BT, BV, e) + KF * f  # k, q, Wk, b; M; dO; b_last
        return operands + (S - 1) * loads
    if kernel in ("dchunk", "dfused"):
        # V loop: dO, U, dU, dR [BT, BV]; h, dh [BK, BV]; Ai [BT, BT]; reductions over [BK, BV] and [BT, BV]
        operands = 4 * tile(BT, BV, e) + 2 * tile(BK, BV, e) + tile(BT, BT, e)
        loads = 4 * tile(BT, BV, e) + 2 * tile(BK, BV, e)  # h, dh, dO, U, dU, v
        scratch = tile(BT, max(BK, BT), f)  # the column sums over the chunk after the loop ([BT, BK] and [BT, BT])
        need = operands + (S - 1) * loads
        if kernel == "dfused":
            # after the V loop, whose buffers are dead by then: per 16-row block, dM, dA rows and columns
            # [BC, BT] and the chunk's decayed q, k [BT, BK]
            need = max(need, split * (4 * tile(BC, BT, f) + 3 * tile(BT, BK, f)))
        return need + scratch
    if kernel == "dintra":
        # rows and columns of dM, dA [BC, BT]; decayed k (rows), q and k (columns) of the chunk [BT, BK]
        operands = split * (4 * tile(BC, BT, f) + 3 * tile(BT, BK, f))
        loads = tile(BC, BK, 2 * e + f) + tile(BT, BK, 2 * e + f)
        return operands + (S - 1) * loads
    raise KeyError(f"no shared-memory bound for KDA kernel {kernel!r}")
