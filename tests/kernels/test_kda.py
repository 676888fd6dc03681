"""KDA: the chunked PyTorch reference and the Triton kernels against the float64 token-by-token recurrence.

On a machine without CUDA the Triton kernels run in the interpreter (tests/kernels/conftest.py).
"""

import pytest
import torch

from kernels.kda import chunk_kda, chunk_kda_reference, kda_gate, l2norm, ops, recurrent_kda
from kda_launch import launch_settings


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(mean((a-b)^2)) / sqrt(mean(b^2)); an exactly-zero b (e.g. the decay gradient of
    a one-token sequence from a zero state) is compared absolutely."""
    a, b = a.double(), b.double()
    err, ref = (a - b).pow(2).mean().sqrt().item(), b.pow(2).mean().sqrt().item()
    return err / ref if ref > 0 else err * 1e6


def make_inputs(B, T, H, K, V, *, N=None, dtype=torch.float64, seed=0, g_min=-5.0, device="cpu"):
    """Random KDA inputs with unit-norm keys, a decay in [g_min, 0) and beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = randn(B, T, H, K)
    k = l2norm(randn(B, T, H, K))
    v = randn(B, T, H, V)
    g = g_min * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    h0 = randn(B if N is None else N, H, K, V) * 0.5
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, g, beta)] + [h0.to(device=device, dtype=torch.float32 if dtype != torch.float64 else dtype)]


