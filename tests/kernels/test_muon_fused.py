"""kernels.muon: the fused passes (Triton interpreter on CPU) against the PyTorch reference, and Newton-Schulz."""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import functools

import pytest
import torch

from kernels.muon import (decay_add_multi_, decay_add_table, momentum_table, nesterov_momentum_multi_, ns_polynomial,
                          reference, send_tables)
from kernels.muon.fused import BLOCK
from titan_k3.optim import muon
from titan_k3.optim import orthogonalise as ns_module
from titan_k3.optim.muon import PerHeadMuon
from titan_k3.optim.orthogonalise import NS_COEFFS, newton_schulz


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the real kernels on a GPU


def _rand(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("n", [1, 100, 4096, 4097, 3 * 4096 + 17])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_one_tensor_momentum_matches_reference_and_the_formula(n, nesterov, out_dtype):
    grad, buf = _rand(n, seed=1), _rand(n, seed=2)
    ref_buf, ref_out = buf.clone(), torch.empty(n, dtype=out_dtype, device=DEVICE)
    reference.nesterov_momentum_(grad, ref_buf, ref_out, 0.95, nesterov)
    out = torch.full((n,), float("nan"), dtype=out_dtype, device=DEVICE)
    nesterov_momentum_multi_([grad], [buf], out, 0.95, nesterov, triton_=True)
    torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-3 if out_dtype == torch.float16 else 1e-6, atol=1e-6)
    expected = 0.95 * _rand(n, seed=2) + grad  # the formula itself, not only agreement with the reference
    torch.testing.assert_close(buf, expected)


# NOTE: Triton's CPU interpreter computes bf16 wrongly: there float16 stands in for a low-precision buffer.
LOW = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("buf_dtype", [LOW, torch.bfloat16], ids=["low", "bf16"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_a_low_precision_buffer_advances_in_float32_and_rounds_once(triton_, buf_dtype, nesterov):
    """bf16 momentum: the buffer is read into float32, advanced, stored rounded once; the direction is taken from
    the unrounded float32 value (it would differ by up to one bf16 ulp of the buffer otherwise)."""
    if triton_ and buf_dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("bf16 in Triton's CPU interpreter is broken; the GPU run checks it")
    sizes = SIZES["ragged"]
    grads = _lists(sizes, 110)
    bufs = [b.to(buf_dtype) for b in _lists(sizes, 120)]
    new = [0.95 * b.double() + g.double() for b, g in zip(bufs, grads)]  # float64 truth of the advance
    direction = torch.cat([g.double() + 0.95 * n if nesterov else n for g, n in zip(grads, new)])
    out = torch.full((sum(sizes),), float("nan"), device=DEVICE)
    nesterov_momentum_multi_(grads, bufs, out, 0.95, nesterov, triton_=triton_)
    for b, n in zip(bufs, new):
        assert b.dtype == buf_dtype
        ulp = torch.finfo(buf_dtype).eps
        torch.testing.assert_close(b.double(), n.to(buf_dtype).double(), rtol=ulp, atol=1e-30)  # rounded once
    torch.testing.assert_close(out.double(), direction, rtol=1e-6, atol=1e-6)  # from the unrounded value
    skipped = [b.clone() for b in bufs]
    nesterov_momentum_multi_(grads, bufs, out, 0.95, nesterov, skip_if=torch.tensor(1, device=DEVICE), triton_=triton_)
    assert all(torch.equal(b, s) for b, s in zip(bufs, skipped))


@pytest.mark.parametrize("n", [1, 4095, 2 * 4096 + 5])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.float16])
def test_one_tensor_decay_add_matches_reference_and_the_formula(n, update_dtype):
    p, u = _rand(n, seed=3), _rand(n, update_dtype, seed=4)
    ref = p.clone()
    reference.decay_add_(ref, u, 0.999, -0.02)
    decay_add_multi_([p], u, 0.999, -0.02, triton_=True)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p, 0.999 * _rand(n, seed=3) - 0.02 * u.float())


