"""Pure-PyTorch Kimi Delta Attention: the token-by-token ground truth and the chunked CPU path.

The recurrence (docs/k3.md §2.1), per sequence and head, state S [K, V]:

    S_t = diag(exp(g_t)) S_{t-1}
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

Legend: B batch, T tokens, H heads, K key width, V value width, N sequences,
C chunk size (64), NC chunks per sequence.

Chunked form used by `chunk_kda_reference` and by the Triton kernels. Inside
one chunk, with b_i = sum_{s<=i} g_s (chunk-local cumulative log decay, so
b is non-increasing) and S the state entering the chunk:

    S_i = diag(exp(b_i)) S + sum_{j<=i} diag(exp(b_i - b_j)) k_j u_j^T
    (I + diag(beta) A) U = diag(beta) (V - (exp(b) * K) S)
        A_ij  = sum_c k_ic k_jc exp(b_ic - b_jc)          for i > j, else 0
    O      = (scale * exp(b) * Q) S + M U
        M_ij  = scale * sum_c q_ic k_jc exp(b_ic - b_jc)   for i >= j, else 0
    S_next = diag(exp(b_C)) S + (exp(b_C - b) * K)^T U

Every exponent above is <= 0 (b_i <= b_j for i >= j), which keeps the math
finite for any decay down to hard resets (g = -1000).

The math stays in float32 (float64) under the trainer's bf16 autocast too, which
casts matmul and einsum operands to bf16: the chunk loop's matrix products and the
solve's backward run in `kernels.float32_matmul.matmul_float32`, A and M (a
decay per i, j and c) too, as a product per row; the token-by-token recurrence
is products and sums, which autocast leaves alone.
"""

import torch
import torch.nn.functional as F

from kernels.device import check_same_device
from kernels.float32_matmul import matmul_float32

CHUNK = 64
L2NORM_EPS = 1e-6
DEFAULT_GATE_LOWER_BOUND = -5.0


@torch.library.custom_op("kernels_kda::solve_unit_lower", mutates_args=())
def _solve_unit_lower(L: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """L^-1 R: L [..., C, C] unit lower-triangular (its diagonal and upper part are not read), R [..., C, W].

    NOTE: an op of its own for its backward, whose product runs in `matmul_float32`: autograd's own backward of
    the solve multiplies with a matmul, which a compiled region's backward runs under the forward's autocast.
    """
    return torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)


@_solve_unit_lower.register_fake
def _(L, R):
    return torch.linalg.solve_triangular(L, R, upper=False, unitriangular=True)  # its layout (column-major)


def _solve_setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output)


def _solve_backward(ctx, grad):
    L, X = ctx.saved_tensors
    dR = torch.linalg.solve_triangular(L.mT, grad, upper=True, unitriangular=True)  # autocast leaves solves alone
    dL = -matmul_float32(dR, X.mT).tril(-1) if ctx.needs_input_grad[0] else None
    return dL, dR