def run_with_grads(fn, q, k, v, g, beta, h0, *, seed=1, **kwargs):
    """Runs fn, backpropagates random cotangents of o and the final state, returns outputs and gradients."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta)]
    h0_leaf = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, S = fn(*leaves, initial_state=h0_leaf, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S)
    ((o * do).sum() + (S * dS).sum()).backward()
    grads = [x.grad for x in leaves] + ([] if h0_leaf is None else [h0_leaf.grad])
    return o, S, grads


GRAD_NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


@pytest.mark.parametrize("T", [1, 63, 65, 130])
@pytest.mark.parametrize("with_h0", [False, True])
def test_reference_chunked_matches_recurrent(T, with_h0):
    q, k, v, g, beta, h0 = make_inputs(2, T, 2, 16, 8, seed=T)
    h0 = h0 if with_h0 else None
    o_ref, S_ref, grads_ref = run_with_grads(recurrent_kda, q, k, v, g, beta, h0)
    o, S, grads = run_with_grads(chunk_kda_reference, q, k, v, g, beta, h0)
    assert rel_rms(o, o_ref) < 1e-10
    assert rel_rms(S, S_ref) < 1e-10
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_rms(a, b) < 1e-9, name


def test_reference_packed_documents_match_separate_runs():
    lengths = [1, 15, 64, 200]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 16, 8, N=len(lengths), seed=3)
    o_ref, S_ref, grads_ref = run_with_grads(recurrent_kda, q, k, v, g, beta, h0, cu_seqlens=cu)
    o, S, grads = run_with_grads(chunk_kda_reference, q, k, v, g, beta, h0, cu_seqlens=cu)
    assert rel_rms(o, o_ref) < 1e-10
    assert rel_rms(S, S_ref) < 1e-10
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_rms(a, b) < 1e-9, name
    # No state crosses a boundary: document 2 alone, from its own initial state, gives the same rows.
    s, e = cu[2].item(), cu[3].item()
    o_doc, S_doc = recurrent_kda(
        *(x[:, s:e] for x in (q, k, v, g, beta)), initial_state=h0[2:3], output_final_state=True
    )
    assert torch.allclose(o_ref[:, s:e], o_doc, rtol=0, atol=1e-12)
    assert torch.allclose(S_ref[2:3], S_doc, rtol=0, atol=1e-12)


def test_reference_recurrence_step_by_hand():
    """One token from a known state: the recurrence written out, so the ground truth itself is pinned."""
    q, k, v, g, beta, h0 = make_inputs(1, 1, 1, 4, 3, seed=5)
    S = g[0, 0, 0].exp()[:, None] * h0[0, 0]
    S = S + beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0] - S.T @ k[0, 0, 0])
    o = S.T @ (q[0, 0, 0] * 4**-0.5)
    o_rec, S_rec = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.allclose(o_rec[0, 0, 0], o, atol=1e-14)
    assert torch.allclose(S_rec[0, 0], S, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_low_precision_cpu(dtype):
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 32, 32, seed=7)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    args = [x.to(dtype) for x in (q, k, v, g, beta)]
    o, S = chunk_kda_reference(*args, initial_state=h0.float(), output_final_state=True)
    assert o.dtype == dtype and S.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_rms(o, o_ref) < tol
    assert rel_rms(S, S_ref) < tol


def check_fused_options_equal_unfused(fused_kda, unfused_kda, inputs, *, seed, out_tol, grad_tol):
    """`fused_kda` with the gate, l2 norm and beta sigmoid fused in against `unfused_kda` fed their results.

    Outputs and the gradients of every input, A_log and dt_bias included, agree to out_tol / grad_tol,
    with and without the gate's lower bound.
    """
    q, k, v, g_raw, beta_logit, h0 = inputs
    q, k = q * 3, k * 2  # not unit norm: the fused l2 norm has work to do
    g_raw, beta_logit = g_raw * 2 + 3, beta_logit * 8 - 4
    H, K = q.shape[2], q.shape[3]
    gen = torch.Generator().manual_seed(seed)
    A_log = torch.randn(H, generator=gen, dtype=q.dtype).to(q.device).requires_grad_(True)
    dt_bias = torch.randn(H, K, generator=gen, dtype=q.dtype).to(q.device).requires_grad_(True)
    for lb in (-5.0, None):
        fused_fn = lambda *a, **kw: fused_kda(  # noqa: E731
            *a, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=lb, use_qk_l2norm=True, beta_is_logit=True, **kw
        )
        unfused_fn = lambda q, k, v, g, beta, **kw: unfused_kda(  # noqa: E731
            l2norm(q), l2norm(k), v, kda_gate(g, A_log, dt_bias, lb), torch.sigmoid(beta), **kw
        )
        o_f, S_f, grads_f = run_with_grads(fused_fn, q, k, v, g_raw, beta_logit, h0)
        dA_f, ddt_f = A_log.grad.clone(), dt_bias.grad.clone()
        A_log.grad = dt_bias.grad = None
        o_u, S_u, grads_u = run_with_grads(unfused_fn, q, k, v, g_raw, beta_logit, h0)
        assert rel_rms(o_f, o_u) < out_tol and rel_rms(S_f, S_u) < out_tol
        for name, a, b in zip(GRAD_NAMES, grads_f, grads_u):
            assert rel_rms(a, b) < grad_tol, name
        assert rel_rms(dA_f, A_log.grad) < grad_tol and rel_rms(ddt_f, dt_bias.grad) < grad_tol
        A_log.grad = dt_bias.grad = None


def test_reference_fused_options_equal_unfused():
    inputs = make_inputs(1, 70, 2, 16, 8, seed=11)
    check_fused_options_equal_unfused(chunk_kda_reference, recurrent_kda, inputs, seed=2, out_tol=1e-10, grad_tol=1e-9)


def test_kda_gate_values():
    g_raw = torch.tensor([[[[-50.0, 0.0, 50.0]]]], dtype=torch.float64)
    A_log = torch.zeros(1, dtype=torch.float64)
    safe = kda_gate(g_raw, A_log, None, -5.0)
    assert torch.allclose(safe, torch.tensor([-0.0, -2.5, -5.0], dtype=torch.float64).view(1, 1, 1, 3), atol=1e-12)
    plain = kda_gate(g_raw, A_log, None, None)
    assert torch.allclose(plain, -torch.nn.functional.softplus(g_raw))


def test_reference_hard_reset_is_finite_and_forgets():
    """g = -1000 wipes the state: the chunked path stays finite and matches the recurrence."""
    q, k, v, g, beta, h0 = make_inputs(1, 130, 2, 16, 8, seed=13)
    g = g.clone()
    g[:, 70] = -1000.0
    o_ref, S_ref, grads_ref = run_with_grads(recurrent_kda, q, k, v, g, beta, h0)
    o, S, grads = run_with_grads(chunk_kda_reference, q, k, v, g, beta, h0)
    assert all(torch.isfinite(x).all() for x in (o, S, *grads))
    assert rel_rms(o, o_ref) < 1e-10
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_rms(a, b) < 1e-9, name
    # After the reset the initial state no longer matters for later tokens.
    o2, _ = recurrent_kda(q, k, v, g, beta, initial_state=h0 * 0, output_final_state=True)
    assert torch.allclose(o_ref[:, 70:], o2[:, 70:], atol=1e-12)
    assert not torch.allclose(o_ref[:, :70], o2[:, :70], atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(beta=torch.zeros(1, 5, 3)), "beta must be"),
        (dict(initial_state=torch.zeros(2, 2, 8, 4)), "initial_state must be"),
        (dict(cu_seqlens=torch.tensor([0, 3], dtype=torch.int64)), "cu_seqlens must rise"),
        (dict(dt_bias=torch.zeros(2, 8)), "dt_bias is only used"),
    ],
)
def test_reference_bad_input_names_the_argument(change, match):
    args = dict(q=torch.zeros(1, 5, 2, 8), k=torch.zeros(1, 5, 2, 8), v=torch.zeros(1, 5, 2, 4),
                g=torch.zeros(1, 5, 2, 8), beta=torch.zeros(1, 5, 2))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        chunk_kda_reference(**args)


def test_triton_checks_document_bounds_even_when_compiled():
    """Under torch.compile the input check cannot read cu_seqlens; the layout built from it checks what it reads."""
    from kernels.kda.common import chunk_layout

    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        chunk_layout(1, 128, torch.tensor([0, 100, 64, 128]), "cpu")
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        chunk_layout(1, 128, torch.tensor([0, 100]), "cpu")
    assert chunk_layout(1, 128, torch.tensor([0, 100, 128]), "cpu")[3:] == (2, 3)


# ---------------------------------------------------------------------------------------------
# Triton kernels (the interpreter on CPU), float32, against the float64 recurrence.

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OUT_TOL, GRAD_TOL = 5e-3, 2e-2


def check_triton_against_recurrent(B, T, H, K, V, *, lengths=None, with_h0=True, seed=0, g_min=-5.0, g_edit=None):
    N = None if lengths is None else len(lengths)
    q, k, v, g, beta, h0 = make_inputs(B, T, H, K, V, N=N, seed=seed, g_min=g_min)
    if g_edit is not None:
        g = g_edit(g.clone())
    h0 = h0 if with_h0 else None
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    o_ref, S_ref, grads_ref = run_with_grads(recurrent_kda, q, k, v, g, beta, h0, cu_seqlens=cu)
    args = [x.to(DEVICE, torch.float32) for x in (q, k, v, g, beta)]
    o, S, grads = run_with_grads(
        chunk_kda, *args, None if h0 is None else h0.to(DEVICE, torch.float32),
        cu_seqlens=None if cu is None else cu.to(DEVICE),
    )
    assert all(torch.isfinite(x).all() for x in (o, S, *grads))
    assert rel_rms(o.cpu(), o_ref) < OUT_TOL
    assert rel_rms(S.cpu(), S_ref) < OUT_TOL
    for name, a, b in zip(GRAD_NAMES, grads, grads_ref):
        assert rel_rms(a.cpu(), b) < GRAD_TOL, name


@pytest.mark.parametrize("B, T, with_h0", [(1, 1, False), (1, 63, True), (2, 65, False), (1, 130, True)])
def test_chunk_kda_matches_recurrent(B, T, with_h0):
    check_triton_against_recurrent(B, T, 2, 32, 32, with_h0=with_h0, seed=T)


def test_chunk_kda_packed_documents():
    check_triton_against_recurrent(1, 280, 1, 32, 32, lengths=[1, 15, 64, 200], seed=4)


def test_state_walk_tile_fills_the_sms():
    assert ops.fill_bv(64, 128, walks=8 * 4, sms=132) == 32  # k3-mini B8 x H4: 64 -> 128 programs, one wave
    assert ops.fill_bv(64, 128, walks=8 * 8, sms=132) == 64  # B8 x H8: 128 programs already fill it
    assert ops.fill_bv(64, 128, walks=1, sms=132) == 32  # never below 32
    assert ops.fill_bv(64, 128, walks=1, sms=0) == 64  # no SM count (CPU interpreter): the table's tile


def test_dense_gradient_kernel_is_unpipelined_for_wide_float_inputs():
    """Pipelined over two K tiles, float32 took dq, dk, dg 40-120% off on an H200 (Triton 3.6): such launches
    run unpipelined; bf16 (training) and one-tile widths keep the table's measured-best pipelining."""
    table = ops.LAUNCH["dchunk"]["num_stages"]
    assert table > 1  # otherwise the cases below prove nothing
    assert ops._dchunk_launch(128, 128, torch.float32)["num_stages"] == 1
    assert ops._dchunk_launch(128, 128, torch.float16)["num_stages"] == 1
    assert ops._dchunk_launch(128, 128, torch.bfloat16)["num_stages"] == table
    assert ops._dchunk_launch(64, 64, torch.float32)["num_stages"] == table