def test_the_cpu_default_is_the_reference_and_cuda_is_asked_for_by_name(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _rand(10).cpu()
    decay_add_multi_([p], torch.ones(10), 1.0, 1.0)  # no interpreter needed: the reference ran
    torch.testing.assert_close(p, _rand(10).cpu() + 1)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        decay_add_multi_([p], torch.ones(10), 1.0, 1.0, triton_=True)


@pytest.mark.parametrize("shape", [(3, 24, 10), (2, 10, 24), (16, 16)])
def test_newton_schulz_writes_the_callers_orientation(shape):
    """Tall blocks iterate transposed; the last step writes them back contiguous, as iterating on G.mT would give."""
    G = _rand(shape, seed=5)
    O = newton_schulz(G, 5, dtype=torch.float32, scale=1.5)
    assert O.shape == G.shape and O.is_contiguous()
    O_t = newton_schulz(G.mT.contiguous(), 5, dtype=torch.float32, scale=1.5)
    torch.testing.assert_close(O, O_t.mT, rtol=1e-4, atol=1e-5)
    s = torch.linalg.svdvals((O / 1.5).double())
    assert s.min() > 0.5 and s.max() < 1.3  # approximately orthogonal
    O64 = newton_schulz(G.double(), 5, dtype=torch.float64, scale=1.5)  # float64 in, norm and all: the tests' ground truth
    assert O64.dtype == torch.float64 and (O64 - O.double()).abs().max() < 1e-4


def test_triton_runs_on_cuda_and_on_the_cpu_only_when_interpreted(monkeypatch):
    from kernels.device import triton_runs_on

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_runs_on("cuda") and triton_runs_on(torch.device("cuda", 1)) and not triton_runs_on("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_runs_on("cpu")


# ragged sizes around the block size, an empty tensor, and (all multiples of 16) the aligned-kernel variant
SIZES = {"ragged": [5, BLOCK, 100, 0, 2 * BLOCK + 3, 17], "aligned": [BLOCK, 32, 2 * BLOCK + 48]}


def _lists(sizes, seed, dtype=torch.float32):
    return [_rand(n, dtype, seed=seed + i) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slots", ["one tensor", "a list"])
def test_nesterov_momentum_multi_matches_reference(sizes, nesterov, out_dtype, slots):
    grads, bufs = _lists(sizes, 10), _lists(sizes, 20)
    ref_bufs = [b.clone() for b in bufs]
    ref_outs = [torch.empty(n, dtype=out_dtype, device=DEVICE) for n in sizes]
    for g, b, o in zip(grads, ref_bufs, ref_outs):
        reference.nesterov_momentum_(g, b, o, 0.9, nesterov)
    out = torch.full((sum(sizes),), float("nan"), dtype=out_dtype, device=DEVICE)
    outs = list(out.split(sizes)) if slots == "a list" else out
    nesterov_momentum_multi_(grads, bufs, outs, 0.9, nesterov, triton_=True)
    for b, r in zip(bufs, ref_bufs):
        torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, torch.cat(ref_outs), rtol=1e-3 if out_dtype == torch.float16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slots", ["one tensor", "a list"])
def test_decay_add_multi_matches_reference(sizes, update_dtype, slots):
    params = _lists(sizes, 30)
    update = _rand(sum(sizes), update_dtype, seed=40)
    refs = [p.clone() for p in params]
    for r, u in zip(refs, update.split(sizes)):
        reference.decay_add_(r, u, 0.999, -0.02)
    decay_add_multi_(params, list(update.split(sizes)) if slots == "a list" else update, 0.999, -0.02, triton_=True)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("flag", [torch.tensor(True), torch.tensor(1.0), torch.tensor([float("nan")])],
                         ids=["bool", "float", "nan"])
def test_skip_if_leaves_buffers_and_parameters_bit_identical(triton_, flag):
    """A nonzero flag skips: NaN and inf gradients leave no trace, and the directions written are zeros."""
    sizes = SIZES["ragged"]
    grads = _lists(sizes, 50)
    for g in grads[:3]:
        g[::2] = float("nan")
        g[1::3] = float("inf")
    bufs, params = _lists(sizes, 60), _lists(sizes, 70)
    bufs0, params0 = [b.clone() for b in bufs], [p.clone() for p in params]
    out = torch.full((sum(sizes),), float("nan"), device=DEVICE)
    skip = flag.to(DEVICE)
    nesterov_momentum_multi_(grads, bufs, out, 0.9, True, skip_if=skip, triton_=triton_)
    decay_add_multi_(params, grads, 0.9, -1.0, skip_if=skip, triton_=triton_)
    assert all(torch.equal(b, b0) for b, b0 in zip(bufs, bufs0))
    assert all(torch.equal(p, p0) for p, p0 in zip(params, params0))
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
def test_the_update_pass_writes_each_parameters_cast_into_its_shadow(triton_, sizes):
    """With shadows the parameters move as without them, and each shadow ends as its new parameter's cast, bit for
    bit; a skipped update leaves both (float16 shadows: the interpreter's bf16 is broken, the GPU checks bf16)."""
    shadow_dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    params, twins = _lists(sizes, 160), _lists(sizes, 160)
    shadows = [torch.full_like(p, float("nan"), dtype=shadow_dtype) for p in params]
    update = _rand(sum(sizes), torch.float16, seed=170)
    decay_add_multi_(params, update, 0.999, -0.02, shadows=shadows, triton_=triton_)
    decay_add_multi_(twins, update, 0.999, -0.02, triton_=triton_)
    for p, q, s in zip(params, twins, shadows):
        assert torch.equal(p, q) and torch.equal(s, p.to(shadow_dtype))
    before = [p.clone() for p in params], [s.clone() for s in shadows]
    decay_add_multi_(params, update, 0.5, 1.0, shadows=shadows, skip_if=torch.tensor(True, device=DEVICE),
                     triton_=triton_)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    assert all(torch.equal(s, t) for s, t in zip(shadows, before[1]))


def test_a_table_built_without_shadows_is_refused_for_a_pass_with_them():
    params = _lists([8, 8], 0)
    shadows = [p.half() for p in params]
    with pytest.raises(ValueError, match="decay_add_multi_: the table has 1 operands; shadows given needs 2"):
        decay_add_multi_(params, _rand(16), 1.0, 1.0, shadows=shadows, table=decay_add_table(params), triton_=True)
    with pytest.raises(ValueError, match=r"tensor 1 of an operand .*torch.float32"):
        decay_add_multi_(params, _rand(16), 1.0, 1.0, shadows=[shadows[0], params[1]], triton_=True)


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
def test_skip_if_zero_equals_no_flag(triton_):
    sizes = SIZES["ragged"]
    results = []
    for skip in (None, torch.tensor(False, device=DEVICE), torch.tensor(0.0, device=DEVICE)):
        grads, bufs, params = _lists(sizes, 80), _lists(sizes, 90), _lists(sizes, 100)
        out = torch.empty(sum(sizes), dtype=torch.float16, device=DEVICE)
        nesterov_momentum_multi_(grads, bufs, out, 0.95, True, skip_if=skip, triton_=triton_)
        decay_add_multi_(params, out, 0.99, -0.1, skip_if=skip, triton_=triton_)
        results.append([out, *bufs, *params])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_tables_sent_together_drive_each_launch():
    """Tables built ahead (the stacked output not yet allocated) and sent in one copy equal tables built per call."""
    sizes = [[7, BLOCK + 1], [300, 0, 64]]
    grads, bufs, params = ([_lists(s, seed + 10 * k) for k, s in enumerate(sizes)] for seed in (110, 130, 150))
    tables = [t for k in range(2) for t in (momentum_table(grads[k], bufs[k]), decay_add_table(params[k]))]
    send_tables(tables, DEVICE)
    ref = [[b.clone() for b in bufs[k]] + [p.clone() for p in params[k]] for k in range(2)]
    for k, s in enumerate(sizes):
        out = torch.empty(sum(s), device=DEVICE)
        nesterov_momentum_multi_(grads[k], bufs[k], out, 0.9, True, table=tables[2 * k], triton_=True)
        decay_add_multi_(params[k], out, 0.9, -0.5, table=tables[2 * k + 1], triton_=True)
        out_ref = torch.empty(sum(s), device=DEVICE)
        nesterov_momentum_multi_(grads[k], ref[k][:len(s)], out_ref, 0.9, True, triton_=True)
        decay_add_multi_(ref[k][len(s):], out_ref, 0.9, -0.5, triton_=True)
        assert all(torch.equal(a, b) for a, b in zip(bufs[k] + params[k], ref[k]))


def test_multi_tensor_misuse_stops_with_a_named_error():
    grads, bufs = _lists([8, 8], 0), _lists([8, 8], 2)
    with pytest.raises(ValueError, match="slot tensor must be contiguous with 16 elements"):
        nesterov_momentum_multi_(grads, bufs, _rand(15), 0.9, True, triton_=True)
    with pytest.raises(ValueError, match="an operand has 1 tensors; the first has 2"):
        nesterov_momentum_multi_(grads, bufs[:1], _rand(16), 0.9, True, triton_=True)
    with pytest.raises(ValueError, match=r"tensor 1 of an operand .*torch.float16"):
        decay_add_multi_([grads[0], grads[1].half()], _rand(16), 1.0, 1.0, triton_=True)
    with pytest.raises(ValueError, match="must be contiguous with 8 elements"):
        decay_add_multi_([_rand((4, 2)).t(), grads[1]], _rand(16), 1.0, 1.0, triton_=True)
    with pytest.raises(ValueError, match="skip_if must be a one-element tensor"):
        decay_add_multi_(grads, _rand(16), 1.0, 1.0, skip_if=torch.zeros(2, device=DEVICE), triton_=True)


NS_SHAPES = [(3, 24, 10), (2, 10, 24), (16, 16), (2, 3, 9, 5), (40, 7), (1, 64)]


@pytest.mark.parametrize("shape", NS_SHAPES)
@pytest.mark.parametrize("steps", [1, 5])
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_newton_schulz_equals_the_normalise_first_formula(shape, steps, dtype, tol):
    """Scaling the Gram-side matrices instead of G gives the formula that divides G by its norm first."""
    for seed, magnitude in ((11, 1.0), (12, 1e-3), (13, 1e12)):
        G = (_rand(shape, torch.float64, seed=seed) * magnitude).to(dtype)
        O = newton_schulz(G, steps, dtype=dtype, scale=1.7)
        ref = reference.newton_schulz(G, steps, dtype=dtype, scale=1.7)
        assert O.shape == G.shape and O.dtype == dtype and O.is_contiguous()
        assert ((O - ref).norm() / ref.norm()).item() < tol, (seed, magnitude)


def test_newton_schulz_through_the_triton_polynomial_equals_the_torch_path(monkeypatch):
    G = _rand((3, 40, 24), seed=14)
    torch_path = newton_schulz(G, 5, dtype=torch.float32, scale=1.3)
    monkeypatch.setattr(ns_module, "ns_polynomial", functools.partial(ns_polynomial, triton_=True))
    torch.testing.assert_close(newton_schulz(G, 5, dtype=torch.float32, scale=1.3), torch_path, rtol=1e-5, atol=1e-6)
    huge = newton_schulz(torch.full((2, 6, 4), 1e30, device=DEVICE))  # an overflowed norm: zero, not nan
    assert torch.equal(huge, torch.zeros_like(huge))


def test_newton_schulz_in_bf16_is_as_close_as_before():
    """bf16 differs from the normalise-first formula by bf16 rounding only: no further from float64 than it."""
    G = torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(15))
    exact = reference.newton_schulz(G.double(), 5, dtype=torch.float64)
    for g in (G, G.mT.contiguous()):
        exact_g = exact if g is G else exact.mT
        err = ((newton_schulz(g, dtype=torch.bfloat16).double() - exact_g).norm() / exact_g.norm()).item()
        err_ref = ((reference.newton_schulz(g, 5, dtype=torch.bfloat16).double() - exact_g).norm() / exact_g.norm()).item()
        assert err < 1.25 * err_ref, (err, err_ref)


def test_newton_schulz_keeps_zero_and_overflowing_inputs_finite():
    assert torch.equal(newton_schulz(torch.zeros(2, 4, 6)), torch.zeros(2, 4, 6))
    huge = newton_schulz(torch.full((2, 6, 4), 1e30))  # its norm overflows float32: zero, as before, not nan
    assert torch.equal(huge, torch.zeros_like(huge))
    with pytest.raises(ValueError, match="float16 lacks float32's exponent range"):
        newton_schulz(torch.ones(4, 4), dtype=torch.float16)


def _muon_run(skip_flags, grads_nan_at=None, triton_=False, monkeypatch=None):
    """PerHeadMuon over a per-head matrix, an expert tensor and two same-shape matrices, one step per flag."""
    if triton_:
        monkeypatch.setattr(muon, "nesterov_momentum_multi_", functools.partial(nesterov_momentum_multi_, triton_=True))
        monkeypatch.setattr(muon, "decay_add_multi_", functools.partial(decay_add_multi_, triton_=True))
    gen = torch.Generator().manual_seed(16)
    shapes = [(32, 24), (3, 8, 24), (8, 24), (8, 24)]
    params = [torch.randn(s, generator=gen).to(DEVICE) for s in shapes]
    opt = PerHeadMuon([{"params": [params[0]], "num_heads": 4}, {"params": [params[1]], "per_expert": True},
                       {"params": params[2:]}], lr=0.05, ns_dtype=torch.float32)
    history = []
    for k, flag in enumerate(skip_flags):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(DEVICE)
            if k == grads_nan_at:
                p.grad[0] = float("nan")
                p.grad[-1] = float("inf")
        opt.skip_if = None if flag is None else torch.tensor(flag, device=DEVICE)
        opt.step()
        history.append([t.clone() for p in params for t in (p, opt.state[p]["momentum_buffer"])])
    return history


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
def test_muon_step_skipped_on_the_device_flag(triton_, monkeypatch):
    """skip_if true: a NaN/inf step leaves parameters and momenta bit-identical; false: the same as no flag."""
    plain = _muon_run([None, None, None], triton_=triton_, monkeypatch=monkeypatch)
    flagged = _muon_run([False, True, False], grads_nan_at=1, triton_=triton_, monkeypatch=monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], flagged[0]))  # false: identical to no flag
    assert all(torch.equal(a, b) for a, b in zip(flagged[0], flagged[1]))  # true: nothing moved
    assert all(torch.isfinite(t).all() for t in flagged[2])
    with pytest.raises(ValueError, match="skip_if must be None or a one-element tensor"):
        opt = PerHeadMuon([torch.zeros(4, 4, device=DEVICE)], lr=0.1)
        opt.skip_if = torch.zeros(2, device=DEVICE)
        opt.step()


