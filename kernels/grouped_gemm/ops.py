"""Public grouped-GEMM ops: launchers, torch.library custom ops, and autograd.

`grouped_mm` and `moe_experts` are registered as custom ops with fake
(meta) implementations and autograd formulas, so torch.compile traces them
without a graph break. Both need CUDA tensors (or TRITON_INTERPRET=1 on CPU);
`kernels.grouped_gemm.reference` is the pure-PyTorch version.

Legend: T tokens, k experts per token, S = T * k token-slots sorted by
expert, E experts, L latent width, F expert hidden width; for grouped_mm,
N rows, K reduction width, M output width.
"""

import torch
import triton

from kernels.device import check_same_device, triton_runs_on
from kernels.grouped_gemm.reference import route_permutation
from kernels.grouped_gemm.triton_gemm import (
    grouped_mm_dual_kernel,
    grouped_mm_kernel,
    grouped_wgrad_dual_kernel,
    grouped_wgrad_kernel,
    row_tiles_upper_bound,
)
from kernels.grouped_gemm.triton_moe import (
    combine_block_sizes,
    combine_kernel,
    glu_bwd_launch,
    glu_bwd_pointwise_kernel,
    glu_up_kernel,
)

__all__ = ["grouped_mm", "moe_experts"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _precision(dtype: torch.dtype) -> str:
    # NOTE: float32 inputs get true float32 products; Triton's default (tf32)
    # would carry ~1e-3 relative error into a float32 API.
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------- launchers


def _mm_grid(n_rows, n_experts, n_cols):
    def grid(meta):
        return (row_tiles_upper_bound(n_rows, n_experts, meta["BLOCK_M"]) * triton.cdiv(n_cols, meta["BLOCK_N"]),)

    return grid


def _launch_mm(a, b, offsets, out, gather=None, a2=None, b2=None):
    """out[r] = a[g(r)] @ b[e] (+ a2[g(r)] @ b2[e]) for rows r of group e; zeros past offsets[-1]."""
    n_rows, n_cols = out.shape
    n_experts, red = b.shape[0], b.shape[1]
    if n_rows == 0 or n_cols == 0:
        return out
    if a2 is not None:
        assert a2.stride() == a.stride() and b2.stride() == b.stride()
    kernel = grouped_mm_kernel if a2 is None else grouped_mm_dual_kernel
    kernel[_mm_grid(n_rows, n_experts, n_cols)](
        a, a if a2 is None else a2, b, b if b2 is None else b2, out, offsets,
        offsets if gather is None else gather,
        n_rows, red, n_cols,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        N_EXPERTS=n_experts, E_POW2=triton.next_power_of_2(n_experts),
        GATHER=gather is not None, DUAL=a2 is not None, PRECISION=_precision(a.dtype),
    )
    return out


def _launch_wgrad(a, b, offsets, out, gather=None, b2=None, out2=None, gather_b=None):
    """out[e] = a[g(rows_e)]^T @ b[h(rows_e)] (and out2[e] with b2); `offsets` define the groups of rows.

    g = `gather` (a's rows by index), h = `gather_b` (b's rows by index), at most one of them; else the rows.
    """
    assert gather is None or gather_b is None, "one operand's rows are gathered at a time"
    n_experts, red, n_cols = out.shape
    if out.numel() == 0:
        return
    if b2 is not None:
        assert b2.stride() == b.stride() and out2.stride() == out.stride()

    def grid(meta):
        return (n_experts * triton.cdiv(red, meta["BLOCK_K"]) * triton.cdiv(n_cols, meta["BLOCK_N"]),)

    kernel = grouped_wgrad_kernel if b2 is None else grouped_wgrad_dual_kernel
    kernel[grid](
        a, b, b if b2 is None else b2, out, out if out2 is None else out2, offsets,
        next((g for g in (gather, gather_b) if g is not None), offsets),
        b.shape[0] if gather_b is None else gather_b.shape[0], red, n_cols,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), out.stride(2),
        N_EXPERTS=n_experts, GATHER=gather is not None, GATHER_B=gather_b is not None, DUAL=b2 is not None,
        PRECISION=_precision(a.dtype),
    )