_solve_unit_lower.register_autograd(_solve_backward, setup_context=_solve_setup_context)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, computed in at least float32."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = DEFAULT_GATE_LOWER_BOUND,
) -> torch.Tensor:
    """The KDA log decay from the raw gate projection, in float32 (or float64).

    g_raw [B, T, H, K], A_log [H], dt_bias [H, K] or None.
    lower_bound set: g = lb * sigmoid(exp(A_log)[h] * (g_raw + dt_bias[h])) (the safe gate, in [lb, 0));
    lower_bound None: g = -exp(A_log)[h] * softplus(g_raw + dt_bias[h]).
    """
    dtype = torch.float64 if g_raw.dtype == torch.float64 else torch.float32
    x = g_raw.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype)
    a = A_log.to(dtype).exp()[:, None]
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def check_cu_seqlens_values(ends: list[int], T: int) -> None:
    """Raises ValueError unless the document boundaries rise from 0 to T (never fall: a zero-length document,
    two equal boundaries, has no tokens and is legal)."""
    if ends[0] != 0 or ends[-1] != T or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {ends}")


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, *, documents=None) -> int:
    """Validates shapes and dtypes; returns the number of sequences N. Raises ValueError.

    documents: N of packed documents described by a chunk layout (`chunk_kda`'s chunk_layout) instead of
    cu_seqlens, which is then neither checked nor read.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if not 1 <= K <= 256 or V > 256:
        raise ValueError(f"K must be in 1..256 and V <= 256, got K={K}, V={V}")
    named = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state, A_log=A_log, dt_bias=dt_bias)
    for name, t in named.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
    # NOTE: cu_seqlens may live on the host (chunk_kda reads it there without waiting for the GPU).
    check_same_device("chunk_kda", "q", named)
    N = B
    if documents is not None:
        if B != 1:
            raise ValueError(f"chunk_layout needs B == 1 (packed documents), got B={B}")
        N = documents
    elif cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed documents), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int64, torch.int32) or len(cu_seqlens) < 2:
            raise ValueError(
                f"cu_seqlens must be an int64 [N+1] tensor, got dtype {cu_seqlens.dtype} shape {tuple(cu_seqlens.shape)}"
            )
        N = len(cu_seqlens) - 1
        if not torch.compiler.is_compiling():
            # NOTE: reading the values would break a compiled graph; there the Triton op checks
            # them when it runs (chunk_layout), before any kernel starts.
            check_cu_seqlens_values(cu_seqlens.tolist(), T)
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = [{N}, {H}, {K}, {V}], got {tuple(initial_state.shape)}"
        )
    if A_log is None and dt_bias is not None:
        raise ValueError("dt_bias is only used with the fused gate: pass A_log too")
    if A_log is not None and A_log.shape != (H,):
        raise ValueError(f"A_log must be [H] = [{H}], got {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.shape != (H, K):
        raise ValueError(f"dt_bias must be [H, K] = [{H}, {K}], got {tuple(dt_bias.shape)}")
    return N


def _prepare(q, k, g, beta, A_log, dt_bias, gate_lower_bound, use_qk_l2norm, beta_is_logit):
    """Applies the optional fused transforms exactly as the kernels define them."""
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias, gate_lower_bound)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if beta_is_logit:
        beta = torch.sigmoid(beta.float() if beta.dtype in (torch.float16, torch.bfloat16) else beta)
    return q, k, g, beta


def _compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def recurrent_kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    A_log=None, dt_bias=None, gate_lower_bound=DEFAULT_GATE_LOWER_BOUND, use_qk_l2norm=False, beta_is_logit=False,
):
    """Token-by-token KDA, the ground truth. Same signature and shapes as `chunk_kda`.

    Computes in float64 when any input is float64, else float32. Returns (o [B, T, H, V]
    in v's dtype, final state [N, H, K, V] in the compute dtype or None).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    q, k, g, beta = _prepare(q, k, g, beta, A_log, dt_bias, gate_lower_bound, use_qk_l2norm, beta_is_logit)
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    bounds = [(0, T)] * B if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    o = torch.zeros(B, T, H, V, dtype=dtype, device=q.device)
    finals = []
    for n, (start, end) in enumerate(bounds):
        b = 0 if cu_seqlens is not None else n
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(dtype)
        for t in range(start, end):
            S = g[b, t].exp()[..., None] * S
            kt = k[b, t]
            err = v[b, t] - (S * kt[..., None]).sum(-2)
            S = S + beta[b, t][:, None, None] * kt[..., None] * err[:, None, :]
            o[b, t] = (S * (scale * q[b, t])[..., None]).sum(-2)
        finals.append(S)
    final = (torch.stack(finals) if finals else q.new_zeros(0, H, K, V)) if output_final_state else None
    return o.to(v.dtype), final


def _chunked_forward(q, k, v, g, beta, scale, S0):
    """KDA over sequences padded to a multiple of CHUNK. All inputs in the compute dtype.

    q, k, g [N, T, H, K]; v [N, T, H, V]; beta [N, T, H]; S0 [N, H, K, V] or None.
    Returns o [N, T, H, V] and the final state [N, H, K, V].
    """
    N, T, H, K = q.shape
    V = v.shape[-1]
    NC, C = T // CHUNK, CHUNK

    def chunks(x):  # [N, T, H, ...] -> [N, H, NC, C, ...]
        return x.reshape(N, NC, C, H, *x.shape[3:]).movedim(3, 1)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    b = g.cumsum(-2)
    b_last = b[..., -1:, :]
    # Pairwise decays exp(b_i - b_j) only where i >= j; the masked exponent is
    # replaced before exp so that neither the value nor its gradient overflows.
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = b[..., :, None, :] - b[..., None, :, :]
    decay = torch.where(incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
    # NOTE: sum_c x_ic k_jc decay_ijc as a product per row i ([1, c] x [c, j], as einsum ran it), in the float32
    # op: autocast leaves it alone, and torch's flop counter sees the 2 C^2 K of each.
    kd_ICJ = (k[..., None, :, :] * decay).transpose(-1, -2)
    A = matmul_float32(k[..., :, None, :], kd_ICJ).squeeze(-2).tril(-1)
    M = scale * matmul_float32(q[..., :, None, :], kd_ICJ).squeeze(-2)

    L = torch.eye(C, dtype=q.dtype, device=q.device) + beta[..., None] * A
    rhs = beta[..., None] * torch.cat([v, k * b.exp()], dim=-1)
    W = _solve_unit_lower(L, rhs)
    Wv, Wk = W[..., :V], W[..., V:]
    q_dec = scale * q * b.exp()
    k_dec = k * (b_last - b).exp()
    last_decay = b_last.squeeze(-2).exp()[..., None]  # [N, H, NC, K, 1]

    S = q.new_zeros(N, H, K, V) if S0 is None else S0
    outs = []
    for n in range(NC):
        U = Wv[:, :, n] - matmul_float32(Wk[:, :, n], S)
        outs.append(matmul_float32(q_dec[:, :, n], S) + matmul_float32(M[:, :, n], U))
        S = last_decay[:, :, n] * S + matmul_float32(k_dec[:, :, n].transpose(-1, -2), U)
    o = torch.stack(outs, dim=2).movedim(1, 3).reshape(N, T, H, V)
    return o, S


def _pad_time(x: torch.Tensor, T_pad: int) -> torch.Tensor:
    """Zero-pads dim 1 to T_pad. Zero k, beta and g leave the state unchanged, so padding is exact."""
    pad = T_pad - x.shape[1]
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)


def chunk_kda_reference(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    A_log=None, dt_bias=None, gate_lower_bound=DEFAULT_GATE_LOWER_BOUND, use_qk_l2norm=False, beta_is_logit=False,
):
    """Chunked KDA in plain PyTorch: differentiable, any T, packed documents. Same contract as `chunk_kda`.

    q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; initial_state [N, H, K, V];
    cu_seqlens int64 [N+1] with B == 1 (zero-length documents allowed: their final state is their initial one). With A_log given, g is the raw gate (see `kda_gate`);
    use_qk_l2norm normalises q and k over K; beta_is_logit applies a sigmoid to beta.
    Computes in float64 when any input is float64, else float32. Returns (o [B, T, H, V]
    in v's dtype, final state [N, H, K, V] in the compute dtype, or None).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias)
    q, k, g, beta = _prepare(q, k, g, beta, A_log, dt_bias, gate_lower_bound, use_qk_l2norm, beta_is_logit)
    dtype = _compute_dtype(q, k, v, g, beta, initial_state)
    B, T, H, K = q.shape
    scale = K**-0.5 if scale is None else scale
    xs = [x.to(dtype) for x in (q, k, v, g, beta)]
    S0 = None if initial_state is None else initial_state.to(dtype)

    if cu_seqlens is None:
        # NOTE: at least one chunk, so that T = 0 runs too: a zero chunk leaves the state as it was.
        T_pad = max(CHUNK, -(-T // CHUNK) * CHUNK)
        o, S = _chunked_forward(*(_pad_time(x, T_pad) for x in xs), scale, S0)
        o = o[:, :T]
    else:
        # One padded row per document, so that every document runs in the same batched chunk loop.
        ends = cu_seqlens.tolist()
        lengths = [e - s for s, e in zip(ends[:-1], ends[1:])]
        T_pad = max(CHUNK, -(-max(lengths) // CHUNK) * CHUNK)
        rows = [torch.stack([_pad_time(x[:, s:e], T_pad)[0] for s, e in zip(ends[:-1], ends[1:])]) for x in xs]
        o_rows, S = _chunked_forward(*rows, scale, S0)
        o = torch.cat([o_rows[n, :n_len] for n, n_len in enumerate(lengths)])[None]
    return o.to(v.dtype), (S if output_final_state else None)
