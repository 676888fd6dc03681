"""kernels.short_conv on CUDA: bf16 at the k3-mini training shape (B8 T4096, C 512, 4 taps) against float64, and the
KDA layer's output with kernels.conv = triton against the torch reference under torch.compile."""

import pytest
import torch

from kernels.short_conv import causal_conv_silu, causal_conv_silu_reference
from titan_k3.models.k3.documents import Documents

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, T, C, W = 8, 4096, 512, 4


def _packed_pos(seed=0):
    """Documents.pos_BT of documents of 1 to ~2000 tokens, every row start a document start."""
    gen = torch.Generator().manual_seed(seed)
    cuts = [0]
    for b in range(B):
        while cuts[-1] < (b + 1) * T:
            cuts.append(min((b + 1) * T, cuts[-1] + int(torch.randint(1, 2000, (1,), generator=gen))))
    return Documents.build(B, T, torch.tensor(cuts), torch.device("cuda")).pos_BT


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def test_bf16_training_shape_matches_float64():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x64 = torch.randn(B, T, C, device="cuda", dtype=torch.float64, generator=gen)
    w64 = torch.randn(C, 1, W, device="cuda", dtype=torch.float64, generator=gen) / 2
    dy = torch.randn(B, T, C, device="cuda", dtype=torch.float64, generator=gen)
    pos = _packed_pos()
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr, pos)
    yr.backward(dy)
    # NOTE: the reference of bf16 inputs: x and w rounded to bf16, the rest exact.
    xb, wb = x64.bfloat16().requires_grad_(), w64.float().requires_grad_()
    y = causal_conv_silu(xb, wb, pos)
    y.backward(dy.bfloat16())
    assert y.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.float32
    for name, got, want, tol in (("y", y, yr, 1e-2), ("dx", xb.grad, xr.grad, 1e-2), ("dw", wb.grad, wr.grad, 1e-2)):
        assert torch.isfinite(got).all() and _rel(got, want) < tol, (name, _rel(got, want))


def test_compiled_matches_the_compiled_reference():
    """What the model runs: the op inside torch.compile (inductor) against inductor's fusion of the reference."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, C, device="cuda", generator=gen).bfloat16()
    w = torch.randn(C, 1, W, device="cuda", generator=gen) / 2
    dy = torch.randn(B, T, C, device="cuda", generator=gen).bfloat16()
    pos = _packed_pos(1)
    results = []
    for fn in (causal_conv_silu, causal_conv_silu_reference):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = torch.compile(fn, fullgraph=True)(xi, wi, pos)
        y.backward(dy)
        results.append((y, xi.grad, wi.grad))
    for name, ours, ref in zip(("y", "dx", "dw"), *results):
        assert _rel(ours, ref.double()) < 1e-2, (name, _rel(ours, ref.double()))
