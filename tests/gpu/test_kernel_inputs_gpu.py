"""The Triton entry points on a GPU: empty KDA batches (grids of zero programs) and tensors on two devices.

A CPU tensor handed to a kernel beside CUDA ones is an illegal address once the kernel runs: each entry point must
stop first with one line naming it. The CPU suite checks the same lines with the meta device standing in.
"""

import pytest
import torch

from kernels.fused_ce import linear_cross_entropy
from kernels.grouped_gemm import grouped_mm, moe_experts
from kernels.kda import chunk_kda, l2norm
from kernels.muon import decay_add_multi_, nesterov_momentum_multi_
from kernels.short_conv import causal_conv_silu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("B, T", [(0, 128), (1, 0), (2, 0)])
def test_kda_empty_batch_or_sequence_in_bfloat16(B, T):
    H, K, V = 2, 64, 64
    q, v, g = (torch.randn(B, T, H, K, device="cuda") for _ in range(3))
    xs = [q.bfloat16(), l2norm(q).bfloat16(), v.bfloat16(), -g.abs(), torch.rand(B, T, H, device="cuda")]
    h0 = torch.randn(B, H, K, V, device="cuda")
    leaves = [x.detach().requires_grad_() for x in (*xs, h0)]
    o, S = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True)
    assert o.shape == (B, T, H, V) and torch.equal(S, h0)
    dS = torch.randn_like(S)
    (o.float().sum() + (S * dS).sum()).backward()
    torch.cuda.synchronize()
    assert torch.equal(leaves[5].grad, dS)


def test_a_cpu_tensor_beside_cuda_ones_stops_before_any_kernel():
    cuda = dict(device="cuda")
    with pytest.raises(ValueError, match="causal_conv_silu: pos is on cpu, x on cuda"):
        causal_conv_silu(torch.randn(1, 8, 4, **cuda), torch.randn(4, 1, 3, **cuda), torch.zeros(1, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="offsets is on cpu"):
        grouped_mm(torch.randn(8, 4, **cuda), torch.randn(2, 4, 3, **cuda), torch.tensor([4, 8], dtype=torch.int32))
    x, w, w2 = torch.randn(5, 8, **cuda), torch.randn(2, 8, 6, **cuda), torch.randn(2, 6, 8, **cuda)
    with pytest.raises(ValueError, match="topk_idx_TK is on cpu"):
        moe_experts(x, w, w, w2, torch.randint(0, 2, (5, 1)), torch.rand(5, 1, **cuda))
    q = torch.randn(1, 64, 1, 64, **cuda)
    with pytest.raises(ValueError, match="chunk_kda: initial_state is on cpu, q on cuda"):
        chunk_kda(q, q, q, -q.abs(), torch.rand(1, 64, 1, **cuda), initial_state=torch.zeros(1, 1, 64, 64))
    grads, bufs = [torch.randn(8, **cuda)], [torch.randn(8)]
    with pytest.raises(ValueError, match="nesterov_momentum_multi_: bufs is on cpu, grads on cuda"):
        nesterov_momentum_multi_(grads, bufs, torch.empty(8, **cuda), 0.9, True)
    with pytest.raises(ValueError, match="decay_add_multi_: update is on cpu, params on cuda"):
        decay_add_multi_(grads, torch.randn(8), 1.0, 1.0)


def test_fused_cross_entropy_refuses_float64_on_the_gpu():
    h, w = torch.randn(4, 8, device="cuda", dtype=torch.float64), torch.randn(16, 8, device="cuda", dtype=torch.float64)
    with pytest.raises(ValueError, match="float64 runs in kernels.fused_ce.reference"):
        linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.int64, device="cuda"))