def _launch_glu_up(x, w1, w3, offsets, token, h, g=None, u=None):
    """h[s] = SiTU-GLU(x[token[s]] @ w1[e], x[token[s]] @ w3[e]) for slots s of expert e; g and u, the two
    products, too when given (what the backward keeps)."""
    (n_experts, latent, hidden), n_slots = w1.shape, h.shape[0]
    if n_slots == 0 or hidden == 0:
        return
    glu_up_kernel[_mm_grid(n_slots, n_experts, hidden)](
        x, w1, w3, h, h if g is None else g, h if u is None else u, offsets, token,
        n_slots, latent, hidden,
        x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), h.stride(0),
        N_EXPERTS=n_experts, E_POW2=triton.next_power_of_2(n_experts), STORE_GU=g is not None,
        PRECISION=_precision(x.dtype),
    )


def _launch_glu_bwd_pointwise(dg, g, u, du, hp, weight, order, dweight, offsets):
    """The GLU backward's pointwise pass over the slot rows (`glu_bwd_pointwise_kernel`); dg holds dh on entry."""
    n_slots, hidden = g.shape
    if dg.numel() == 0:
        return
    block_s, block_f, warps = glu_bwd_launch(hidden)
    glu_bwd_pointwise_kernel[(triton.cdiv(n_slots, block_s),)](
        dg, g, u, du, hp, weight, order, dweight, offsets, n_slots, hidden,
        N_EXPERTS=offsets.shape[0], BLOCK_S=block_s, BLOCK_F=block_f, num_warps=warps,
    )


def _launch_combine(src_SL, inverse_S, weight_TK, out_TL, top_k):
    n_tokens, width = out_TL.shape
    if n_tokens == 0 or width == 0:
        return out_TL
    block_t, block_l = combine_block_sizes(width)
    combine_kernel[(triton.cdiv(n_tokens, block_t), triton.cdiv(width, block_l))](
        src_SL, inverse_S, src_SL if weight_TK is None else weight_TK, out_TL,
        n_tokens, width, src_SL.stride(0), out_TL.stride(0),
        TOP_K=top_k, WEIGHTED=weight_TK is not None, BLOCK_T=block_t, BLOCK_L=block_l,
    )
    return out_TL


# ---------------------------------------------------------------- grouped_mm