def test_chunk_kda_narrow_state_walk_tiles(monkeypatch):
    # Pretend to be a GPU of many SMs, so that both state walks run 32-wide V tiles (4 per head at V = 128).
    monkeypatch.setattr(ops, "_sm_count", lambda device: 10**6)
    check_triton_against_recurrent(2, 130, 1, 64, 128, seed=9)


def test_chunk_kda_wide_heads_and_uneven_widths():
    check_triton_against_recurrent(1, 70, 1, 128, 64, seed=5)
    check_triton_against_recurrent(1, 70, 1, 24, 40, seed=6)


# NOTE: at -7.4 the interpreter's float32 matmul overflows in the products above the diagonal
# (exp(b_i - b_j) for i < j), which the kernel discards; numpy warns about them.
@pytest.mark.filterwarnings("ignore:overflow encountered in matmul", "ignore:invalid value encountered in matmul")
@pytest.mark.parametrize("g_const", [-5.0, -7.4, -8.0])
def test_chunk_kda_steep_constant_decays(g_const):
    """The safe gate's lower bound, the steepest decay whose 16-row blocks still take the split product
    (8 decays of 7.4 = 59.2 <= 60 around the middle row), and one just past it (the exact column loop)."""
    check_triton_against_recurrent(1, 130, 1, 32, 32, seed=8, g_edit=lambda g: g * 0 + g_const)


