"""kernels.attn_res on CUDA: bf16 at the k3-mini training shape against the float64 reference."""

import pytest
import torch

from kernels.attn_res import pseudo_query_mix, pseudo_query_mix_reference
from titan_k3.models.k3.args import FLAVORS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

EPS = 1e-5
DIM = FLAVORS["k3-mini"].dim


def _rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _inputs(n_sources, shape, dtype, q_scale, seed=0):
    """Sources of different scales (as block sums are), rounded to dtype, and a query of RMS q_scale."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sources = [(torch.randn(*shape, device="cuda", generator=gen) * (0.5 + n)).to(dtype) for n in range(n_sources)]
    query = (torch.randn(shape[-1], device="cuda", generator=gen) * q_scale).to(dtype)
    return sources, query


def _mix_with_grads(fn, sources, query, dtype):
    leaves = [v.detach().to(dtype).requires_grad_(True) for v in sources]
    q = query.detach().to(dtype).requires_grad_(True)
    out = fn(leaves, q, EPS)
    dout = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    (out * dout.to(out.dtype)).sum().backward()
    return [out.detach()] + [v.grad for v in leaves] + [q.grad]


@pytest.mark.parametrize("q_scale", [0.0, 0.1, 1.0])
def test_bf16_k3_mini_shape_matches_float64_reference(q_scale):
    """B8 T4096 D512, N = 5: output within 5e-3, every source's gradient and the query's within 2e-2."""
    sources, q = _inputs(5, (8, 4096, DIM), torch.bfloat16, q_scale)
    got = _mix_with_grads(pseudo_query_mix, sources, q, torch.bfloat16)
    truth = _mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    assert all(torch.isfinite(x).all() for x in got)
    assert got[0].dtype == torch.bfloat16 and _rel_rms(got[0], truth[0]) < 5e-3
    for n, (g, t) in enumerate(zip(got[1:], truth[1:])):
        assert g.dtype == torch.bfloat16 and _rel_rms(g, t) < 2e-2, n


def test_bf16_peaked_weights_as_exact_as_eager_float32():
    """One weight near 1 in most rows: the query gradient is ill-conditioned there; ours must not be
    worse than the eager float32 reference (autograd) on the same bf16 inputs."""
    sources, q = _inputs(5, (2, 4096, DIM), torch.bfloat16, 3.0, seed=2)
    got = _mix_with_grads(pseudo_query_mix, sources, q, torch.bfloat16)
    eager = _mix_with_grads(pseudo_query_mix_reference, sources, q, torch.bfloat16)
    truth = _mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    for n, (g, e, t) in enumerate(zip(got, eager, truth)):
        assert _rel_rms(g, t) <= max(1.5 * _rel_rms(e, t), 5e-3), n


def test_float32_matches_float64_reference_tightly():
    sources, q = _inputs(3, (2, 1000, 200), torch.float32, 1.0, seed=3)
    got = _mix_with_grads(pseudo_query_mix, sources, q, torch.float32)
    truth = _mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    for n, (g, t) in enumerate(zip(got, truth)):
        assert _rel_rms(g, t) < 1e-5, n


def test_wide_rows_of_the_k3_width():
    """D = 7168 (the k3 flavor): one row per program, more warps."""
    sources, q = _inputs(4, (3, 171, 7168), torch.bfloat16, 0.1, seed=4)
    got = _mix_with_grads(pseudo_query_mix, sources, q, torch.bfloat16)
    truth = _mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    assert _rel_rms(got[0], truth[0]) < 5e-3
    for n, (g, t) in enumerate(zip(got[1:], truth[1:])):
        assert _rel_rms(g, t) < 2e-2, n


def test_bf16_is_deterministic():
    sources, q = _inputs(5, (4, 1024, DIM), torch.bfloat16, 1.0, seed=5)
    first = _mix_with_grads(pseudo_query_mix, sources, q, torch.bfloat16)
    second = _mix_with_grads(pseudo_query_mix, sources, q, torch.bfloat16)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("width", [DIM, 7168])
def test_bf16_with_the_norm_folded_in_as_exact_as_the_eager_mix_then_norm(width):
    """kernels.attn_res_norm_in_mix at k3-mini's width (and k3's, one row per program): output and every gradient
    (the norm weight's too) no worse against float64 than the eager bf16 mix followed by the model's RMSNorm."""
    from titan_k3.models.k3.layers import rms_norm

    sources, q = _inputs(5, (4, 2048, width) if width == DIM else (2, 171, width), torch.bfloat16, 1.0, seed=6)
    w = 1 + 0.3 * torch.randn(width, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))

    def run(fn, dtype, weight_dtype):
        weight = w.to(weight_dtype, copy=True).requires_grad_(True)  # a fresh leaf per run (w is float32 already)
        return _mix_with_grads(lambda v, qq, eps: fn(v, qq, eps, weight), sources, q, dtype) + [weight.grad]

    got = run(lambda v, qq, eps, ww: pseudo_query_mix(v, qq, eps, norm_weight=ww, norm_eps=1e-6),
              torch.bfloat16, torch.float32)
    eager = run(lambda v, qq, eps, ww: rms_norm(pseudo_query_mix_reference(v, qq, eps), ww, 1e-6),
                torch.bfloat16, torch.float32)
    truth = run(lambda v, qq, eps, ww: pseudo_query_mix_reference(v, qq, eps, ww, 1e-6), torch.float64, torch.float64)
    assert all(torch.isfinite(x).all() for x in got)
    for n, (g, e, t) in enumerate(zip(got, eager, truth)):
        assert _rel_rms(g, t) <= max(1.5 * _rel_rms(e, t), 5e-3), n
