"""kernels.short_conv: the Triton causal convolution + SiLU (Triton's interpreter on CPU) against the float64 reference.

Shapes with ragged row and channel tiles, packed documents (made by the model's own `Documents.build`),
one-token documents, every tap count the model may use, input validation, determinism, and the op's
registration (fake kernel and autograd, which torch.compile relies on).
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.short_conv import causal_conv_silu, causal_conv_silu_reference
from kernels.short_conv.ops import _conv_op
from titan_k3.models.k3.documents import Documents

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def positions(B: int, T: int, lengths: list[int] | None) -> torch.Tensor:
    """pos [B, T] as the model builds it: documents of the given lengths cycled within each row, every row start a
    document start; None: whole rows."""
    cuts = [0]
    for b in range(B):
        end, n = (b + 1) * T, 0
        while cuts[-1] < end:
            step = T if lengths is None else lengths[(n + b) % len(lengths)]
            cuts.append(min(end, cuts[-1] + step))
            n += 1
    return Documents.build(B, T, torch.tensor(cuts), torch.device(DEVICE)).pos_BT


def run_both(x64, w64, pos, dtype):
    """(ours y, dx, dw) in `dtype` and the float64 reference's, for one random upstream gradient."""
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr, pos)
    dy = torch.randn_like(yr)
    yr.backward(dy)
    x, w = x64.to(dtype).requires_grad_(), w64.float().requires_grad_()
    y = causal_conv_silu(x, w, pos)
    y.backward(dy.to(dtype))
    return (y, x.grad, w.grad), (yr, xr.grad, wr.grad)


@pytest.mark.parametrize("B, T, C, W, lengths", [
    (2, 37, 40, 4, [10, 3, 1, 23]),      # ragged row and channel tiles, packed documents, a one-token document
    (1, 64, 160, 4, None),              # whole rows, channels past one tile
    (3, 19, 7, 2, [1]),                 # every token its own document: only the current tap reads
    (2, 33, 48, 1, [5, 9]),             # one tap: silu(w x)
    (1, 50, 32, 3, [50]),               # an odd tap count
    (2, 29, 24, 6, [4, 11, 2]),         # taps past the four the weight-gradient pass keeps elementwise
    (2, 3, 5, 6, None),                 # more taps than tokens in a row
    (3, 1, 1, 4, None),                 # one token, one channel
])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
def test_matches_the_float64_reference(B, T, C, W, lengths, dtype, tol):
    torch.manual_seed(B * 1000 + T * 10 + W)
    x64 = torch.randn(B, T, C, dtype=torch.float64, device=DEVICE)
    w64 = torch.randn(C, 1, W, dtype=torch.float64, device=DEVICE) / W**0.5
    ours, ref = run_both(x64, w64, positions(B, T, lengths), dtype)
    for name, a, b in zip(("y", "dx", "dw"), ours, ref):
        assert a.dtype == (torch.float32 if name == "dw" else dtype)
        assert rel(a, b) < tol, (name, rel(a, b))


def test_no_token_reads_or_feeds_another_document():
    """The gradient of one document's outputs reaches only that document's inputs."""
    B, T, C, W = 1, 24, 8, 4
    pos = positions(B, T, [10, 14])
    x = torch.randn(B, T, C, device=DEVICE, requires_grad=True)
    w = torch.randn(C, 1, W, device=DEVICE)
    causal_conv_silu(x, w, pos)[:, 10:].sum().backward()
    assert x.grad[:, :10].abs().max() == 0 and x.grad[:, 10:].abs().min(dim=-1).values.gt(0).any()


