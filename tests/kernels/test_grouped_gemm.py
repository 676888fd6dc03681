"""grouped_gemm: Triton kernels (CPU interpreter) and references vs float64 ground truth.

Tolerances are relative RMS errors. Float32 kernels accumulate in float32 like
the reference, so forward errors sit near 1e-6; the bound 1e-3 leaves room for
summation-order differences across block sizes without hiding a wrong row.
Gradients chain two or three float32 GEMMs plus the GLU derivative, so their
bound is 5e-3.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.grouped_gemm import reference


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_routing(n_tokens, n_experts, top_k, gen, skew=False):
    """Distinct experts per token, renormalised probabilities; skew leaves experts empty."""
    scores = torch.rand(n_tokens, n_experts, generator=gen, dtype=torch.float64)
    if skew:
        scores[:, n_experts // 2 :] -= 2.0  # the upper half is never chosen when k <= E/2
    top, idx = scores.topk(top_k, dim=1)
    prob = torch.sigmoid(top)
    return idx, prob / prob.sum(dim=1, keepdim=True)


def make_moe(n_tokens, n_experts, top_k, latent, hidden, dtype, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, latent, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, latent, hidden, generator=gen, dtype=torch.float64) / latent**0.5
    w3 = torch.randn(n_experts, latent, hidden, generator=gen, dtype=torch.float64) * 8 / latent**0.5
    w2 = torch.randn(n_experts, hidden, latent, generator=gen, dtype=torch.float64) / hidden**0.5
    idx, prob = make_routing(n_tokens, n_experts, top_k, gen, skew)
    tensors = [t.to(dtype).requires_grad_() for t in (x, w1, w3, w2, prob)]
    return tensors[:4] + [idx, tensors[4]]


def naive_moe(x, w1, w3, w2, idx, prob):
    """Per-token, per-slot dense computation in float64."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = reference.situ_glu(x[t].double() @ w1[e].double(), x[t].double() @ w3[e].double())
            y[t] += prob[t, j].double() * (h @ w2[e].double())
    return y


def test_situ_glu_formula():
    g = torch.linspace(-30, 30, 101, dtype=torch.float64)
    u = torch.linspace(-90, 90, 101, dtype=torch.float64)
    want = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(reference.situ_glu(g, u), want, rtol=0, atol=1e-12)
    assert reference.situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.float32


def test_reference_grouped_mm_matches_loop_and_zero_tail():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([6, 6, 20, 20], dtype=torch.int32)  # empty groups 1 and 3, tail 20:23
    y = reference.grouped_mm(x, w, offsets)
    starts = [0, 6, 6, 20]
    for e, (s, end) in enumerate(zip(starts, offsets.tolist())):
        assert torch.allclose(y[s:end], x[s:end] @ w[e])
    assert torch.equal(y[20:], torch.zeros(3, 3, dtype=torch.float64))
    y.sum().backward()
    assert torch.equal(x.grad[20:], torch.zeros(3, 5, dtype=torch.float64))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("skew", [False, True])
def test_reference_moe_matches_naive(dtype, tol, skew):
    x, w1, w3, w2, idx, prob = make_moe(37, 8, 3, 16, 24, dtype, seed=2, skew=skew)
    y = reference.moe_experts(x, w1, w3, w2, idx, prob)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y, naive_moe(x, w1, w3, w2, idx, prob)) < tol


def test_reference_moe_grads_match_naive():
    x, w1, w3, w2, idx, prob = make_moe(19, 6, 2, 8, 12, torch.float64, seed=3, skew=True)
    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    params = (x, w1, w3, w2, prob)
    got = torch.autograd.grad(reference.moe_experts(x, w1, w3, w2, idx, prob), params, dy)
    want = torch.autograd.grad(naive_moe(x, w1, w3, w2, idx, prob), params, dy)
    for g, w in zip(got, want):
        assert rel_rms(g, w) < 1e-12