def test_chunk_kda_hard_resets():
    """g = -1000 resets inside blocks and at chunk edges: the blocks that hold one take the exact column loop."""

    def resets(g):
        g[:, [0, 17, 63, 64, 100]] = -1000.0
        return g

    check_triton_against_recurrent(1, 130, 1, 32, 32, seed=9, g_edit=resets)


# The fused safe gate's three backward/forward paths (ops.LAUNCH["safe"]): the bounded split products with the
# fused dense + intra-chunk gradient kernel (the default), the bounded kernels unfused, and the exact path.
SAFE_PATHS = {"bounded-fused": dict(diag_dot=1, fuse_bwd=1), "exact": dict(diag_dot=0, fuse_bwd=0)}


def check_safe_gate_against_recurrent(
    B, T, H, K, V, *, lengths=None, with_h0=True, seed=0, lower_bound=-5.0, pin=None, path="bounded-fused",
):
    """chunk_kda with the safe gate fused in against the float64 recurrence fed the same raw gate.

    pin: None (random raw gate); "bound" (the sigmoid saturated, g = lower_bound exactly on every token and
    channel); "near" (sigmoid 0.9995 everywhere: g within 0.05% of the bound, the gate's gradient still
    measurable); "mixed" (runs of 50 tokens alternating between "near" and sigmoid 0.0005, decay ~0).
    Compares o, the final state and the gradients of q, k, v, the raw gate, beta, the initial state,
    A_log and dt_bias; "bound" leaves out the last three's gradients (a saturated sigmoid's, ~1e-26 in
    float64 and 0 in float32) and only asks them to be finite.
    """
    N = None if lengths is None else len(lengths)
    q, k, v, g_raw, beta, h0 = make_inputs(B, T, H, K, V, N=N, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    g_raw = torch.randn(g_raw.shape, generator=gen, dtype=torch.float64) * 2
    A_log = torch.randn(H, generator=gen, dtype=torch.float64) * 0.5
    dt_bias = torch.randn(H, K, generator=gen, dtype=torch.float64)
    if pin is not None:
        # the sigmoid's argument exp(A_log) (g_raw + dt_bias) set to +-60 or +-7.6 (sigmoid 1 - 5e-4)
        x = {"bound": 60.0, "near": 7.6, "mixed": 7.6}[pin] * torch.ones_like(g_raw)
        if pin == "mixed":
            x = torch.where((torch.arange(T) // 50 % 2 == 0)[None, :, None, None], x, -x)
        g_raw = x / A_log.exp()[:, None] - dt_bias
    h0 = h0 if with_h0 else None
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)

    def run(fn, xs, h, A, dt):
        A, dt = A.clone().requires_grad_(True), dt.clone().requires_grad_(True)
        o, S, grads = run_with_grads(fn, *xs, h, A_log=A, dt_bias=dt, gate_lower_bound=lower_bound, cu_seqlens=cu)
        return o, S, grads + [A.grad, dt.grad]

    o_ref, S_ref, grads_ref = run(recurrent_kda, (q, k, v, g_raw, beta), h0, A_log, dt_bias)
    with launch_settings(safe=SAFE_PATHS[path]):
        o, S, grads = run(
            chunk_kda, [x.to(DEVICE, torch.float32) for x in (q, k, v, g_raw, beta)],
            None if h0 is None else h0.to(DEVICE, torch.float32),
            A_log.to(DEVICE, torch.float32), dt_bias.to(DEVICE, torch.float32),
        )
    assert all(torch.isfinite(x).all() for x in (o, S, *grads))
    assert rel_rms(o.cpu(), o_ref) < OUT_TOL
    assert rel_rms(S.cpu(), S_ref) < OUT_TOL
    names = GRAD_NAMES[:5] + (["initial_state"] if with_h0 else []) + ["A_log", "dt_bias"]
    for name, a, b in zip(names, [x for x in grads if x is not None], [x for x in grads_ref if x is not None]):
        if pin != "bound" or name not in ("g", "A_log", "dt_bias"):
            assert rel_rms(a.cpu(), b) < GRAD_TOL, name


def test_safe_gate_paths_are_chosen_by_the_bound_and_the_launch_table():
    gate = lambda lb: (None, None, lb)  # noqa: E731
    # the default is the exact path (measured fastest on an H200 with Triton 3.6, benchmarks/results/kda.md)
    assert ops._bounded(gate(-5.0)) == (False, False)
    with launch_settings(safe=SAFE_PATHS["bounded-fused"]):
        assert ops._bounded(gate(-5.0)) == (True, True)
        assert ops._bounded(gate(-7.5)) == (True, True)  # 8 x 7.5 = 60: the last bound that fits
        assert ops._bounded(gate(-7.6)) == (False, False)
        assert ops._bounded(gate(None)) == (False, False)  # the softplus gate is unbounded
        assert ops._bounded(None) == (False, False)  # a precomputed g may hold hard resets
    with launch_settings(safe=dict(diag_dot=1, fuse_bwd=0)), pytest.raises(ValueError, match="needs fuse_bwd=1"):
        ops._bounded(gate(-5.0))  # the bounded unfused path: wrong dq on an H200
    with launch_settings(safe=dict(diag_dot=0, fuse_bwd=1)):
        assert ops._bounded(gate(-5.0)) == (False, False)  # the fused backward needs the bounded products


@pytest.mark.parametrize("path", list(SAFE_PATHS))
@pytest.mark.parametrize("B, T, with_h0", [(1, 1, False), (1, 63, True), (2, 65, False), (1, 130, True)])
def test_safe_gate_matches_recurrent(path, B, T, with_h0):
    check_safe_gate_against_recurrent(B, T, 2, 32, 32, with_h0=with_h0, seed=T, path=path)


@pytest.mark.parametrize("path", list(SAFE_PATHS))
def test_safe_gate_packed_documents(path):
    check_safe_gate_against_recurrent(1, 280, 1, 32, 32, lengths=[1, 15, 64, 200], seed=4, path=path)


@pytest.mark.parametrize("path", ["bounded-fused", "exact"])
def test_safe_gate_wide_uneven_heads(path):
    """K = 96: two K tiles in the fused backward (the second forms dM, dA on its own), masked columns, V = 40;
    K = 256, the widest head: four K tiles, V tiles of 32."""
    check_safe_gate_against_recurrent(1, 130, 2, 96, 40, seed=16, path=path)
    check_safe_gate_against_recurrent(1, 70, 1, 256, 48, seed=21, path=path)


# NOTE: at lb = -7.5 the products above the diagonal (exp(b_i - b_j), i < j, up to exp(15 * 7.5)) overflow in the
# interpreter's float32 matmul; the kernel discards them, numpy warns.
@pytest.mark.filterwarnings("ignore:overflow encountered in matmul", "ignore:invalid value encountered in matmul")
@pytest.mark.parametrize("path", ["bounded-fused", "exact"])
@pytest.mark.parametrize(
    "lower_bound, pin", [(-5.0, "bound"), (-5.0, "near"), (-5.0, "mixed"), (-7.5, "bound"), (-7.5, "near")],
)
def test_safe_gate_pinned_at_the_lower_bound(path, lower_bound, pin):
    """g at (or within 0.05% of) lb on every token for whole chunks: the widest span a bounded block can meet,
    at lb = -5 and at the largest bound admitted (-7.5, spans of exactly 60 around the middle row)."""
    check_safe_gate_against_recurrent(
        1, 200, 1, 32, 32, seed=17, lower_bound=lower_bound, pin=pin, path=path,
        lengths=[70, 130] if pin == "mixed" else None,
    )


def test_chunk_kda_fused_options_equal_unfused():
    inputs = [x.float().to(DEVICE) for x in make_inputs(1, 40, 2, 32, 32, seed=12)]
    check_fused_options_equal_unfused(chunk_kda, chunk_kda, inputs, seed=3, out_tol=1e-5, grad_tol=1e-4)


def test_chunk_kda_float16_forward():
    q, k, v, g, beta, h0 = make_inputs(1, 70, 2, 32, 32, seed=10)
    o_ref, S_ref = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, S = chunk_kda(*(x.to(DEVICE, torch.float16) for x in (q, k, v)), g.to(DEVICE), beta.to(DEVICE),
                     initial_state=h0.to(DEVICE, torch.float32), output_final_state=True)
    assert o.dtype == torch.float16 and S.dtype == torch.float32
    assert rel_rms(o.cpu(), o_ref) < 1e-2 and rel_rms(S.cpu(), S_ref) < 1e-2


def test_chunk_kda_without_final_state_returns_none():
    q, k, v, g, beta, _ = (x.float().to(DEVICE) for x in make_inputs(1, 20, 1, 16, 16, seed=14))
    o, S = chunk_kda(q, k, v, g, beta)
    assert S is None and o.shape == v.shape


def test_chunk_kda_rejects_mixed_dtypes():
    x = torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="share one dtype"):
        chunk_kda(x, x, x.double(), x, torch.zeros(1, 4, 1, device=DEVICE))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error without the interpreter")
def test_chunk_kda_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ValueError, match="chunk_kda_reference"):
        chunk_kda(x, x, x, x, torch.zeros(1, 4, 1))


