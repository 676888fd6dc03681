"""Zero-width arguments the kernels cannot serve stop with one line naming the argument, before any kernel runs
(an expert weight of no experts reached Triton's `arange` in the launch; a KDA key width of 0 divided by zero)."""

import pytest
import torch

from kernels.grouped_gemm import grouped_mm, moe_experts
from kernels.kda import chunk_kda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_grouped_mm_with_no_experts_is_refused():
    x = torch.randn(4, 8, device=DEVICE)
    w = torch.randn(0, 8, 5, device=DEVICE)
    with pytest.raises(ValueError, match=r"w has shape \(0, 8, 5\); expected \[E, K=8, M\] with E >= 1"):
        grouped_mm(x, w, torch.zeros(0, dtype=torch.int32, device=DEVICE))


def test_moe_experts_with_no_experts_is_refused():
    x = torch.randn(3, 8, device=DEVICE)
    w13, w2 = torch.randn(0, 8, 12, device=DEVICE), torch.randn(0, 12, 8, device=DEVICE)
    idx = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"w1_ELF has shape \(0, 8, 12\); .* with E >= 1"):
        moe_experts(x, w13, w13, w2, idx, torch.rand(3, 2, device=DEVICE))


def test_kda_with_a_key_width_of_zero_is_refused():
    q = torch.randn(1, 64, 2, 0, device=DEVICE)
    v = torch.randn(1, 64, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="K must be in 1..256 and V <= 256, got K=0, V=16"):
        chunk_kda(q, q, v, q, torch.rand(1, 64, 2, device=DEVICE))
