"""Shared pieces of the KDA Triton kernels: chunk bookkeeping and small jit helpers.

Every kernel works on the packed layout: tensors are [1, T_total, H, D] with
`cu_seqlens` [N+1] marking the sequences (a [B, T] batch is B sequences of T).
A "chunk" is 64 consecutive tokens of one sequence; the last chunk of a
sequence may be partial (rows at or past `eos` are masked). A layout padded to a
capacity (`chunk_layout`) adds zero-length sequences at T_total and padding
chunks without rows (t0 == eos == T_total). A per-chunk kernel returns at once
on one (its loads would all be masked but for the state tiles h, dh), except
`bwd._ddecay_kernel`, which writes the zero partial sums that its caller adds up.

Legend: NT total chunks over all sequences, BT chunk size (64), BC sub-block
size (16), BK / BV tile widths over K / V.
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.device import host_to_device
from kernels.kda.reference import check_cu_seqlens_values

BT = 64
BC = 16
# The largest |b_i - b_ref| a split product may meet inside a 16-row block: exp(60) ~ 1.1e26 leaves
# 1e12 of float32's (and bfloat16's) range, 3.4e38, for the products and their sums over K and rows.
SPAN_LIMIT = 60.0


def bounded_gate(lower_bound: float | None) -> bool:
    """Whether a fused safe gate with this lower bound makes every 16-row block fit its middle row.

    With g >= lb on every token, rows i, j of a block and its middle row m (8 rows after its first)
    give b_i - b_m <= 8 |lb| (i before m) and b_m - b_j <= 7 |lb| (j after m), so every factor of
    the split product is at most exp(8 |lb|): within SPAN_LIMIT for lb >= -7.5 (lb = -5: exp(40)).
    The gate's g = lb * sigmoid(.) is >= lb exactly in float32 (sigmoid <= 1, rounding is monotone),
    and b, a chunk-local cumulative sum of at most 64 such terms, carries an error of ~1e-4 at most.
    """
    return lower_bound is not None and -(BC // 2) * lower_bound <= SPAN_LIMIT and lower_bound <= 0.0


def chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, device, capacity: int | None = None) -> tuple:
    """Returns (cu_seqlens int32 [N+1], chunk_indices int32 [NT, 2], chunk_offsets int32 [N+1], N, NT).

    chunk_indices[c] = (sequence, chunk within that sequence); chunk_offsets[n] is the
    first global chunk of sequence n. A plain batch needs no host sync; packed
    documents read their lengths on the host (no wait when cu_seqlens lives there) and
    the layout goes to the GPU as asynchronous pinned copies. Both are built once per
    layout and reused (read-only) by every layer's forward and backward.

    capacity (packed documents only) fixes the shapes, so that one captured CUDA graph serves
    every batch: N = capacity, the real documents followed by zero-length ones at B*T, and
    NT = cdiv(B*T, 64) + capacity, the real chunks followed by padding chunks (chunk 0 of the
    last document: no rows). It needs at least one padding document (N < capacity).
    """
    device = torch.device(device)
    # NOTE: memory of a CUDA graph's pool must not outlive the graph, so nothing is cached while capturing.
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if cu_seqlens is None:
        if capacity is not None:
            raise ValueError(f"chunk_layout: capacity={capacity} pads packed documents, and cu_seqlens is None")
        return (_batch_layout.__wrapped__ if capturing else _batch_layout)(B, T, device)
    ends = tuple(cu_seqlens.tolist())
    if capacity is not None and len(ends) - 1 >= capacity:
        raise ValueError(f"chunk_layout: {len(ends) - 1} documents need capacity > {len(ends) - 1} "
                         f"(one padding document at least), got capacity={capacity}")
    return (_packed_layout.__wrapped__ if capturing else _packed_layout)(ends, B * T, capacity, device)


@functools.lru_cache(maxsize=16)
def _packed_layout(ends: tuple[int, ...], n: int, capacity: int | None, device: torch.device) -> tuple:
    """chunk_layout of packed documents with boundaries `ends` over n tokens, padded to `capacity` documents.

    NOTE: cached because building it (Python over every chunk, three pinned copies) took ~0.3 ms of
    host time per call, and a k3-mini step makes 18 calls with one layout: the host bounds the step
    once the GPU is fast. Sixteen layouts cover the microbatches of any accumulation in flight.
    """
    check_cu_seqlens_values(list(ends), n)
    counts = [triton.cdiv(e - s, BT) for s, e in zip(ends[:-1], ends[1:])]
    pairs = [(i, c) for i, count in enumerate(counts) for c in range(count)]
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    if capacity is not None:
        # Real chunks are at most cdiv(n, 64) + N - 1 (one partial chunk per document at most), so padding chunks remain.
        ends += (n,) * (capacity + 1 - len(ends))
        offsets += [len(pairs)] * (capacity + 1 - len(offsets))
        pairs += [(capacity - 1, 0)] * (triton.cdiv(n, BT) + capacity - len(pairs))
    chunk_indices = torch.tensor(pairs if pairs else [(0, 0)], dtype=torch.int32).reshape(-1, 2)
    return (
        host_to_device(torch.tensor(ends, dtype=torch.int32), device),
        host_to_device(chunk_indices[: len(pairs)], device),
        host_to_device(torch.tensor(offsets, dtype=torch.int32), device),
        len(ends) - 1,
        len(pairs),
    )


@functools.lru_cache(maxsize=64)
def _batch_layout(B: int, T: int, device: torch.device) -> tuple:
    """chunk_layout of B sequences of T tokens, built once per shape and device and reused (read-only).

    NOTE: building it is 9 small launches, paid twice per forward+backward; at k3-mini's shape the
    kernels run ~2 ms, so host work per call is what bounds the step once the GPU is fast.
    """
    nt = triton.cdiv(T, BT)
    cu = torch.arange(B + 1, device=device, dtype=torch.int32) * T
    seq = torch.arange(B, device=device, dtype=torch.int32).repeat_interleave(nt)
    idx = torch.arange(nt, device=device, dtype=torch.int32).repeat(B)
    offsets = torch.arange(B + 1, device=device, dtype=torch.int32) * nt
    return cu, torch.stack([seq, idx], 1).contiguous(), offsets, B, B * nt


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs get exact float32 products; bf16/fp16 operands are multiplied in their own type."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def chunk_bounds(chunk_indices, cu_seqlens, i_c, BT: tl.constexpr):
    """(bos, eos, t0) of global chunk i_c: its sequence's first and end rows and its own first row."""
    i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
    i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos, eos, bos + i_t * BT


