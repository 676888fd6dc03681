"""Triton kernels of the pseudo-query mix: no stacked copy, each source read once forward, twice backward.

Legend: N sources, R rows (B * T tokens), D width, BR / BD the rows / columns of one tile.

The sources arrive as separate [R, D] tensors, one pointer argument each
(V0, V1, ...; absent ones are None), so nothing stacks them into an [N, R, D]
copy; N is a compile-time constant and the loops over sources unroll. A
program owns BR whole rows (BD >= D), which is what lets one read of each
source tile serve both its row statistics and the weighted sum.

Forward, per row: for each source, rstd_n = rsqrt(mean(v_n^2) + eps) and
s_n = rstd_n <v_n, q>; an online softmax (running max m, running sum l,
rescaled accumulator) folds v_n into the output as soon as s_n is known.
Saved for backward (float32, small): s [N, R], rstd [N, R] and the row's
largest score m [R]; the weights are w_n = exp(s_n - m) / sum_k exp(s_k - m).
NOTE: not exp(s_n - lse): scores reach the hundreds, where a float32
log-sum-exp keeps only ~1e-4 absolute, so those weights would not sum to 1
by ~1e-4, and ds_n (below) would no longer sum to zero over n.

Backward, with g = dout:
    dw_n = <g, v_n>,   dbar = sum_k w_k dw_k
    ds_n = w_n (dw_n - dbar)
    dv_n = w_n g + ds_n rstd_n (q - rstd_n s_n v_n / D)
    dq   = sum over rows and n of ds_n rstd_n v_n   (per-program partials [D, P], summed in torch)
dv_n is written to its own buffer, or added to what a buffer already holds
(bit n of ACC): a residual block that several mixes read then gets its
gradient summed in place by their kernels (`sinks.GradientSink`), with no
separate add of two [R, D] tensors per extra reader. The last source's
gradient can also take in one more tensor (ADD, read only: the gradient that
the residual add after the mix sends to that same source, `sinks.GradientHandoff`).
With a norm weight nw (the sublayer's RMSNorm folded in, `kernels.attn_res_norm_in_mix`) the kernel writes
y = nw * h * r, r = rsqrt(mean(h^2) + eps'), in place of the mix h, and its backward takes dy:
    g = r nw dy - h r^3 <nw dy, h> / D,   dnw = sum over rows of dy h r   (partials [D, P], like dq)
then goes on with g as above. The backward first walks the sources once more to
rebuild h in float32 from the saved scores (the re-reads hit L2); the norm's own
passes over h, dy and g (a [B, T, D] write and read forward; a read of h, a write
and read of g, and the weight's reduction backward) are gone. NOTE: dbar is still
summed from the dw_n (not <g, h>, equal in exact arithmetic): computed from the
rebuilt h it left sum_n ds_n off zero by h's rounding, which gave the query 30x
float32 autograd's error where the sources nearly agree.
dbar needs every source before any dv_n can be written, so the backward walks
the sources twice; the second walk re-reads tiles the first has just read
(from L2 on a GPU). With N at most LAUNCH["bwd"]["hold"] (HOLD), a row tile
loads its sources, the gradients it adds to in place and ADD once, at its start,
and its walks read those held tiles: one wait on memory per row tile instead of
three, the same arithmetic in the same order (the same bits).
NOTE: dbar equals <g, out>, which would save the first walk, but `out` is
rounded to the sources' dtype, and where the sources nearly agree (or one
weight nears 1) dw_n - dbar is small enough for that rounding to matter:
computed from the same float32 dw_n, sum_n ds_n is zero up to float32
rounding, as in autograd of the float32 reference.
"""

import torch
import triton
import triton.language as tl

MAX_SOURCES = 12

# Launch settings, fixed (no autotune pause). A tile holds BR rows of BD = next_pow2(D) columns with about
# `tile` elements in all; each program keeps two (forward) or three to four (backward) such float32 tiles live.
# NOTE: k3-mini's D = 512 gives 4 rows per tile. `benchmarks/attn_res.py --sweep` on an H200 (79cfdf1, N = 5):
# tile 2048 / 4 warps 1.12 ms fwd+bwd, 4096 / 8 warps 1.31, 8192 / 16 warps 1.37 (benchmarks/results/attn_res.md).
# The backward's program walks `tiles` consecutive row tiles, so it leaves one dq partial per tiles * BR rows.
# `hold`: the most sources whose tiles the backward holds (k3-mini's mixes read 1 to 4); 0 reloads them always.
LAUNCH = {
    "fwd": dict(tile=2048, num_warps=4),
    "bwd": dict(tile=2048, num_warps=4, tiles=8, hold=4),
}