@torch.library.custom_op("k3_grouped_gemm::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[2], device=x.device, dtype=x.dtype)
    return _launch_mm(x, w, offsets, y)


@_grouped_mm_op.register_fake
def _(x, w, offsets):
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("k3_grouped_gemm::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    dx = _launch_mm(dy, w.transpose(1, 2), offsets, torch.empty_like(x, memory_format=torch.contiguous_format))
    dw = torch.empty_like(w, memory_format=torch.contiguous_format)
    _launch_wgrad(x, dy, offsets, dw)
    return dx, dw


@_grouped_mm_backward_op.register_fake
def _(dy, x, w, offsets):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w, memory_format=torch.contiguous_format)


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _grouped_mm_backward(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dx, dw = _grouped_mm_backward_op(dy, x, w, offsets)
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _check_device(name: str, t: torch.Tensor) -> None:
    if not triton_runs_on(t.device):
        raise ValueError(
            f"{name} is on {t.device}; the Triton grouped GEMMs need CUDA tensors (or TRITON_INTERPRET=1); "
            "use kernels.grouped_gemm.reference on CPU"
        )


def _check_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}; it must match x's dtype {dtype}")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[r] = x[r] @ w[e] for rows r of group e (torch._grouped_mm semantics).

    x [N, K] rows grouped by expert; w [E, K, M]; offsets int32 [E], the
    nondecreasing cumulative row ends (empty groups allowed, offsets[-1] <= N;
    read on the device, never checked against the data). Returns y [N, M] in
    x's dtype; unlike torch._grouped_mm, rows past offsets[-1] are zeros and
    get zero gradient. Differentiable in x and w.
    """
    if x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [N, K]")
    if w.dim() != 3 or w.shape[1] != x.shape[1] or w.shape[0] == 0:
        raise ValueError(f"w has shape {tuple(w.shape)}; expected [E, K={x.shape[1]}, M] with E >= 1")
    if offsets.dim() != 1 or offsets.dtype != torch.int32 or offsets.shape[0] != w.shape[0]:
        raise ValueError(
            f"offsets is {offsets.dtype} of shape {tuple(offsets.shape)}; expected int32 [E={w.shape[0]}]"
        )
    if x.dtype not in _DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; allowed: {', '.join(str(d) for d in _DTYPES)}")
    _check_dtype("w", w, x.dtype)
    for name, t in (("x", x), ("w", w), ("offsets", offsets)):
        _check_device(name, t)
    check_same_device("grouped_mm", "x", dict(x=x, w=w, offsets=offsets))
    return _grouped_mm_op(x, w, offsets)


# ---------------------------------------------------------------- moe_experts


@torch.library.custom_op("k3_grouped_gemm::moe_experts_fwd", mutates_args=())
def _moe_fwd_op(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, weight: torch.Tensor,
    order: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, offsets: torch.Tensor, save: bool,
    cast_in_kernel: bool, s1: torch.Tensor | None = None, s3: torch.Tensor | None = None,
    s2: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, g, u, w1c, w3c, w2c); g and u are empty unless save (they are all the backward keeps of the experts'
    work); w1c, w3c, w2c are the weights in x's dtype when they come in another (`_compute_weights`), else empty
    (and always empty when cast_in_kernel: the GEMMs round each weight tile as they load it, or with shadows
    s1, s3, s2: the weights' copies in x's dtype that the caller keeps, read in their place).

    NOTE: h = SiTU-GLU(g, u) and the slots' outputs h @ w2 live only until the combine: the backward's
    pointwise pass rebuilds h from g and u, which it reads anyway, and takes the routing weights' gradient
    from there (`_glu_backward`), so a layer holds two [S, F] tensors between forward and backward, not
    three plus the [S, L] outputs.
    """
    n_tokens, latent = x.shape
    hidden = w1.shape[2]
    n_slots = token.shape[0]
    new = dict(device=x.device, dtype=x.dtype)
    casts = [] if cast_in_kernel or s1 is not None else _compute_weights(x, w1, w3, w2)
    if casts:
        w1, w3, w2 = casts
    elif s1 is not None:
        w1, w3, w2 = s1, s3, s2
    h = torch.empty(n_slots, hidden, **new)
    g = torch.empty(n_slots if save else 0, hidden, **new)
    u = torch.empty_like(g)
    _launch_glu_up(x, w1, w3, offsets, token, h, g if save else None, u if save else None)
    out = _launch_mm(h, w2, offsets, torch.empty(n_slots, latent, **new))
    y = _launch_combine(out, inverse, weight, torch.empty(n_tokens, latent, **new), weight.shape[1])
    return y, g, u, *(casts if casts and save else _no_casts(x))


def _compute_weights(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """The expert weights in x's dtype when they come in another (float32 masters under bf16 compute), else [].

    NOTE: the cast is inside the op, not in the caller: the op then owns the weights' gradients and writes them
    in the weights' own dtype straight from the float32 accumulators. A cast outside had autograd write each
    gradient in bf16 and then a float32 copy of it (33 passes over [E, L, F] per k3-mini step, ~1.1 ms of kernel
    time), rounding it to bf16 on the way. The k3-mini step did not measure faster for it (153.8 -> 153.9 ms,
    benchmarks/results/train_throughput.md, session 20); the gradients are the accumulators' now.
    NOTE: `moe_experts(cast_in_kernel=True)` makes no casts at all: the GEMMs read the float32 weights and round
    each tile as they load it, so neither the cast passes (33 per k3-mini update, ~1.2 ms) nor the bf16 copies the
    backward keeps (1.5 GiB at k3-mini's update peak) exist, for twice the bytes per weight tile loaded.
    """
    return [w.to(x.dtype) for w in weights] if weights[0].dtype != x.dtype else []


def _no_casts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(x.new_empty(0) for _ in range(3))


@_moe_fwd_op.register_fake
def _(x, w1, w3, w2, weight, order, token, inverse, offsets, save, cast_in_kernel, s1=None, s3=None, s2=None):
    n_slots, hidden = token.shape[0], w1.shape[2]
    g = x.new_empty(n_slots if save else 0, hidden)
    casts = (tuple(x.new_empty(w.shape) for w in (w1, w3, w2))
             if save and w1.dtype != x.dtype and not cast_in_kernel and s1 is None else _no_casts(x))
    return x.new_empty(x.shape), g, torch.empty_like(g), *casts


def _glu_backward(dy: torch.Tensor, token: torch.Tensor, w2: torch.Tensor, g: torch.Tensor, u: torch.Tensor,
                  weight: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(dg, du, hp [S, F], dweight float32 [S] by flat slot id) from dy [T, L]: slot s reads the unweighted row
    dout[s] = dy[token[s]].

    dh = dout @ w2[e]^T per expert (dy's rows gathered in the GEMM's loads), then one pointwise pass over whole
    rows: the SiTU-GLU backward scaled by each slot's routing weight, the weight's own gradient <dh, h>, and
    hp = p * h for the w2 weight gradient (`glu_bwd_pointwise_kernel`). NOTE: two kernels, not one with the GLU
    backward in the GEMM's epilogue: that fused kernel needed ~245 registers per thread (the accumulator next to g
    and u) and ran at a quarter of its memory floor (benchmarks/results/moe.md). A plain GEMM and a pointwise pass each run near their own.
    """
    n_slots, hidden = g.shape[0], w2.shape[1]
    assert g.is_contiguous() and u.is_contiguous(), "the pointwise pass walks g and u as [S, F] rows of stride F"
    dg = _launch_mm(dy, w2.transpose(1, 2), offsets, torch.empty(n_slots, hidden, device=g.device, dtype=g.dtype),
                    gather=token)
    du, hp = torch.empty_like(dg), torch.empty_like(dg)
    # NOTE: zeros: slots past offsets[-1] (EP's other ranks) take no weight gradient here.
    dweight = torch.zeros(n_slots, device=g.device, dtype=torch.float32)
    _launch_glu_bwd_pointwise(dg, g, u, du, hp, weight, order, dweight, offsets)
    return dg, du, hp, dweight


@torch.library.custom_op("k3_grouped_gemm::moe_experts_bwd", mutates_args=())
def _moe_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
    weight: torch.Tensor, order: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor,
    offsets: torch.Tensor, g: torch.Tensor, u: torch.Tensor, grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw1, dw3, dw2, dweight); w1, w3, w2 in x's dtype or float32 (rounded to x's dtype by the GEMMs as
    they load them), their gradients in `grad_dtype` (the weights' own)."""
    n_tokens, latent = x.shape
    n_slots = token.shape[0]
    top_k = weight.shape[1]
    new = dict(device=x.device, dtype=x.dtype)
    grads = dict(device=x.device, dtype=grad_dtype)
    # NOTE: each slot's unweighted dy row, dy[token(s)], read by the two GEMMs that need it straight from dy
    # (gathered loads; a copy of those rows was a 100 MB pass per k3-mini layer): the routing weight enters in
    # the pointwise pass (dg, du, hp), which also gives the weight's gradient, so the backward needs no copy of
    # the forward's slot outputs.
    dy = dy.contiguous()
    dg, du, hp, d_weight = _glu_backward(dy, token, w2, g, u, weight, order, offsets)
    dw2 = torch.empty(w2.shape, **grads)
    _launch_wgrad(hp, dy, offsets, dw2, gather_b=token)
    dw1 = torch.empty(w1.shape, **grads)
    dw3 = torch.empty(w3.shape, **grads)
    _launch_wgrad(x, dg, offsets, dw1, gather=token, b2=du, out2=dw3)
    dx_slots = _launch_mm(dg, w1.transpose(1, 2), offsets, torch.empty(n_slots, latent, **new),
                          a2=du, b2=w3.transpose(1, 2))
    dx = _launch_combine(dx_slots, inverse, None, torch.empty(n_tokens, latent, **new), top_k)
    return dx, dw1, dw3, dw2, d_weight.view(n_tokens, top_k).to(weight.dtype)


@_moe_bwd_op.register_fake
def _(dy, x, w1, w3, w2, weight, order, token, inverse, offsets, g, u, grad_dtype):
    return (torch.empty_like(x), *(torch.empty_like(w, dtype=grad_dtype) for w in (w1, w3, w2)),
            torch.empty_like(weight))


def _moe_setup(ctx, inputs, output):
    x, w1, w3, w2, weight, order, token, inverse, offsets, _, cast_in_kernel, *shadows = inputs
    _, g, u, *casts = output
    ctx.mark_non_differentiable(g, u, *casts)
    ctx.set_materialize_grads(False)
    ctx.grad_dtype = w1.dtype
    # NOTE: the backward's GEMMs read the shadows when given, else the forward's casts when there were some, else
    # the weights themselves.
    if shadows and shadows[0] is not None:
        weights = shadows
    else:
        weights = casts if w1.dtype != x.dtype and not cast_in_kernel else (w1, w3, w2)
    ctx.save_for_backward(x, *weights, weight, order, token, inverse, offsets, g, u)
    ctx.n_inputs = len(inputs)


def _moe_backward(ctx, dy, *_):
    if dy is None:
        return (None,) * ctx.n_inputs
    dx, dw1, dw3, dw2, d_weight = _moe_bwd_op(dy, *ctx.saved_tensors, ctx.grad_dtype)
    return dx, dw1, dw3, dw2, d_weight, *(None,) * (ctx.n_inputs - 5)


_moe_fwd_op.register_autograd(_moe_backward, setup_context=_moe_setup)


def _check_moe(x_TL, w1_ELF, w3_ELF, w2_EFL, topk_idx_TK, topk_weight_TK) -> None:
    if x_TL.dim() != 2:
        raise ValueError(f"x_TL has shape {tuple(x_TL.shape)}; expected [T, L]")
    n_tokens, latent = x_TL.shape
    if x_TL.dtype not in _DTYPES:
        raise ValueError(f"x_TL has dtype {x_TL.dtype}; allowed: {', '.join(str(d) for d in _DTYPES)}")
    if w1_ELF.dim() != 3 or w1_ELF.shape[1] != latent or w1_ELF.shape[0] == 0:
        raise ValueError(f"w1_ELF has shape {tuple(w1_ELF.shape)}; expected [E, L={latent}, F] with E >= 1")
    n_experts, _, hidden = w1_ELF.shape
    if w3_ELF.shape != w1_ELF.shape:
        raise ValueError(f"w3_ELF has shape {tuple(w3_ELF.shape)}; expected w1's {tuple(w1_ELF.shape)}")
    if tuple(w2_EFL.shape) != (n_experts, hidden, latent):
        raise ValueError(f"w2_EFL has shape {tuple(w2_EFL.shape)}; expected [E={n_experts}, F={hidden}, L={latent}]")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != n_tokens or topk_idx_TK.dtype != torch.int64:
        raise ValueError(
            f"topk_idx_TK is {topk_idx_TK.dtype} of shape {tuple(topk_idx_TK.shape)}; expected int64 [T={n_tokens}, k]"
        )
    if topk_weight_TK.shape != topk_idx_TK.shape or not topk_weight_TK.is_floating_point():
        raise ValueError(
            f"topk_weight_TK is {topk_weight_TK.dtype} of shape {tuple(topk_weight_TK.shape)}; "
            f"expected floating [T, k] = {tuple(topk_idx_TK.shape)}"
        )
    # NOTE: float32 weights with bf16 / float16 x are master weights: cast inside the op, their gradients float32.
    weight_dtypes = {w1_ELF.dtype, w3_ELF.dtype, w2_EFL.dtype}
    if len(weight_dtypes) > 1 or not weight_dtypes <= {x_TL.dtype, torch.float32}:
        raise ValueError(
            f"w1_ELF, w3_ELF, w2_EFL have dtypes {w1_ELF.dtype}, {w3_ELF.dtype}, {w2_EFL.dtype}; "
            f"they must be one dtype, x's ({x_TL.dtype}) or float32"
        )
    tensors = dict(x_TL=x_TL, w1_ELF=w1_ELF, w3_ELF=w3_ELF, w2_EFL=w2_EFL, topk_idx_TK=topk_idx_TK,
                   topk_weight_TK=topk_weight_TK)
    for name, t in tensors.items():
        _check_device(name, t)
    check_same_device("moe_experts", "x_TL", tensors)


def _check_shadows(x_TL, masters, shadows, cast_in_kernel: bool) -> None:
    if cast_in_kernel:
        raise ValueError("moe_experts: shadows and cast_in_kernel are two ways to skip the cast pass; pass one")
    if len(shadows) != 3:
        raise ValueError(f"moe_experts: shadows must be (w1, w3, w2); got {len(shadows)} tensors")
    for name, w, s in zip(("w1_ELF", "w3_ELF", "w2_EFL"), masters, shadows):
        if w.dtype != torch.float32 or s.dtype != x_TL.dtype or s.shape != w.shape or not s.is_contiguous() \
                or s.device != w.device:
            raise ValueError(f"moe_experts: the shadow of {name} is {s.dtype} {tuple(s.shape)} on {s.device}; it "
                             f"must be a contiguous {x_TL.dtype} tensor of the float32 master's shape "
                             f"{tuple(w.shape)} on {w.device} (the master is {w.dtype})")


def moe_experts(
    x_TL: torch.Tensor,
    w1_ELF: torch.Tensor,
    w3_ELF: torch.Tensor,
    w2_EFL: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    topk_weight_TK: torch.Tensor,
    cast_in_kernel: bool = False,
    shadows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed-expert block: y[t] = sum_j p[t, j] * Expert_{idx[t, j]}(x[t]).

    Expert_e(z) = SiTU-GLU(z @ w1[e], z @ w3[e]) @ w2[e]. x_TL [T, L];
    w1_ELF, w3_ELF [E, L, F] and w2_EFL [E, F, L] in x's dtype, or float32 master weights (the products run
    in x's dtype; their gradients come back float32 from the float32 accumulators); topk_idx_TK
    int64 [T, k] with values in [0, E] (not checked: that would sync); the id E marks a slot no expert here
    takes (expert parallelism's other ranks): it adds nothing and costs no GEMM work;
    topk_weight_TK [T, k]. The permutation is computed on the device (no host
    sync); the GLU and the combine run in float32; deterministic (no atomics).
    cast_in_kernel: float32 master weights are read as they are and each tile rounded to x's dtype in the GEMMs
    (the same numbers as a cast pass, which then neither runs nor keeps its copies for the backward).
    shadows: (w1, w3, w2) in x's dtype, kept by the caller equal to the float32 master weights' casts
    (`titan_k3.models.k3.expert_shadows`): the GEMMs read them in place of a cast pass each forward, and the
    backward reads them too; the gradients still go to the masters, in float32.
    Returns y_TL [T, L] in x's dtype. Differentiable in x, w1, w3, w2 and
    topk_weight.
    """
    _check_moe(x_TL, w1_ELF, w3_ELF, w2_EFL, topk_idx_TK, topk_weight_TK)
    if shadows is not None:
        _check_shadows(x_TL, (w1_ELF, w3_ELF, w2_EFL), shadows, cast_in_kernel)
    n_tokens, top_k = topk_idx_TK.shape
    order_S, offsets_E = route_permutation(topk_idx_TK, w1_ELF.shape[0])
    n_slots = order_S.numel()
    inverse_S = torch.empty(n_slots, device=order_S.device, dtype=torch.int32)
    inverse_S[order_S] = torch.arange(n_slots, device=order_S.device, dtype=torch.int32)
    token_S = (order_S // top_k).to(torch.int32)
    params = (x_TL, w1_ELF, w3_ELF, w2_EFL, topk_weight_TK)
    save = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    # NOTE: the kernels read w1 and w3 with one set of strides.
    y, *_ = _moe_fwd_op(
        x_TL, w1_ELF.contiguous(), w3_ELF.contiguous(), w2_EFL, topk_weight_TK.contiguous(),
        order_S.to(torch.int32), token_S, inverse_S, offsets_E, save, cast_in_kernel,
        *(shadows if shadows is not None else ()),
    )
    return y
