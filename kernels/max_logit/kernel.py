"""Triton kernel of the per-head max logit: one pass over the allowed key blocks, no score tensor.

Legend: B batch, H heads, T tokens, E query/key width; BQ / BK the queries / keys of one
tile; EA + EB the two slices of E that each tile's product runs over.

A program owns BQ queries of one (b, h). Its queries' documents start at or after
doc_lo = min(i - pos[i]) and at or before doc_hi = max(i - pos[i]), so it walks the key
blocks from the one holding doc_lo up to the diagonal and never touches a block before
doc_lo (the speed-up of packed documents). Blocks starting at or after doc_hi and ending
at or before the first query are allowed for every query and skip the mask: the walk is
masked blocks, then unmasked ones, then masked ones again up to the diagonal. Each
program keeps an elementwise running max [BQ, BK] (one op per score), reduces it once,
and writes its scaled maximum to partials [B * H, nQB]; `ops.py` takes their max per head.

NOTE: scale > 0 is applied to the maximum, not to each score: rounding is monotone, so
max(round(s * scale)) = round(max(s) * scale) and the result is the reference's exactly
for the same products.
NOTE: E is cut into a power of two EA and a power-of-two rest EB (MLA's 192 = 128 + 64)
so the products waste no work on padding, where one tile of next_pow2(E) = 256 would.
"""

import torch
import triton
import triton.language as tl

MAX_WIDTH = 256

# Launch settings, fixed per architecture (no autotune pause), looked up by the CUDA compute
# capability's major number; "default" serves the others and Triton's CPU interpreter.
# NOTE: `benchmarks/max_logit.py --sweep` on an H200 (triton 3.6, B8 T4096 H4 E192 bf16), causal / documents
# of ~1000 tokens: 128x64, 8 warps, 3 stages 0.217 / 0.121 ms; 64x64, 4 warps 0.225 / 0.110; 256x64, 8 warps
# 0.211 / 0.133; 128x128, 8 warps 0.219 / 0.131; 2 stages 0.313 / 0.144 (the chunked einsum: 8.4 / 8.9 ms).
LAUNCH = {
    9: dict(BQ=128, BK=64, num_warps=8, num_stages=3),
    "default": dict(BQ=128, BK=64, num_warps=8, num_stages=3),
}


def launch_settings(device: torch.device) -> dict:
    """The LAUNCH entry of `device`'s architecture (by CUDA major version), else "default"."""
    if device.type == "cuda":
        major = torch.cuda.get_device_capability(device)[0]
        if major in LAUNCH:
            return LAUNCH[major]
    return LAUNCH["default"]


def width_slices(E: int) -> tuple[int, int]:
    """(EA, EB): EA the largest power of two <= E (at least 16), EB the rest up to a power of two (0 if none)."""
    ea = max(16, 1 << (E.bit_length() - 1))
    rest = E - ea
    return ea, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 products (not TF32); bf16/fp16 operands are multiplied in their own type."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _key_block_max(
    best, q_a, q_b, k_base, start, rows, first, T, stride_kt, stride_ke,
    E: tl.constexpr, EA: tl.constexpr, EB: tl.constexpr, BK: tl.constexpr,
    MASKED: tl.constexpr, HAS_POS: tl.constexpr, PREC: tl.constexpr,
):
    """best [BQ, BK] with the scores of keys start .. start + BK - 1 folded in (masked ones as -inf if MASKED)."""
    cols = start + tl.arange(0, BK)
    col_offs = cols.to(tl.int64) * stride_kt
    col_ok = cols < T
    e_a = tl.arange(0, EA)
    k_mask = (e_a < E)[:, None]
    if MASKED:
        k_mask = k_mask & col_ok[None, :]
    k_a = tl.load(k_base + e_a[:, None] * stride_ke + col_offs[None, :], mask=k_mask, other=0.0)
    s = tl.dot(q_a, k_a, input_precision=PREC)
    if EB > 0:
        e_b = EA + tl.arange(0, EB)
        k_mask = (e_b < E)[:, None]
        if MASKED:
            k_mask = k_mask & col_ok[None, :]
        k_b = tl.load(k_base + e_b[:, None] * stride_ke + col_offs[None, :], mask=k_mask, other=0.0)
        s = tl.dot(q_b, k_b, s, input_precision=PREC)
    if MASKED:
        allowed = cols[None, :] <= rows[:, None]
        if HAS_POS:
            allowed = allowed & (cols[None, :] >= first[:, None])
        s = tl.where(allowed, s, float("-inf"))
    return tl.maximum(best, s)