def test_muon_step_through_the_triton_passes_equals_the_reference_passes(monkeypatch):
    reference_run = _muon_run([None, False])
    triton_run = _muon_run([None, False], triton_=True, monkeypatch=monkeypatch)
    for a, b in zip(reference_run[-1], triton_run[-1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("triton_", [True, False], ids=["triton", "reference"])
def test_grad_scale_multiplies_each_gradient_as_it_is_read(triton_):
    sizes = SIZES["ragged"]
    grads, bufs = _lists(sizes, 50), _lists(sizes, 60)
    scale = torch.tensor([0.25], device=DEVICE)
    ref_bufs = [b.clone() for b in bufs]
    ref_out = torch.empty(sum(sizes), device=DEVICE)
    nesterov_momentum_multi_([g * 0.25 for g in grads], ref_bufs, ref_out, 0.9, True, triton_=triton_)
    out = torch.empty(sum(sizes), device=DEVICE)
    before = [g.clone() for g in grads]
    nesterov_momentum_multi_(grads, bufs, out, 0.9, True, grad_scale=scale, triton_=triton_)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    for b, r in zip(bufs, ref_bufs):
        torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(g, b) for g, b in zip(grads, before)), "the gradients are read, never written"
    with pytest.raises(ValueError, match="grad_scale must be a one-element tensor"):
        nesterov_momentum_multi_(grads, bufs, out, 0.9, True, grad_scale=torch.ones(2, device=DEVICE), triton_=triton_)


def _poly_formula(A: torch.Tensor, scale: float, sumsq: torch.Tensor | None) -> torch.Tensor:
    """scale * t * (a I + b t^2 A + c t^4 A^2) in float64, t = 1 / (sqrt(sumsq) + 1e-7) or 1."""
    a, b, c = NS_COEFFS
    A = A.double()
    t = torch.ones(A.shape[0], dtype=torch.float64) if sumsq is None else 1 / (sumsq.double().sqrt() + 1e-7)
    t = t.to(A.device)[:, None, None]
    eye = torch.eye(A.shape[-1], dtype=torch.float64, device=A.device)
    return scale * t * (a * eye + b * t ** 2 * A + c * t ** 4 * (A @ A))


# m: one tile below the 64 switch, ragged single and multiple tiles (130 = 128 + 2), exact tiles
@pytest.mark.parametrize("m", [4, 40, 130, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("first_step", [False, True])
def test_ns_polynomial_matches_the_formula_and_is_symmetric(m, dtype, first_step):
    """The Triton step (interpreted on CPU) and the reference against the formula in float64, on A = X X^T of a
    raw X (first step: normalised through sumsq) or of a normalised one."""
    X = _rand((2, m, m + 17), torch.float64, seed=m)
    A = X @ X.mT
    A = (A + A.mT) / 2  # exactly symmetric, whatever the float64 product's rounding
    sumsq = A.diagonal(dim1=-2, dim2=-1).sum(-1) if first_step else None
    if not first_step:
        A = A / A.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    scale = 2.5 if first_step else 1.0
    want = _poly_formula(A, scale, sumsq)
    got = ns_polynomial(A.to(dtype), NS_COEFFS, scale=scale, sumsq=None if sumsq is None else sumsq.float(),
                        triton_=True)
    ref = ns_polynomial(A.to(dtype).clone(), NS_COEFFS, scale=scale,
                        sumsq=None if sumsq is None else sumsq.float(), triton_=False)
    tol = 1e-3 if dtype == torch.float16 else 1e-5
    for out in (got, ref):
        assert out.dtype == dtype and out.shape == A.shape
        assert ((out.double() - want).norm() / want.norm()).item() < tol
    # The kernel computes the upper triangle of 128 x 128 tiles (m > 64) and stores each off-diagonal tile's
    # transpose: those pairs are exactly equal. A diagonal tile is symmetric up to the dot's rounding order,
    # which the interpreter need not keep (Triton 3.9 sums in float32 through numpy, position by position).
    tile = torch.arange(m) // (128 if m > 64 else m)
    mirrored = tile[:, None] != tile[None, :]
    assert torch.equal(got[:, mirrored], got.mT[:, mirrored])
    assert ((got - got.mT).abs().max() <= 4 * torch.finfo(dtype).eps * got.abs().max()).item()


def test_ns_polynomial_zeroes_a_matrix_whose_norm_overflowed():
    A = _rand((3, 70, 70)) @ _rand((3, 70, 70)).mT
    sumsq = torch.tensor([1.0, float("inf"), 4.0], device=DEVICE)
    for triton_ in (True, False):
        out = ns_polynomial(A.clone(), NS_COEFFS, sumsq=sumsq, triton_=triton_)
        assert torch.isfinite(out).all() and not out[1].any() and out[0].any()


def test_ns_polynomial_refuses_a_non_square_batch_or_a_wrong_sumsq():
    with pytest.raises(ValueError, match=r"ns_polynomial: A must be contiguous \[B, m, m\]"):
        ns_polynomial(torch.zeros(2, 3, 4), NS_COEFFS)
    with pytest.raises(ValueError, match=r"sumsq must be \[B\] = \[2\]"):
        ns_polynomial(torch.zeros(2, 3, 3), NS_COEFFS, sumsq=torch.ones(3))
    # the kernel reads sumsq as A's device's memory (the meta device stands in for another device)
    with pytest.raises(ValueError, match=r"sumsq must be \[B\] = \[2\] on A's device .*got \(2,\) on meta"):
        ns_polynomial(torch.zeros(2, 3, 3, device=DEVICE), NS_COEFFS, sumsq=torch.ones(2, device="meta"), triton_=True)


@pytest.mark.parametrize("op, moved, message", [
    ("momentum", "bufs", "nesterov_momentum_multi_: bufs is on meta, grads on"),
    ("momentum", "out", "nesterov_momentum_multi_: out is on meta, grads on"),
    ("decay_add", "update", "decay_add_multi_: update is on meta, params on"),
])
def test_a_list_on_another_device_stops_with_one_line(op, moved, message):
    """A table checks each list on its own, and the kernel reads every list as the first one's device's memory:
    a list elsewhere stopped on 'Cannot copy out of meta tensor' in the interpreter (an illegal address on a GPU).
    The meta device stands in for another device here."""
    args = dict(grads=_lists([8, 8], 0), bufs=_lists([8, 8], 2), out=_rand(16), params=_lists([8, 8], 4),
                update=_rand(16))
    args[moved] = [t.to("meta") for t in args[moved]] if isinstance(args[moved], list) else args[moved].to("meta")
    with pytest.raises(ValueError, match=message):
        if op == "momentum":
            nesterov_momentum_multi_(args["grads"], args["bufs"], args["out"], 0.9, True, triton_=True)
        else:
            decay_add_multi_(args["params"], args["update"], 1.0, 1.0, triton_=True)
