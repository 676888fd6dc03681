"""kernels.router.router_scores: the router's float32 scores from tensor-core products (Triton's interpreter on CPU).

Against float64 on ragged shapes (token, expert and width counts that are no multiple of the tiles); a float32
weight under a 16-bit x in three pieces must give the float32 product, far closer than one piece; the gradient
is the product's in x's dtype, bit for bit; the split the kernel makes is exact; bad inputs stop with one line.
In the interpreter bf16 products are wrong, so CPU runs take float16 as the 16-bit dtype (its narrower exponent
range rounds the smallest piece a little: tolerances below say so); on a GPU bf16.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch._dynamo.utils import counters

from kernels.router import router_scores
from kernels.router import scores as scores_kernel
from kernels.router.reference import weight_pieces

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
# NOTE: float16's pieces round the smallest one below its normal range (CPU); bf16 has float32's range.
SLACK = 1 if HALF == torch.bfloat16 else 4


def _inputs(n_rows, width, n_cols, seed, x_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, width, generator=gen).to(DEVICE, x_dtype)
    w = (0.02 * torch.randn(n_cols, width, generator=gen)).to(DEVICE)
    return x, w


def _truth(x, w):
    return x.double() @ w.double().t()


def _bound(x, w):
    """float32's rounding of each score: a few ulps of sum |x_d w_d| (the accumulators' own rounding)."""
    return 8 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("n_rows, width, n_cols", [(1, 16, 5), (37, 96, 12), (300, 200, 176), (129, 64, 65)])
def test_float32_inputs_give_the_float32_product(n_rows, width, n_cols):
    """The kernel's float32 dots on ragged tiles, and the op (which hands float32 x to torch's product)."""
    x, w = _inputs(n_rows, width, n_cols, seed=n_rows + width + n_cols)
    for got in (scores_kernel.scores_forward(x, w), router_scores(x, w)):
        assert got.dtype == torch.float32 and got.shape == (n_rows, n_cols)
        assert ((got.double() - _truth(x, w)).abs() <= _bound(x, w)).all()


def test_float32_inputs_under_bf16_autocast_still_give_the_float32_product():
    """Autocast would run torch's product of float32 x in bf16 (~1e-3 off); the op holds it off."""
    x, w = _inputs(64, 200, 176, seed=3)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = router_scores(x, w)
    assert got.dtype == torch.float32
    assert ((got.double() - _truth(x, w)).abs() <= _bound(x, w)).all()


@pytest.mark.parametrize("n_rows, width, n_cols", [(37, 96, 12), (300, 200, 176)])
def test_a_float32_weight_under_a_16bit_x_is_read_in_three_exact_pieces(n_rows, width, n_cols):
    x, w = _inputs(n_rows, width, n_cols, seed=7 * n_rows, x_dtype=HALF)
    truth = _truth(x, w)
    err = (router_scores(x, w).double() - truth).abs()
    one_piece = (scores_kernel.scores_forward(x, w.to(HALF)).double() - truth).abs()
    assert (err <= SLACK * _bound(x, w)).all()
    assert err.max() * 100 < one_piece.max()


def test_the_split_is_exact():
    """w = w0 + w1 + w2 with each piece bf16, as the kernel cuts them, for weights over many magnitudes."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(4096, generator=gen) * torch.logspace(-30, 30, 4096)
    w0, w1, w2 = weight_pieces(w)
    assert w0.dtype == w1.dtype == w2.dtype == torch.bfloat16
    assert torch.equal(w0.double() + w1.double() + w2.double(), w.double())


def test_the_gradient_is_the_product_in_x_dtype():
    """dx = g w and dw = g^T x with g the scores' gradient in x's dtype: what autocast's own product gives."""
    x, w = _inputs(40, 48, 9, seed=3, x_dtype=HALF)
    x.requires_grad_(True)
    w.requires_grad_(True)
    up = torch.randn(40, 9, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    (router_scores(x, w) * up).sum().backward()
    g = up.to(HALF)
    assert x.grad.dtype == HALF and w.grad.dtype == torch.float32
    assert torch.equal(x.grad, g @ w.detach().to(HALF))
    assert torch.equal(w.grad, (g.t() @ x.detach()).float())


def test_a_strided_x_and_an_empty_batch():
    base, w = _inputs(24, 80, 7, seed=5, x_dtype=HALF)
    view, w = base[:, :64], w[:, :64]  # x's row stride 80; w's made contiguous by the op
    got = router_scores(view, w)
    assert ((got.double() - _truth(view, w)).abs() <= SLACK * _bound(view, w)).all()
    assert router_scores(torch.empty(0, 64, device=DEVICE, dtype=HALF), w).shape == (0, 7)


def test_bad_inputs_stop_with_one_line():
    x, w = _inputs(4, 8, 3, seed=6)
    with pytest.raises(ValueError, match=r"w_ED has shape \(3, 8\); expected \[E, D=6\]"):
        router_scores(x[:, :6], w)
    with pytest.raises(ValueError, match="x_TD must be a 2-D bfloat16, float16 or float32 tensor"):
        router_scores(x.double(), w)
    with pytest.raises(ValueError, match=r"w_ED has dtype torch.float16; it must be float32 or x's"):
        router_scores(x, w.half())


def test_needs_triton_somewhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cuda":
        pytest.skip("on a GPU the kernel runs")
    with pytest.raises(ValueError, match="needs CUDA tensors, got device cpu"):
        router_scores(torch.zeros(4, 8), torch.zeros(3, 8))


def test_compiles_without_graph_break():
    """Inside torch.compile(fullgraph=True) the op traces as one opaque call, forward and backward."""
    counters.clear()
    x, w = _inputs(32, 64, 10, seed=8, x_dtype=HALF)
    w.requires_grad_(True)
    compiled = torch.compile(lambda a, b: torch.sigmoid(router_scores(a, b)),
                             backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    got = compiled(x, w)
    got.sum().backward()
    grad = w.grad.clone()
    w.grad = None
    want = torch.sigmoid(router_scores(x, w))
    want.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, w.grad, rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"], dict(counters["graph_break"])