@triton.jit
def sequence_bounds(cu_seqlens, chunk_offsets, i_n):
    """(bos, eos, c0) of sequence i_n: its first and end rows and its first global chunk."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, eos, c0


@triton.jit
def load_state(
    ptr, i_nh, offs, mask, HAS_STATE: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """The [BK, BV] float32 tile at offs of state i_nh in ptr ([N * H, K, V]), or zeros where there is none (ptr None)."""
    if HAS_STATE:
        s = tl.load(ptr + i_nh * K * V + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    return s


@triton.jit
def decayed_keys(k, b, offs_k, m_tk, m_k, o_k, t0, eos, i_h, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    """(b_last, b_t, kd) of the chunk starting at row t0, over the K columns o_k.

    b_last [BK] is the decay at the chunk's last row, b_t [BT, BK] at each row, and
    kd = exp(b_last - b_t) k [BT, BK] (float32) the keys decayed to the last row.
    """
    last = tl.minimum(t0 + BT, eos) - 1
    b_last = tl.load(b + last * (H * K) + i_h * K + o_k, mask=m_k, other=0.0)
    b_t = tl.load(b + offs_k, mask=m_tk, other=0.0)
    kd = tl.load(k + offs_k, mask=m_tk, other=0.0).to(tl.float32) * tl.exp(tl.where(m_tk, b_last[None, :] - b_t, 0.0))
    return b_last, b_t, kd


@triton.jit
def block_references(b, r0, eos, i_h, cols, m_k, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """(fits, b_r0, b_mid) for the 16-row block starting at row r0 < eos, over the K columns cols.

    b_r0 and b_mid [BK] are the decays at the block's first and middle rows. fits says that the
    block's own decays stay within 60 of the middle row in every column, so that exp(b_i - b_mid)
    and exp(b_mid - b_j) for rows i, j of the block are at most exp(60): finite and normal in float32.
    """
    # NOTE: 60 (SPAN_LIMIT) admits any gate above -7.5 per token (at most 8 decays on either side of the
    # middle row), the safe gate's lower bound of -5 included; a hard reset inside the block does not fit.
    mid = tl.minimum(r0 + BC // 2, eos - 1)
    last = tl.minimum(r0 + BC - 1, eos - 1)
    row = i_h * K + cols
    b_r0 = tl.load(b + r0 * (H * K) + row, mask=m_k, other=0.0)
    b_mid = tl.load(b + mid * (H * K) + row, mask=m_k, other=0.0)
    b_last = tl.load(b + last * (H * K) + row, mask=m_k, other=0.0)
    span = tl.maximum(tl.max(b_r0 - b_mid, 0), tl.max(b_mid - b_last, 0))
    return span <= 60.0, b_r0, b_mid


@triton.jit
def middle_reference(b, r0, eos, i_h, cols, m_k, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """b_mid [BK]: the decay at the middle row of the 16-row block starting at row r0 < eos (see bounded_gate)."""
    mid = tl.minimum(r0 + BC // 2, eos - 1)
    return tl.load(b + mid * (H * K) + i_h * K + cols, mask=m_k, other=0.0)


@triton.jit
def block_of(x, s, NS: tl.constexpr):
    """x[s] of a [NS, R, C] register tensor (which cannot be indexed): a select and a sum over its first axis."""
    return tl.sum(tl.where((tl.arange(0, NS) == s)[:, None, None], x, 0.0), 0)
