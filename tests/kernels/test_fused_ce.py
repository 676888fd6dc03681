"""kernels.fused_ce on CPU: the chunked reference and the Triton path (interpreter) vs float64 ground truth."""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.fused_ce import reference

IGNORE = -100


def _inputs(n, d, v, dtype=torch.float32, ignore_every=0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        targets[::ignore_every] = IGNORE
    return h, weight, targets


def _loss_and_grads(fn, h, weight, targets, ignore_index=IGNORE, **kwargs):
    h = h.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss_sum, n_valid = fn(h, weight, targets, ignore_index, **kwargs)
    # A non-unit upstream gradient checks that backward scales by it.
    (loss_sum * 0.37).backward()
    return loss_sum.detach(), n_valid, h.grad, weight.grad


def _ground_truth(h, weight, targets):
    return _loss_and_grads(reference.linear_cross_entropy_naive, h.double(), weight.double(), targets)


def _rel_rms(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _assert_close_to_truth(got, truth, tol):
    loss, n_valid, gh, gw = got
    t_loss, t_n, t_gh, t_gw = truth
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert n_valid.dtype == torch.int64 and n_valid.shape == () and n_valid.item() == t_n.item()
    assert abs(loss.item() - t_loss.item()) <= tol * abs(t_loss.item())
    assert _rel_rms(gh, t_gh) < tol
    assert _rel_rms(gw, t_gw) < tol


@pytest.mark.parametrize(
    "n, d, v, chunk_rows",
    [(37, 16, 53, 8), (64, 32, 300, None), (5, 8, 1, 2), (130, 24, 97, 64)],
)
def test_reference_matches_naive_float64(n, d, v, chunk_rows):
    h, weight, targets = _inputs(n, d, v, ignore_every=7)
    truth = _ground_truth(h, weight, targets)
    got = _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=chunk_rows)
    _assert_close_to_truth(got, truth, 1e-5)


def test_reference_all_ignored_gives_zero_loss_and_grads():
    h, weight, targets = _inputs(9, 8, 21)
    targets[:] = IGNORE
    loss, n_valid, gh, gw = _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=4)
    assert loss.item() == 0.0 and n_valid.item() == 0
    assert torch.equal(gh, torch.zeros_like(gh)) and torch.equal(gw, torch.zeros_like(gw))


def test_reference_ignore_index_inside_vocab():
    h, weight, targets = _inputs(20, 8, 11)
    targets[::3] = 0
    loss, n_valid, gh, _ = _loss_and_grads(
        reference.linear_cross_entropy, h, weight, targets, ignore_index=0, chunk_rows=6
    )
    t_loss, _, t_gh, _ = _loss_and_grads(
        reference.linear_cross_entropy_naive, h.double(), weight.double(), targets, ignore_index=0
    )
    keep = targets != 0
    assert n_valid.item() == int(keep.sum())
    assert abs(loss.item() - t_loss.item()) <= 1e-5 * abs(t_loss.item())
    assert torch.equal(gh[~keep], torch.zeros_like(gh[~keep]))
    assert _rel_rms(gh, t_gh) < 1e-5


def test_reference_chunk_logits_stay_bounded(monkeypatch):
    """The chunked reference never builds a logits tensor with more than chunk_rows rows."""
    h, weight, targets = _inputs(50, 8, 40)
    seen = []
    real_mm = torch.Tensor.__matmul__

    def spy(a, b):
        out = real_mm(a, b)
        if out.dim() == 2 and out.shape[1] == weight.shape[0]:
            seen.append(out.shape[0])
        return out

    monkeypatch.setattr(torch.Tensor, "__matmul__", spy)
    _loss_and_grads(reference.linear_cross_entropy, h, weight, targets, chunk_rows=16)
    assert seen and max(seen) <= 16


@pytest.mark.parametrize(
    "fn",
    [reference.linear_cross_entropy, reference.linear_cross_entropy_naive],
    ids=["chunked", "naive"],
)
@pytest.mark.parametrize(
    "case, match",
    [
        ("d_mismatch", "share D"),
        ("targets_int32", "torch.int64"),
        ("targets_len", "length N"),
        ("dtype_mismatch", "one floating dtype"),
        ("target_out_of_range", r"\[0, 11\)"),
        ("h_1d", "2-D"),
    ],
)
def test_bad_input_raises_value_error(fn, case, match):
    h, weight, targets = _inputs(6, 4, 11)
    if case == "d_mismatch":
        weight = weight[:, :3]
    elif case == "targets_int32":
        targets = targets.int()
    elif case == "targets_len":
        targets = targets[:5]
    elif case == "dtype_mismatch":
        weight = weight.double()
    elif case == "target_out_of_range":
        targets[2] = 11
    elif case == "h_1d":
        h = h[0]
    with pytest.raises(ValueError, match=match):
        fn(h, weight, targets, IGNORE)
