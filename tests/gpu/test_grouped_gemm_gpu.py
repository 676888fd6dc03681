"""grouped_gemm on the GPU in bfloat16 at realistic shapes, against float32 references.

bf16 rounds every stored operand (x, weights, g, u, h, per-slot outputs) to
8 mantissa bits, ~4e-3 relative each; a few of those chained through three
GEMMs stay well under the 2e-2 relative-RMS bound, while a wrong row, a missed
expert or a transposed operand lands near 1.
"""

import pytest
import torch

from kernels.grouped_gemm import grouped_mm, moe_experts, reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def routing(n_tokens, n_experts, top_k, n_dead, gen):
    scores = torch.rand(n_tokens, n_experts, generator=gen, device="cuda")
    scores[:, :n_dead] -= 2.0  # experts that no token picks
    top, idx = scores.topk(top_k, dim=1)
    return idx, top / top.sum(dim=1, keepdim=True)


@pytest.mark.parametrize("n_rows,red,n_cols,n_experts", [(8192, 1024, 256, 64), (6000, 256, 544, 176)])
def test_grouped_mm_bf16(n_rows, red, n_cols, n_experts):
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = torch.rand(n_experts, generator=gen, device="cuda")
    sizes[::5] = 0.0  # empty groups
    ends = (sizes.cumsum(0) / sizes.sum() * (n_rows - 100)).round().to(torch.int32)  # 100 tail rows
    x = torch.randn(n_rows, red, generator=gen, device="cuda")
    w = torch.randn(n_experts, red, n_cols, generator=gen, device="cuda") / red**0.5
    dy = torch.randn(n_rows, n_cols, generator=gen, device="cuda")
    xb = x.bfloat16().requires_grad_()
    wb = w.bfloat16().requires_grad_()
    y = grouped_mm(xb, wb, ends)
    dx, dw = torch.autograd.grad(y, (xb, wb), dy.bfloat16())
    xf = xb.detach().float().requires_grad_()
    wf = wb.detach().float().requires_grad_()
    yf = reference.grouped_mm(xf, wf, ends)
    dxf, dwf = torch.autograd.grad(yf, (xf, wf), dy.bfloat16().float())
    assert rel_rms(y, yf) < 2e-2
    assert rel_rms(dx, dxf) < 2e-2
    assert rel_rms(dw, dwf) < 2e-2
    tail = int(ends[-1])
    assert torch.equal(y[tail:], torch.zeros_like(y[tail:]))
    assert torch.equal(dx[tail:], torch.zeros_like(dx[tail:]))


@pytest.mark.parametrize("n_tokens,top_k,n_experts,latent,hidden", [(4096, 6, 176, 256, 544), (2048, 6, 64, 1024, 256)])
def test_moe_experts_bf16(n_tokens, top_k, n_experts, latent, hidden):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n_tokens, latent, generator=gen, device="cuda")
    w1 = torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") / latent**0.5
    w3 = torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") * 8 / latent**0.5
    w2 = torch.randn(n_experts, hidden, latent, generator=gen, device="cuda") / hidden**0.5
    idx, prob = routing(n_tokens, n_experts, top_k, n_dead=3, gen=gen)
    dy = torch.randn(n_tokens, latent, generator=gen, device="cuda").bfloat16()
    ours = [t.bfloat16().requires_grad_() for t in (x, w1, w3, w2, prob)]
    y = moe_experts(*ours[:4], idx, ours[4])
    grads = torch.autograd.grad(y, ours, dy)
    ref = [t.detach().float().requires_grad_() for t in ours]
    yf = reference.moe_experts(*ref[:4], idx, ref[4])
    grads_f = torch.autograd.grad(yf, ref, dy.float())
    assert y.dtype == torch.bfloat16
    assert rel_rms(y, yf) < 2e-2
    for name, g, gf in zip(("x", "w1", "w3", "w2", "topk_weight"), grads, grads_f):
        assert rel_rms(g, gf) < 2e-2, name
    assert torch.equal(grads[1][:3], torch.zeros_like(grads[1][:3]))  # dead experts
    assert torch.equal(moe_experts(*ours[:4], idx, ours[4]), y)  # deterministic


@pytest.mark.parametrize("n_tokens,top_k,n_experts,latent,hidden", [(4096, 6, 176, 256, 544)])
def test_moe_experts_float32_masters_cast_in_kernel_equal_a_cast_pass(n_tokens, top_k, n_experts, latent, hidden):
    """bf16 x with float32 master weights: the GEMMs rounding each weight tile as they load it give the numbers a
    cast pass gives, up to the kernels' own launch choices (the weights' dtype is part of the autotuner's key)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(n_tokens, latent, generator=gen, device="cuda").bfloat16()
    masters = [torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") / latent**0.5,
               torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") * 8 / latent**0.5,
               torch.randn(n_experts, hidden, latent, generator=gen, device="cuda") / hidden**0.5]
    idx, prob = routing(n_tokens, n_experts, top_k, n_dead=3, gen=gen)
    dy = torch.randn(n_tokens, latent, generator=gen, device="cuda").bfloat16()
    results = []
    for in_kernel in (False, True):
        leaves = [x.clone().requires_grad_()] + [w.clone().requires_grad_() for w in masters]
        leaves.append(prob.bfloat16().requires_grad_())
        y = moe_experts(*leaves[:4], idx, leaves[4], cast_in_kernel=in_kernel)
        results.append([y, *torch.autograd.grad(y, leaves, dy)])
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), *results):
        assert a.dtype == b.dtype and rel_rms(b, a) < 1e-2, name
