"""KDA on a padded chunk layout on a GPU: one captured CUDA graph of forward and backward replays new documents.

The CPU interpreter checks the padded layout's values against the unpadded one and the reference
(tests/kernels/test_kda_layout.py); here the capture itself: nothing read on the host, shapes fixed by capacity.
"""

import pytest
import torch
from host_sync import run_without_host_sync

from kernels.kda import chunk_kda, l2norm
from kernels.kda.common import chunk_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

T, H, K, CAPACITY = 4096, 4, 128, 48


def boundaries(seed: int) -> torch.Tensor:
    """Random document ends over T tokens (host, int64): 31 + seed documents of one token or more."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randperm(T - 1, generator=gen)[:30 + seed].sort().values + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([T])])


def leaves(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, H, K, device="cuda", generator=gen)
    k = l2norm(torch.randn(1, T, H, K, device="cuda", generator=gen))
    v = torch.randn(1, T, H, K, device="cuda", generator=gen)
    g = torch.randn(1, T, H, K, device="cuda", generator=gen) * 2
    beta = torch.randn(1, T, H, device="cuda", generator=gen)
    A_log, dt_bias = torch.randn(H, device="cuda", generator=gen), torch.randn(H, K, device="cuda", generator=gen)
    return [x.to(torch.bfloat16) for x in (q, k, v, g, beta)] + [A_log, dt_bias]


def step(xs, do, **layout):
    """o and the gradients of every input of the model's call (safe gate, l2 norm, beta logits)."""
    q, k, v, g, beta, A_log, dt_bias = xs
    o, _ = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=-5.0, use_qk_l2norm=True,
                     beta_is_logit=True, **layout)
    return [o, *torch.autograd.grad(o, xs, do)]


def test_captured_graph_replays_new_documents():
    xs = [x.requires_grad_(True) for x in leaves(0)]
    do = torch.randn(1, T, H, K, device="cuda").bfloat16()
    static = chunk_layout(1, T, boundaries(1), "cuda", CAPACITY)[:3]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(xs, do, chunk_layout=static)  # compiles the kernels before capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(xs, do, chunk_layout=static)
    for seed in (2, 3):
        cu = boundaries(seed)
        for dst, src in zip(static, chunk_layout(1, T, cu, "cuda", CAPACITY)[:3]):
            dst.copy_(src)
        graph.replay()
        padded = step(xs, do, chunk_layout=chunk_layout(1, T, cu, "cuda", CAPACITY)[:3])
        unpadded = step(xs, do, cu_seqlens=cu)
        for name, a, b, c in zip(["o", "q", "k", "v", "g", "beta", "A_log", "dt_bias"], outs, padded, unpadded):
            assert torch.equal(a, b), (seed, name)
            # The same kernels on the real chunks; A_log and dt_bias sum the padding chunks' zero partials too.
            assert torch.equal(a, c) if name not in ("A_log", "dt_bias") else torch.allclose(a, c, rtol=1e-5), name


def test_padded_layout_does_not_sync():
    xs = [x.requires_grad_(True) for x in leaves(4)]
    do = torch.randn(1, T, H, K, device="cuda").bfloat16()
    cu = boundaries(5)
    layout = chunk_layout(1, T, cu, "cuda", CAPACITY)[:3]
    outs = run_without_host_sync(lambda: step(xs, do, chunk_layout=layout))
    # What ran without a sync is the real computation: every output and gradient as the unpadded call gives it.
    for name, a, b in zip(["o", "q", "k", "v", "g", "beta", "A_log", "dt_bias"], outs, step(xs, do, cu_seqlens=cu)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