def test_chunk_kda_compiles_without_graph_break():
    """The custom ops trace under torch.compile(fullgraph=True) and give eager's values and gradients."""
    q, k, v, g, beta, h0 = (x.float().to(DEVICE) for x in make_inputs(1, 20, 1, 16, 16, seed=15))

    def loss(q, k, v, g, beta, h0):
        o, S = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
        return (o * o).sum() + S.sum()

    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    l_c = compiled(*leaves)
    grads_c = torch.autograd.grad(l_c, leaves)
    l_e = loss(*leaves)
    grads_e = torch.autograd.grad(l_e, leaves)
    assert torch.allclose(l_c, l_e)
    for name, a, b in zip(GRAD_NAMES, grads_c, grads_e):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), name


def test_intra_chunk_precision_by_dtype_device_and_split():
    """The decayed-product gradients: float32 exact; bfloat16 / float16 in three bfloat16 passes on a GPU (split 1,
    the default) or three TF32 passes (split 0, and always in the CPU interpreter, which refuses bf16x3)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    opts = dict(ops.LAUNCH["dintra"])
    assert opts["split"] == 1
    for device in (cuda, cpu):
        assert ops.intra_precision(torch.float32, device, opts) == ({k: v for k, v in opts.items() if k != "split"}, "ieee")
    assert ops.intra_precision(torch.bfloat16, cuda, opts)[1] == "bf16x3"
    assert ops.intra_precision(torch.float16, cuda, {**opts, "split": 0})[1] == "tf32"  # bwd.intra_dot: three passes
    assert ops.intra_precision(torch.bfloat16, cpu, opts)[1] == "tf32"
    assert "split" not in ops.intra_precision(torch.bfloat16, cuda, opts)[0]


# ---------------------------------------------------------------------------------------------
# Empty inputs, many documents, and the reference's own gradients.


@pytest.mark.parametrize("B, T", [(0, 8), (1, 0), (2, 0)])
def test_empty_batch_or_sequence(B, T):
    """No sequences (B = 0) or no tokens (T = 0): empty outputs, the final state is the initial one, and the
    backward runs (the launch layout divided T by B, and the references stacked an empty list)."""
    H, K, V = 2, 16, 8
    q, k, v, g, beta, h0 = (x.float() for x in make_inputs(B, T, H, K, V))
    for fn in (chunk_kda, chunk_kda_reference, recurrent_kda):
        device = DEVICE if fn is chunk_kda else "cpu"
        leaves = [x.to(device).detach().clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, S = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True)
        assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V), fn.__name__
        assert torch.equal(S.detach().cpu(), h0), fn.__name__
        if fn is recurrent_kda:
            continue  # the token loop never runs: its outputs are fresh tensors, not a graph
        dS = torch.randn(S.shape, device=device)
        (o.sum() + (S * dS).sum()).backward()
        assert torch.equal(leaves[5].grad, dS), fn.__name__
        assert all(x.grad is None or x.grad.shape == x.shape for x in leaves[:5]), fn.__name__


def test_chunk_kda_many_short_documents_and_one_document():
    """Twenty documents of 1-4 tokens (several inside one 64-token chunk, one-token ones among them), then a pack
    of one document covering the whole row."""
    lengths = [1, 3, 2, 4, 1, 1, 4, 2, 3, 1, 2, 2, 4, 3, 1, 1, 2, 4, 3, 1]
    check_triton_against_recurrent(1, sum(lengths), 1, 16, 16, lengths=lengths, seed=21)
    check_triton_against_recurrent(1, 70, 1, 16, 16, lengths=[70], seed=22)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused-options"])
def test_reference_gradcheck_in_float64(fused):
    """torch.autograd.gradcheck of the chunked reference (the kernels' ground truth for gradients) on packed
    documents with a ragged chunk, the initial state included; fused: the safe gate, the L2 norm and beta's
    sigmoid as the reference applies them."""
    gen = torch.Generator().manual_seed(30)
    H, K, V, lengths = 1, 4, 3, [1, 4]
    T = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v = randn(1, T, H, K), l2norm(randn(1, T, H, K)), randn(1, T, H, V)
    g = -torch.rand(1, T, H, K, generator=gen, dtype=torch.float64) * 2
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    h0 = randn(len(lengths), H, K, V)
    inputs = [q, k, v, g, beta, h0]
    options = {}
    if fused:
        inputs += [randn(H), randn(H, K)]
        options = dict(use_qk_l2norm=True, beta_is_logit=True)
    inputs = [x.requires_grad_() for x in inputs]

    def f(q, k, v, g, beta, h0, *gate):
        gate_args = dict(A_log=gate[0], dt_bias=gate[1]) if gate else {}
        return chunk_kda_reference(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                   **gate_args, **options)

    # NOTE: fast_mode checks the Jacobian along random directions: a few forwards instead of two per input element
    # (17 s on a CPU core, each forward padding every document to a 64-token chunk).
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("fn", [chunk_kda, chunk_kda_reference], ids=["triton", "reference"])
@pytest.mark.parametrize("change, message", [
    (dict(k="meta"), "chunk_kda: k is on meta, q on"),
    (dict(beta="meta"), "chunk_kda: beta is on meta, q on"),
    (dict(initial_state="meta"), "chunk_kda: initial_state is on meta, q on"),
    (dict(A_log="meta"), "chunk_kda: A_log is on meta, q on"),
    (dict(g=torch.int32), "g must be a floating tensor, got torch.int32"),
    (dict(beta=torch.int64), "beta must be a floating tensor, got torch.int64"),
    (dict(initial_state=torch.int32), "initial_state must be a floating tensor, got torch.int32"),
])
def test_a_tensor_on_another_device_or_of_integers_stops_with_one_line(fn, change, message):
    """The kernels read every pointer as q's device's memory and every value as a float: a tensor elsewhere, or of
    integers, ran on garbage in the interpreter (an illegal address on a GPU). The meta device stands in for
    another device here."""
    x = torch.zeros(1, 8, 2, 16, device=DEVICE)
    args = dict(q=x, k=x, v=x, g=x, beta=torch.zeros(1, 8, 2, device=DEVICE),
                initial_state=torch.zeros(1, 2, 16, 16, device=DEVICE), A_log=torch.zeros(2, device=DEVICE))
    [(name, to)] = change.items()
    args[name] = args[name].to(to)
    with pytest.raises(ValueError, match=message):
        fn(**args)


def test_reference_state_math_stays_float32_under_bf16_autocast():
    """The trainer runs the model under bf16 autocast, which casts matmul and einsum operands to bf16: the chunked
    reference keeps its state math in float32 there (docs/k3.md §2.1), forward and backward, as the kernels do.

    NOTE: the backward runs under autocast too, as a compiled region's does (AOT autograd traces it under the
    forward's autocast: torch._functorch.config.backward_pass_autocast), where autograd's own backward of the solve
    ran a bf16 matmul. (With the products in bf16: 3.8e-3 relative error in o, 2.9e-3 in the state, ~3.5e-3 in
    every gradient; with the solve's backward alone: up to 2.7e-4 in g's gradient.)
    """
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 32, 32, seed=7)
    o_ref, S_ref, grads_ref = run_with_grads(recurrent_kda, q, k, v, g, beta, h0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S, grads = run_with_grads(chunk_kda_reference, *(x.float() for x in (q, k, v, g, beta, h0)))
    assert all(t.dtype == torch.float32 for t in (o, S, *grads))
    errors = {name: rel_rms(a, b) for name, a, b in zip(["o", "state", *GRAD_NAMES], [o, S, *grads],
                                                        [o_ref, S_ref, *grads_ref])}
    assert max(errors.values()) < 1e-5, errors


def test_reference_ops_pass_opcheck():
    """The chunked reference's float32 product and triangular solve, with their backward, on its layouts."""
    from kernels.float32_matmul import matmul_float32
    from kernels.kda.reference import _solve_unit_lower

    gen = torch.Generator().manual_seed(40)
    a, b = torch.randn(2, 3, 8, 5, generator=gen), torch.randn(2, 3, 8, 6, generator=gen)
    torch.library.opcheck(matmul_float32, (a.mT.requires_grad_(), b.requires_grad_()))
    L = torch.randn(2, 3, 8, 8, generator=gen).tril(-1) + torch.eye(8)
    R = torch.randn(2, 3, 8, 5, generator=gen)
    torch.library.opcheck(_solve_unit_lower, (L.requires_grad_(), R.requires_grad_()))
