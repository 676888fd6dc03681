"""kernels.router.router_scores on a GPU at k3-mini's router shape (32,768 tokens, D 512, 176 experts): bf16 tokens
and a float32 master weight give the float32 product (as close to float64 as cuBLAS's float32 kernel), the
gradient autocast's own product gives, and the trainer's routers take the kernel on a GPU."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(32768, 512, device="cuda", generator=gen).bfloat16()
    w = 0.02 * torch.randn(176, 512, device="cuda", generator=gen)
    return x, w


def test_bf16_tokens_and_a_float32_weight_give_the_float32_product():
    from kernels.router import router_scores

    x, w = _inputs()
    truth = x.double() @ w.double().t()
    ours = (router_scores(x, w).double() - truth).abs().max()
    cublas = ((x.float() @ w.t()).double() - truth).abs().max()
    one_piece = ((x @ w.bfloat16().t()).double() - truth).abs().max()
    assert ours <= 2 * cublas, (float(ours), float(cublas))
    assert ours * 100 < one_piece


def test_the_gradient_is_autocasts_own_product():
    from kernels.router import router_scores

    x, w = _inputs()
    x.requires_grad_(True)
    w.requires_grad_(True)
    up = torch.randn(32768, 176, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    (router_scores(x, w) * up).sum().backward()
    got = x.grad, w.grad
    x.grad = w.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ((x @ w.t()).float() * up).sum().backward()
    for mine, autocasts in zip(got, (x.grad, w.grad)):
        assert mine.dtype == autocasts.dtype
        # NOTE: the same bf16 products; cuBLAS may sum them in another order for the transposed layout.
        torch.testing.assert_close(mine.float(), autocasts.float(), rtol=1e-2, atol=1e-2 * autocasts.abs().max())
