"""KDA Triton kernels on a GPU in bfloat16 at the training shape, against float32/float64 references."""

import contextlib

import pytest
import torch

from kernels.kda import chunk_kda, chunk_kda_reference, l2norm, ops, recurrent_kda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_rms(a, b):
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def inputs(B, T, H, K, V, N=None, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, H, K, device="cuda", generator=gen)
    k = l2norm(torch.randn(B, T, H, K, device="cuda", generator=gen))
    v = torch.randn(B, T, H, V, device="cuda", generator=gen)
    g = -5 * torch.rand(B, T, H, K, device="cuda", generator=gen) ** 4  # mostly slow decay, down to -5
    beta = torch.rand(B, T, H, device="cuda", generator=gen)
    h0 = torch.randn(B if N is None else N, H, K, V, device="cuda", generator=gen) * 0.1
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def grads_of(fn, xs, h0, do, dS, **kw):
    leaves = [x.detach().clone().requires_grad_(True) for x in (*xs, h0)]
    o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    ((o.float() * do).sum() + (S.float() * dS).sum()).backward()
    return o, S, [x.grad for x in leaves]


def test_bf16_forward_at_training_shape():
    *xs, h0 = inputs(8, 4096, 8, 128, 128)
    with torch.no_grad():
        o, S = chunk_kda(*xs, initial_state=h0, output_final_state=True)
        o_ref, S_ref = chunk_kda_reference(*(x.float() for x in xs), initial_state=h0, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) < 1e-2
    assert rel_rms(S, S_ref) < 1e-2


def batch_layout(lengths):
    """(B, T, N documents, cu_seqlens): B2 T4096 unpacked for None, else one row packing `lengths`."""
    if lengths is None:
        return 2, 4096, None, None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    return 1, sum(lengths), len(lengths), cu


@pytest.mark.parametrize("lengths", [None, [1, 15, 64, 200, 4000, 3912]])
def test_bf16_gradients(lengths):
    B, T, N, cu = batch_layout(lengths)
    *xs, h0 = inputs(B, T, 8, 128, 128, N=N, seed=1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    do = torch.randn(B, T, 8, 128, device="cuda", generator=gen)
    dS = torch.randn(h0.shape, device="cuda", generator=gen)
    o, S, grads = grads_of(chunk_kda, xs, h0, do, dS, cu_seqlens=cu)
    o_ref, S_ref, grads_ref = grads_of(chunk_kda_reference, [x.float() for x in xs], h0, do, dS, cu_seqlens=cu)
    assert rel_rms(o, o_ref) < 1e-2 and rel_rms(S, S_ref) < 1e-2
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_ref):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 2e-2, name


def float32_errors(xs, h0) -> dict[str, float]:
    """Relative RMS errors of the float32 kernels against the float64 recurrence: o, S and every gradient."""
    do = torch.randn(*xs[2].shape, device="cuda", dtype=torch.float64)
    dS = torch.randn(h0.shape, device="cuda", dtype=torch.float64)
    o_ref, S_ref, grads_ref = grads_of(recurrent_kda, xs, h0.double(), do, dS)
    o, S, grads = grads_of(chunk_kda, [x.float() for x in xs], h0, do.float(), dS.float())
    errors = {"o": rel_rms(o, o_ref), "S": rel_rms(S, S_ref)}
    errors.update((name, rel_rms(a, b)) for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_ref))
    return errors


@pytest.mark.parametrize("decay", ["random", "constant -8", "resets"])
def test_float32_small_against_float64_recurrence(decay):
    """Random decays take the split tensor-core products; -8 everywhere and g = -1000 resets the exact column loop."""
    *xs, h0 = inputs(2, 300, 2, 64, 64, dtype=torch.float64, seed=3)
    if decay == "constant -8":
        xs[3] = torch.full_like(xs[3], -8.0)
    elif decay == "resets":
        xs[3][:, 5::37] = -1000.0  # not at row 0: the initial state keeps a gradient to compare
    errors = float32_errors(xs, h0)
    assert errors.pop("o") < 5e-3 and errors.pop("S") < 5e-3
    for name, err in errors.items():
        assert err < 2e-2, name


