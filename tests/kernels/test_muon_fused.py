"""kernels.muon: the fused momentum and update passes (Triton interpreter on CPU) against the PyTorch reference."""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.muon import decay_add_, nesterov_momentum_, reference
from titan_k3.optim.muon import newton_schulz


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on CPU, the real kernels on a GPU


def _rand(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("n", [1, 100, 4096, 4097, 3 * 4096 + 17])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_nesterov_momentum_matches_reference(n, nesterov, out_dtype):
    grad, buf = _rand(n, seed=1), _rand(n, seed=2)
    ref_buf, ref_out = buf.clone(), torch.empty(n, dtype=out_dtype, device=DEVICE)
    reference.nesterov_momentum_(grad, ref_buf, ref_out, 0.95, nesterov)
    out = torch.full((n,), float("nan"), dtype=out_dtype, device=DEVICE)
    nesterov_momentum_(grad, buf, out, 0.95, nesterov, triton_=True)
    torch.testing.assert_close(buf, ref_buf, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-3 if out_dtype == torch.float16 else 1e-6, atol=1e-6)
    expected = 0.95 * _rand(n, seed=2) + grad  # the formula itself, not only agreement with the reference
    torch.testing.assert_close(buf, expected)


@pytest.mark.parametrize("n", [1, 4095, 2 * 4096 + 5])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.float16])
def test_decay_add_matches_reference(n, update_dtype):
    p, u = _rand(n, seed=3), _rand(n, update_dtype, seed=4)
    ref = p.clone()
    reference.decay_add_(ref, u, 0.999, -0.02)
    decay_add_(p, u, 0.999, -0.02, triton_=True)
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(p, 0.999 * _rand(n, seed=3) - 0.02 * u.float())


def test_the_cpu_default_is_the_reference_and_cuda_is_asked_for_by_name(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = _rand(10).cpu()
    decay_add_(p, torch.ones(10), 1.0, 1.0)  # no interpreter needed: the reference ran
    torch.testing.assert_close(p, _rand(10).cpu() + 1)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        decay_add_(p, torch.ones(10), 1.0, 1.0, triton_=True)


def test_bad_layouts_stop_with_a_named_error():
    p = _rand((8, 6))
    with pytest.raises(ValueError, match="decay_add_: update must be contiguous"):
        decay_add_(p, _rand((6, 8)).t(), 1.0, -0.1)
    with pytest.raises(ValueError, match="nesterov_momentum_: out has 47 elements"):
        nesterov_momentum_(_rand(48), _rand(48), _rand(47), 0.9, True)


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