@triton.jit
def max_logit_kernel(
    q_ptr, k_ptr, pos_ptr, part_ptr, T, scale,
    stride_qb, stride_qh, stride_qt, stride_qe,
    stride_kb, stride_kh, stride_kt, stride_ke,
    stride_pb, stride_pt,
    H: tl.constexpr, E: tl.constexpr, EA: tl.constexpr, EB: tl.constexpr,
    BQ: tl.constexpr, BK: tl.constexpr, HAS_POS: tl.constexpr, PREC: tl.constexpr,
):
    bh = tl.program_id(0)
    n_qb = tl.num_programs(1)
    # NOTE: the last query blocks walk the most keys; they are launched first, so the grid's tail is short.
    qb = n_qb - 1 - tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    q_lo = qb * BQ
    rows = q_lo + tl.arange(0, BQ)
    row_ok = rows < T
    q_base = q_ptr + b * stride_qb + h * stride_qh
    k_base = k_ptr + b * stride_kb + h * stride_kh
    row_offs = rows.to(tl.int64) * stride_qt

    e_a = tl.arange(0, EA)
    q_a = tl.load(q_base + row_offs[:, None] + e_a[None, :] * stride_qe,
                  mask=row_ok[:, None] & (e_a < E)[None, :], other=0.0)
    q_b = q_a
    if EB > 0:
        e_b = EA + tl.arange(0, EB)
        q_b = tl.load(q_base + row_offs[:, None] + e_b[None, :] * stride_qe,
                      mask=row_ok[:, None] & (e_b < E)[None, :], other=0.0)

    if HAS_POS:
        pos = tl.load(pos_ptr + b * stride_pb + rows.to(tl.int64) * stride_pt, mask=row_ok, other=0)
        # NOTE: clamped at 0, so a position past the row start reads no key before it (as in the reference).
        first = tl.maximum(rows - pos.to(tl.int32), 0)
        doc_lo = tl.min(tl.where(row_ok, first, T), axis=0)
        doc_hi = tl.max(tl.where(row_ok, first, 0), axis=0)
    else:
        first = rows
        doc_lo = 0
        doc_hi = 0
    q_end = tl.minimum(q_lo + BQ, T)
    k_begin = (doc_lo // BK) * BK
    # Unmasked blocks [mid_lo, mid_hi): start at or after every document start, end at or before the first query.
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(doc_hi, BK) * BK, k_begin), q_end)
    mid_hi = tl.maximum(mid_lo, ((q_lo + 1) // BK) * BK)

    best = tl.full([BQ, BK], float("-inf"), tl.float32)
    for start in range(k_begin, mid_lo, BK):
        best = _key_block_max(best, q_a, q_b, k_base, start, rows, first, T, stride_kt, stride_ke,
                              E, EA, EB, BK, True, HAS_POS, PREC)
    for start in range(mid_lo, mid_hi, BK):
        best = _key_block_max(best, q_a, q_b, k_base, start, rows, first, T, stride_kt, stride_ke,
                              E, EA, EB, BK, False, HAS_POS, PREC)
    for start in range(mid_hi, q_end, BK):
        best = _key_block_max(best, q_a, q_b, k_base, start, rows, first, T, stride_kt, stride_ke,
                              E, EA, EB, BK, True, HAS_POS, PREC)
    row_max = tl.where(row_ok, tl.max(best, axis=1), float("-inf"))
    tl.store(part_ptr + bh * n_qb + qb, tl.max(row_max, axis=0) * scale)


def max_logit_forward(q: torch.Tensor, k: torch.Tensor, scale: float, pos: torch.Tensor | None) -> torch.Tensor:
    """q, k [B, H, T, E] of any strides, one dtype; pos int [B, T] or None; scale > 0 -> float32 [H]."""
    B, H, T, E = q.shape
    if B * T == 0:
        return torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    opts = launch_settings(q.device)
    bq, bk = opts["BQ"], opts["BK"]
    ea, eb = width_slices(E)
    n_qb = triton.cdiv(T, bq)
    part = torch.empty(B * H, n_qb, dtype=torch.float32, device=q.device)
    pos_arg, pos_strides = (pos, pos.stride()) if pos is not None else (part, (0, 0))
    max_logit_kernel[(B * H, n_qb)](
        q, k, pos_arg, part, T, scale, *q.stride(), *k.stride(), *pos_strides,
        H=H, E=E, EA=ea, EB=eb, BQ=bq, BK=bk, HAS_POS=pos is not None, PREC=dot_precision(q.dtype),
        num_warps=opts["num_warps"], num_stages=opts["num_stages"],
    )
    return part.view(B, H, n_qb).amax(dim=(0, 2))
