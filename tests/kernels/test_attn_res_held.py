"""The mixes' backward with its tiles held (kernels/attn_res/mix.py, LAUNCH["bwd"]["hold"]): for N up to `hold`
sources each row tile's sources, in-place gradients and handed-off gradient are loaded once, at the tile's start,
and held across the kernel's walks. Same arithmetic in the same order, so every output must equal the kernel that
reloads them, bit for bit, with and without the norm, in-place gradients and a handoff (Triton's interpreter on CPU).
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.attn_res import mix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(DEVICE, dtype)


def backward(monkeypatch, hold, N, shape, dtype, acc, add, norm):
    """mix_backward's outputs and in-place buffers after it ran with LAUNCH's `hold`, on inputs fixed by the seeds."""
    monkeypatch.setitem(mix.LAUNCH, "bwd", dict(tile=256, num_warps=4, tiles=3, hold=hold))
    D = shape[-1]
    sources = [randn(*shape, seed=n, dtype=dtype, scale=0.5 + n) for n in range(N)]
    query = randn(D, seed=20, scale=0.3)
    nw = randn(D, seed=21, scale=0.3) + 1 if norm else None
    dout = randn(*shape, seed=22, dtype=dtype)
    _, score, rstd, smax = mix.mix_forward(sources, query, EPS, norm_weight=nw, norm_eps=EPS)
    into = [randn(*shape, seed=30 + n, dtype=dtype) if (acc >> n) & 1 else None for n in range(N)]
    handed = randn(*shape, seed=40, dtype=dtype) if add else None
    return mix.mix_backward(sources, query, dout, score, rstd, smax, into=into, add_last=handed, norm_weight=nw,
                            norm_eps=EPS)


@pytest.mark.parametrize("N, acc, add, norm, shape", [
    (1, 0, False, False, (2, 7, 48)),
    (1, 1, True, True, (1, 13, 96)),
    (2, 0b01, False, True, (3, 5, 40)),
    (3, 0b101, True, False, (2, 9, 48)),
    (4, 0b1111, True, True, (1, 11, 200)),
    (4, 0b0110, False, True, (2, 6, 64)),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_held_tiles_give_the_reloading_kernels_bits(monkeypatch, N, acc, add, norm, shape, dtype):
    held = backward(monkeypatch, 4, N, shape, dtype, acc, add, norm)
    reloaded = backward(monkeypatch, 0, N, shape, dtype, acc, add, norm)
    assert len(held) == N + 1 + norm
    for i, (a, b) in enumerate(zip(held, reloaded)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i} differs"
        assert torch.isfinite(a).all()


def test_more_sources_than_held_take_the_reloading_path(monkeypatch):
    """N = 5 > hold = 4: the same outputs, since the kernel is the reloading one either way."""
    held = backward(monkeypatch, 4, 5, (2, 7, 48), torch.float32, 0b10011, True, True)
    reloaded = backward(monkeypatch, 0, 5, (2, 7, 48), torch.float32, 0b10011, True, True)
    assert all(torch.equal(a, b) for a, b in zip(held, reloaded))