def test_hard_resets_bf16_finite():
    *xs, h0 = inputs(2, 1000, 4, 128, 128, seed=4)
    xs[3][:, ::37] = -1000.0
    o, S, grads = grads_of(chunk_kda, xs, h0, torch.randn(2, 1000, 4, 128, device="cuda"), torch.randn_like(h0))
    assert all(torch.isfinite(x).all() for x in (o, S, *grads))


# The fused safe gate's paths (kernels.kda.ops.LAUNCH["safe"]): bounded split products with the fused dense +
# intra-chunk backward (the default), the bounded kernels unfused, and the exact path of a precomputed g.
SAFE_PATHS = {"bounded-fused": dict(diag_dot=1, fuse_bwd=1), "exact": dict(diag_dot=0, fuse_bwd=0)}


@contextlib.contextmanager
def safe_path(path):
    kept = ops.LAUNCH["safe"]
    ops.LAUNCH["safe"] = {**kept, **SAFE_PATHS[path]}
    try:
        yield
    finally:
        ops.LAUNCH["safe"] = kept


def gate_params(H, K, seed):
    """A_log [H] and dt_bias [H, K] float32 as docs/k3.md §2.1 initialises them (dt log-uniform in [1e-3, 1e-1])."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    A_log = torch.randn(H, device="cuda", generator=gen) * 0.3
    dt = torch.exp(torch.empty(H, K, device="cuda").uniform_(-6.9, -2.3, generator=gen))
    return A_log, dt + torch.log(-torch.expm1(-dt))


def safe_grads_of(fn, xs, h0, A_log, dt_bias, do, dS, **kw):
    leaves = [x.detach().clone().requires_grad_(True) for x in (*xs, h0, A_log, dt_bias)]
    o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, A_log=leaves[6], dt_bias=leaves[7],
              gate_lower_bound=-5.0, **kw)
    ((o.float() * do).sum() + (S.float() * dS).sum()).backward()
    return o, S, [x.grad for x in leaves]


@pytest.mark.parametrize("path", list(SAFE_PATHS))
def test_safe_gate_bf16_forward_at_training_shape(path):
    *xs, h0 = inputs(8, 4096, 8, 128, 128, seed=5)
    xs[3] = torch.randn_like(xs[3]) * 3  # the raw gate: g = -5 sigmoid(.) spans (-5, 0)
    A_log, dt_bias = gate_params(8, 128, seed=6)
    kw = dict(initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=-5.0)
    with torch.no_grad(), safe_path(path):
        o, S = chunk_kda(*xs, **kw)
        o_ref, S_ref = chunk_kda_reference(*(x.float() for x in xs), **kw)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_rms(o, o_ref) < 1e-2
    assert rel_rms(S, S_ref) < 1e-2


@pytest.mark.parametrize("path", list(SAFE_PATHS))
@pytest.mark.parametrize("lengths", [None, [1, 15, 64, 200, 4000, 3912]])
def test_safe_gate_bf16_gradients(path, lengths):
    """Every gradient (q, k, v, the raw gate, beta, h0, A_log, dt_bias) at B2 T4096 H8 and packed documents;
    the raw gate pushes a third of the tokens to the lower bound (sigmoid of +-30)."""
    B, T, N, cu = batch_layout(lengths)
    *xs, h0 = inputs(B, T, 8, 128, 128, N=N, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    g_raw = torch.randn(B, T, 8, 128, device="cuda", generator=gen) * 3
    g_raw[:, ::3] = 30.0
    xs[3] = g_raw.bfloat16()
    A_log, dt_bias = gate_params(8, 128, seed=9)
    do = torch.randn(B, T, 8, 128, device="cuda", generator=gen)
    dS = torch.randn(h0.shape, device="cuda", generator=gen)
    with safe_path(path):
        o, S, grads = safe_grads_of(chunk_kda, xs, h0, A_log, dt_bias, do, dS, cu_seqlens=cu)
    o_ref, S_ref, grads_ref = safe_grads_of(
        chunk_kda_reference, [x.float() for x in xs], h0, A_log, dt_bias, do, dS, cu_seqlens=cu,
    )
    assert rel_rms(o, o_ref) < 1e-2 and rel_rms(S, S_ref) < 1e-2
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"], grads, grads_ref):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 2e-2, name


@pytest.mark.parametrize("B, T, H", [(1, 16, 1), (2, 300, 8)])
def test_float32_wide_gradients_against_float64_recurrence(B, T, H):
    """K = 128 (two K tiles) in float32 through the default unfused backward: pipelined, dq, dk, dg went 40-120%
    off on an H200 with Triton 3.6, down to one 16-token chunk (kernels/kda/ops.py `_dchunk_launch`)."""
    *xs, h0 = inputs(B, T, H, 128, 128, dtype=torch.float64, seed=12)
    errors = float32_errors(xs, h0)
    assert errors.pop("o") < 1e-4 and errors.pop("S") < 1e-4
    for name, err in errors.items():
        assert err < 1e-4, name


@pytest.mark.parametrize("path", list(SAFE_PATHS))
@pytest.mark.parametrize("pin", ["random", "at the bound"])
def test_safe_gate_float32_against_float64_recurrence(path, pin):
    """float32 kernels vs the float64 recurrence; "at the bound": g = -5 on every token (sigmoid of 60), the
    widest span a bounded block meets. The saturated gate's own gradients (~0) are left out there."""
    *xs, h0 = inputs(2, 300, 2, 128, 128, dtype=torch.float64, seed=10)
    xs[3] = torch.randn_like(xs[3]) * 3 if pin == "random" else torch.full_like(xs[3], 60.0)
    A_log, dt_bias = (x.double() for x in gate_params(2, 128, seed=11))
    do = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.float64)
    dS = torch.randn(h0.shape, device="cuda", dtype=torch.float64)
    o_ref, S_ref, grads_ref = safe_grads_of(recurrent_kda, xs, h0.double(), A_log, dt_bias, do, dS)
    with safe_path(path):
        o, S, grads = safe_grads_of(
            chunk_kda, [x.float() for x in xs], h0, A_log.float(), dt_bias.float(), do.float(), dS.float(),
        )
    assert rel_rms(o, o_ref) < 5e-3 and rel_rms(S, S_ref) < 5e-3
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"], grads, grads_ref):
        assert torch.isfinite(a).all(), name
        if pin == "random" or name not in ("g", "A_log", "dt_bias"):
            assert rel_rms(a, b) < 2e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_intra_products_in_bfloat16_passes_match_tf32_passes(dtype):
    """The decayed-product gradients in three bfloat16 passes (LAUNCH["dintra"]["split"] = 1, the default) against
    three TF32 passes (split 0) at the k3-mini layer shape with the safe gate and packed documents: every gradient
    within 2e-3 (relative RMS) of the other (the inputs' own rounding: ~4e-3 bf16, ~5e-4 fp16)."""
    B, T, N, cu = batch_layout([1, 15, 64, 200, 4000, 3912])
    *xs, h0 = inputs(B, T, 4, 128, 128, N=N, seed=13, dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(14)
    xs[3] = (torch.randn(B, T, 4, 128, device="cuda", generator=gen) * 3).to(dtype)
    A_log, dt_bias = gate_params(4, 128, seed=15)
    do = torch.randn(B, T, 4, 128, device="cuda", generator=gen)
    dS = torch.randn(h0.shape, device="cuda", generator=gen)
    results = {}
    kept = dict(ops.LAUNCH["dintra"])
    try:
        for split in (0, 1):
            ops.LAUNCH["dintra"] = {**kept, "split": split}
            results[split] = safe_grads_of(chunk_kda, xs, h0, A_log, dt_bias, do, dS, cu_seqlens=cu)
    finally:
        ops.LAUNCH["dintra"] = kept
    (_, _, tf32), (_, _, bf16) = results[0], results[1]
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias"], bf16, tf32):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 2e-3, name