def test_backward_is_deterministic():
    B, T, C, W = 2, 40, 36, 4
    pos = positions(B, T, [7, 30])
    x = torch.randn(B, T, C, device=DEVICE, requires_grad=True)
    w = torch.randn(C, 1, W, device=DEVICE, requires_grad=True)
    dy = torch.randn(B, T, C, device=DEVICE)
    grads = []
    for _ in range(2):
        x.grad = w.grad = None
        causal_conv_silu(x, w, pos).backward(dy)
        grads.append((x.grad.clone(), w.grad.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_empty_batch():
    x = torch.randn(0, 16, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(8, 1, 4, device=DEVICE, requires_grad=True)
    y = causal_conv_silu(x, w, torch.zeros(0, 16, dtype=torch.int64, device=DEVICE))
    y.sum().backward()
    assert y.shape == (0, 16, 8) and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("x_shape, w_shape, pos_shape, message", [
    ((2, 8), (8, 1, 4), (2, 8), "expected \\[B, T, C\\]"),
    ((2, 8, 6), (5, 1, 4), (2, 8), "expected \\[C=6, 1, W\\]"),
    ((2, 8, 6), (6, 4), (2, 8), "expected \\[C=6, 1, W\\]"),
    ((2, 8, 6), (6, 1, 4), (2, 9), "expected integer \\[B=2, T=8\\]"),
])
def test_bad_shapes_stop_with_one_line(x_shape, w_shape, pos_shape, message):
    with pytest.raises(ValueError, match=message):
        causal_conv_silu(torch.randn(x_shape), torch.randn(w_shape), torch.zeros(pos_shape, dtype=torch.int64))


def test_float64_points_at_the_reference():
    with pytest.raises(ValueError, match="float64 runs in kernels.short_conv.causal_conv_silu_reference"):
        causal_conv_silu(torch.randn(1, 4, 2, dtype=torch.float64), torch.randn(2, 1, 4), torch.zeros(1, 4, dtype=torch.int64))


def test_the_op_registration_holds_for_torch_compile():
    """Fake kernel, autograd formula and schema agree with the real op (what torch.compile traces through)."""
    x = torch.randn(2, 20, 12, device=DEVICE, requires_grad=True)
    w = torch.randn(12, 1, 4, device=DEVICE, requires_grad=True)
    torch.library.opcheck(_conv_op, (x, w, positions(2, 20, [6, 14])))


@pytest.mark.parametrize("fn", [causal_conv_silu, causal_conv_silu_reference], ids=["triton", "reference"])
@pytest.mark.parametrize("moved, message", [
    ("w", "causal_conv_silu: w is on meta, x on"),
    ("pos", "causal_conv_silu: pos is on meta, x on"),
])
def test_a_tensor_on_another_device_stops_with_one_line(fn, moved, message):
    """The kernels read every pointer as x's device's memory: a tensor elsewhere ran on garbage in the interpreter
    (an illegal address on a GPU). The meta device stands in for another device here."""
    args = dict(x=torch.randn(1, 8, 4, device=DEVICE), w=torch.randn(4, 1, 3, device=DEVICE),
                pos=torch.zeros(1, 8, dtype=torch.int64, device=DEVICE))
    args[moved] = args[moved].to("meta")
    with pytest.raises(ValueError, match=message):
        fn(args["x"], args["w"], args["pos"])


@pytest.mark.parametrize("w_dtype, pos_dtype, message", [
    (torch.int64, torch.int64, "w is torch.int64; expected a floating dtype"),
    (torch.float32, torch.bool, "pos is torch.bool of shape \\(1, 8\\); expected integer"),
])
def test_an_integer_weight_or_boolean_positions_stop_with_one_line(w_dtype, pos_dtype, message):
    with pytest.raises(ValueError, match=message):
        causal_conv_silu(torch.randn(1, 8, 4, device=DEVICE), torch.ones(4, 1, 3, dtype=w_dtype, device=DEVICE),
                         torch.zeros(1, 8, dtype=pos_dtype, device=DEVICE))


def test_reference_gradcheck_in_float64():
    """torch.autograd.gradcheck of the reference (the kernels' ground truth for gradients) in x and w, over packed
    documents with a one-token one."""
    gen = torch.Generator().manual_seed(40)
    x = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]])
    assert torch.autograd.gradcheck(lambda x, w: causal_conv_silu_reference(x, w, pos), (x, w))