def tiles(name: str, D: int) -> tuple[int, int, int]:
    """(BR, BD, num_warps) of kernel `name` at width D: whole rows, at least one per tile."""
    opts = LAUNCH[name]
    block_d = max(16, triton.next_power_of_2(D))
    block_r = max(1, opts["tile"] // block_d)
    # A row wider than the tile still goes in one program: more warps keep each thread's share bounded.
    warps = min(16, max(opts["num_warps"], block_d // 512))
    return block_r, block_d, warps


@triton.jit
def _one_of_four(n: tl.constexpr, X0, X1, X2, X3):
    """Argument number n of four (a compile-time choice: the other branches are never built)."""
    x = X0
    if n == 1:
        x = X1
    if n == 2:
        x = X2
    if n == 3:
        x = X3
    return x


@triton.jit
def _source(n: tl.constexpr, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11):
    """Pointer argument number n of twelve (compile-time, four at a time)."""
    if n < 4:
        p = _one_of_four(n, P0, P1, P2, P3)
    elif n < 8:
        p = _one_of_four(n - 4, P4, P5, P6, P7)
    else:
        p = _one_of_four(n - 8, P8, P9, P10, P11)
    return p


@triton.jit
def _load_held(n: tl.constexpr, N: tl.constexpr, P, offs, mask, WANT: tl.constexpr = True):
    """Tile n's load when n < N and WANT (compile-time), else a scalar placeholder that is never read."""
    x = 0.0
    if n < N and WANT:
        x = tl.load(P + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _mix_fwd_kernel(
    V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11,
    q_ptr, nw_ptr, out_ptr, score_ptr, rstd_ptr, smax_ptr, R, D, eps, norm_eps,
    N: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):
    rows = tl.program_id(0) * BR + tl.arange(0, BR).to(tl.int64)
    cols = tl.arange(0, BD)
    row_ok = rows < R
    mask = row_ok[:, None] & (cols < D)[None, :]
    offs = rows[:, None] * D + cols[None, :]
    q = tl.load(q_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    m = tl.full([BR], float("-inf"), tl.float32)
    l = tl.zeros([BR], tl.float32)
    acc = tl.zeros([BR, BD], tl.float32)
    for n in tl.static_range(N):
        v_ptr = _source(n, V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        s = rstd * tl.sum(v * q[None, :], axis=1)
        tl.store(score_ptr + n * R + rows, s, mask=row_ok)
        tl.store(rstd_ptr + n * R + rows, rstd, mask=row_ok)
        # NOTE: the first source meets m = -inf: its rescale factor is exp(-inf) = 0 on a zero accumulator.
        m_new = tl.maximum(m, s)
        scale = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        acc = acc * scale[:, None] + p[:, None] * v
        l = l * scale + p
        m = m_new
    h = acc / l[:, None]
    if nw_ptr is not None:
        nw = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + norm_eps)
        h = h * r[:, None] * nw[None, :]
    tl.store(out_ptr + offs, h.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(smax_ptr + rows, m, mask=row_ok)


@triton.jit
def _mix_bwd_kernel(
    V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11,
    G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11,
    q_ptr, nw_ptr, dout_ptr, score_ptr, rstd_ptr, smax_ptr, dq_part_ptr, dnw_part_ptr, R, D, norm_eps,
    N: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, TILES: tl.constexpr, ACC: tl.constexpr, ADD,
    HOLD: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    q = tl.load(q_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    dq_acc = tl.zeros([BR, BD], tl.float32)
    dnw_acc = tl.zeros([BR, BD], tl.float32)
    for tile in range(TILES):
        rows = (pid * TILES + tile).to(tl.int64) * BR + tl.arange(0, BR)
        row_ok = rows < R
        mask = row_ok[:, None] & (cols < D)[None, :]
        offs = rows[:, None] * D + cols[None, :]
        g = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(smax_ptr + rows, mask=row_ok, other=0.0)
        if HOLD:
            # N <= 4: every tile this row tile needs (the sources, the gradients added to in place, ADD) is loaded
            # here at once, in the inputs' dtypes, and held across the walks below: one wait on memory per row
            # tile instead of three (the sources and dout; their re-reads from L2; the in-place gradients after dbar).
            h0 = _load_held(0, N, V0, offs, mask)
            h1 = _load_held(1, N, V1, offs, mask)
            h2 = _load_held(2, N, V2, offs, mask)
            h3 = _load_held(3, N, V3, offs, mask)
            a0 = _load_held(0, N, G0, offs, mask, ((ACC >> 0) & 1) == 1)
            a1 = _load_held(1, N, G1, offs, mask, ((ACC >> 1) & 1) == 1)
            a2 = _load_held(2, N, G2, offs, mask, ((ACC >> 2) & 1) == 1)
            a3 = _load_held(3, N, G3, offs, mask, ((ACC >> 3) & 1) == 1)
            if ADD is not None:
                add = tl.load(ADD + offs, mask=mask, other=0.0)
        if nw_ptr is not None:
            # g arrives as dy, the gradient of the norm's output y = nw * h * r: a first walk rebuilds the mix h.
            h = tl.zeros([BR, BD], tl.float32)
            e_sum = tl.zeros([BR], tl.float32)
            for n in tl.static_range(N):
                if HOLD:
                    v = _one_of_four(n, h0, h1, h2, h3)
                else:
                    v = tl.load(_source(n, V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11) + offs, mask=mask,
                                other=0.0)
                e = tl.exp(tl.load(score_ptr + n * R + rows, mask=row_ok, other=0.0) - m)
                e_sum += e
                h += e[:, None] * v.to(tl.float32)
            h = h / e_sum[:, None]
            nw = tl.load(nw_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / D + norm_eps)
            dnw_acc += g * h * r[:, None]
            g = g * nw[None, :]
            g = r[:, None] * g - (r * r * r * tl.sum(g * h, axis=1) / D)[:, None] * h
        e_sum = tl.zeros([BR], tl.float32)
        e_dw = tl.zeros([BR], tl.float32)
        for n in tl.static_range(N):
            if HOLD:
                v = _one_of_four(n, h0, h1, h2, h3)
            else:
                v = tl.load(_source(n, V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11) + offs, mask=mask,
                            other=0.0)
            e = tl.exp(tl.load(score_ptr + n * R + rows, mask=row_ok, other=0.0) - m)
            e_sum += e
            e_dw += e * tl.sum(g * v.to(tl.float32), axis=1)
        dbar = e_dw / e_sum
        for n in tl.static_range(N):
            if HOLD:
                v = _one_of_four(n, h0, h1, h2, h3)
            else:
                v = tl.load(_source(n, V0, V1, V2, V3, V4, V5, V6, V7, V8, V9, V10, V11) + offs, mask=mask,
                            other=0.0)
            v = v.to(tl.float32)
            s = tl.load(score_ptr + n * R + rows, mask=row_ok, other=0.0)
            rstd = tl.load(rstd_ptr + n * R + rows, mask=row_ok, other=0.0)
            w = tl.exp(s - m) / e_sum
            ds = w * (tl.sum(g * v, axis=1) - dbar)
            c = ds * rstd  # coefficient of q in dv_n, and of v_n in dq
            dv = w[:, None] * g + c[:, None] * q[None, :] - (c * rstd * s / D)[:, None] * v
            dv_ptr = _source(n, G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11)
            if (ACC >> n) & 1:
                if HOLD:
                    dv += _one_of_four(n, a0, a1, a2, a3).to(tl.float32)
                else:
                    dv += tl.load(dv_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if ADD is not None:
                if n == N - 1:
                    if HOLD:
                        dv += add.to(tl.float32)
                    else:
                        dv += tl.load(ADD + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dv_ptr + offs, dv.to(dv_ptr.dtype.element_ty), mask=mask)
            dq_acc += c[:, None] * v
    # NOTE: stored transposed ([D, P]): torch sums a [P, D] float32 partial over P ~2-3x slower than a [D, P]
    # one over its last dimension at k3-mini's D = 512 (an H200, session 22).
    tl.store(dq_part_ptr + cols * tl.num_programs(0) + pid, tl.sum(dq_acc, axis=0), mask=cols < D)
    if nw_ptr is not None:
        tl.store(dnw_part_ptr + cols * tl.num_programs(0) + pid, tl.sum(dnw_acc, axis=0), mask=cols < D)


def _pointers(tensors: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The MAX_SOURCES pointer arguments: the tensors, then None."""
    return list(tensors) + [None] * (MAX_SOURCES - len(tensors))


def mix_forward(
    sources: list[torch.Tensor], query: torch.Tensor, eps: float, norm_weight: torch.Tensor | None = None,
    norm_eps: float = 0.0,
) -> tuple[torch.Tensor, ...]:
    """sources: N contiguous [..., D] (dtypes may differ), query [D] -> (out like sources[0], s [N, R], rstd [N, R], m [R]).

    norm_weight: None, or [D] (contiguous, any float dtype): out is then RMSNorm(mix) * norm_weight with norm_eps.
    """
    N, D = len(sources), query.shape[0]
    R = sources[0].numel() // D
    out = torch.empty_like(sources[0])
    f32 = dict(dtype=torch.float32, device=out.device)
    score, rstd, smax = torch.empty(N, R, **f32), torch.empty(N, R, **f32), torch.empty(R, **f32)
    if R > 0:
        br, bd, warps = tiles("fwd", D)
        _mix_fwd_kernel[(triton.cdiv(R, br),)](
            *_pointers(sources), query, norm_weight, out, score, rstd, smax, R, D, eps, norm_eps,
            N=N, BR=br, BD=bd, num_warps=warps,
        )
    return out, score, rstd, smax


def mix_backward(
    sources: list[torch.Tensor], query: torch.Tensor, dout: torch.Tensor,
    score: torch.Tensor, rstd: torch.Tensor, smax: torch.Tensor, into: list[torch.Tensor | None] | None = None,
    add_last: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0,
) -> list[torch.Tensor]:
    """Gradients [dv_0, ..., dv_{N-1}, dq] (and dnorm_weight last, given norm_weight): dv_n like the sources, dq [D]
    in the query's dtype, dnorm_weight [D] in its own. dout: contiguous, the gradient of mix_forward's output.

    into: per source, None (dv_n is a new tensor) or a contiguous tensor like it that dv_n is added to in place
    (and returned as dv_n); no two may share memory.
    add_last: None or a contiguous tensor of the last source's shape (any float dtype), added to dv_{N-1} (read only).
    """
    N, D = len(sources), query.shape[0]
    R = smax.shape[0]
    into = into if into is not None else [None] * N
    if len(into) != N:
        raise ValueError(f"mix_backward: into has {len(into)} entries for {N} sources")
    for n, (buf, v) in enumerate(zip(into, sources)):
        if buf is not None and (buf.shape != v.shape or buf.dtype != v.dtype or not buf.is_contiguous()):
            raise ValueError(f"mix_backward: into[{n}] must be contiguous {tuple(v.shape)} {v.dtype} like source {n}, "
                             f"got {tuple(buf.shape)} {buf.dtype}{'' if buf.is_contiguous() else ' non-contiguous'}")
    dvs = [torch.empty_like(v) if buf is None else buf for buf, v in zip(into, sources)]
    if R > 0 and len({dv.data_ptr() for dv in dvs}) != N:
        raise ValueError("mix_backward: two sources' gradients would be written to one buffer")
    acc = sum(1 << n for n, buf in enumerate(into) if buf is not None)
    if add_last is not None and (add_last.shape != sources[-1].shape or not add_last.is_contiguous()):
        raise ValueError(f"mix_backward: add_last must be contiguous {tuple(sources[-1].shape)} like the last source, "
                         f"got {tuple(add_last.shape)}{'' if add_last.is_contiguous() else ' non-contiguous'}")
    br, bd, warps = tiles("bwd", D)
    n_tiles = LAUNCH["bwd"]["tiles"]
    programs = triton.cdiv(triton.cdiv(R, br), n_tiles)
    dq_part = torch.empty(D, programs, dtype=torch.float32, device=dout.device)
    dnw_part = None if norm_weight is None else torch.empty_like(dq_part)
    if R > 0:
        _mix_bwd_kernel[(programs,)](
            *_pointers(sources), *_pointers(dvs), query, norm_weight, dout, score, rstd, smax, dq_part, dnw_part,
            R, D, norm_eps, N=N, BR=br, BD=bd, TILES=n_tiles, ACC=acc, ADD=add_last, HOLD=N <= LAUNCH["bwd"]["hold"],
            num_warps=warps,
        )
    dnw = [] if norm_weight is None else [dnw_part.sum(1).to(norm_weight.dtype)]
    return dvs + [dq_part.sum(1).to(query.dtype)] + dnw
