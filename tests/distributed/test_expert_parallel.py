"""Expert-parallel dispatch (2 gloo processes) against one process running every expert on all the tokens.

Each rank holds different tokens and half of the experts. Both dispatches
(all_gather, all_to_all) must give each rank the output, and the gradients of
its tokens, routing weights and experts, that one process computes over the
concatenated tokens with all experts; the all_gather dispatch must also
compile as one graph (fullgraph) and give the same numbers compiled; the
dispatch accounting must say what each rank sent and received.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo

# NOTE: E > 2 x 256: the all_gather dispatch sends ids as (id // 256, id % 256), and both parts must be exercised.
WORLD, T, K, E, L, F = 2, 24, 3, 520, 16, 12


def dense_experts(x_TL, w1, w3, w2, idx_TK, p_TK):
    """Every expert on every token, masked by the routing: no data-dependent shapes, so it traces whole.

    Ids == w1.shape[0] (the dispatch's "not mine") select nothing.
    """
    from kernels.grouped_gemm.reference import situ_glu

    h_ETF = situ_glu(torch.einsum("tl,elf->etf", x_TL, w1), torch.einsum("tl,elf->etf", x_TL, w3)).to(x_TL.dtype)
    y_ETL = torch.einsum("etf,efl->etl", h_ETF, w2)
    pick_TKE = (idx_TK[..., None] == torch.arange(w1.shape[0])).to(x_TL.dtype)
    return torch.einsum("tk,tke,etl->tl", p_TK, pick_TKE, y_ETL)


def problem(seed: int = 0):
    """All ranks' tokens [W*T, L], routing [W*T, K] (distinct experts per token) and all experts."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(WORLD * T, L, generator=gen, dtype=torch.float64)
    idx = torch.argsort(torch.rand(WORLD * T, E, generator=gen), dim=1)[:, :K]
    p = torch.rand(WORLD * T, K, generator=gen, dtype=torch.float64)
    w = [torch.randn(E, L, F, generator=gen, dtype=torch.float64) * 0.3,
         torch.randn(E, L, F, generator=gen, dtype=torch.float64) * 0.3,
         torch.randn(E, F, L, generator=gen, dtype=torch.float64) * 0.3]
    dy = torch.randn(WORLD * T, L, generator=gen, dtype=torch.float64)
    return z, idx, p, w, dy


def _grads(fn, z, p, w, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (z, p, *w)]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return y.detach(), [t.grad for t in leaves]


def _dispatch_runs(rank: int, world: int) -> dict:
    from titan_k3.parallel.expert_parallel import ExpertParallel

    z, idx, p, w, dy = problem()
    mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * E // world, (rank + 1) * E // world)
    out = {}
    for dispatch in ("all_gather", "all_to_all", "all_gather compiled"):
        ep = ExpertParallel(dense_experts, dist.group.WORLD, E, K, torch.device("cpu"), dispatch.split()[0])
        call = ep
        if dispatch.endswith("compiled"):
            call = torch.compile(ep._gathered, fullgraph=True, backend="aot_eager")  # any graph break raises
        y, (dz, dp, *dw) = _grads(lambda zz, pp, *ww: call(zz, *ww, idx[mine], pp),
                                  z[mine], p[mine], [x[experts] for x in w], dy[mine])
        out[dispatch] = dict(y=y, dz=dz, dp=dp, dw=dw, sent=ep.sent_W.clone(), received=ep.received_W.clone(),
                             routed=int(ep.routed_tokens))
    return out


@pytest.mark.slow
def test_dispatches_equal_one_process(tmp_path):
    ranks = spawn_gloo(WORLD, _dispatch_runs, result_file=tmp_path / "out.pt")
    z, idx, p, w, dy = problem()
    y_ref, (dz_ref, dp_ref, *dw_ref) = _grads(lambda zz, pp, *ww: dense_experts(zz, *ww, idx, pp), z, p, w, dy)
    owner = idx // (E // WORLD)  # the rank whose experts take each slot
    for rank, runs in enumerate(ranks):
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * E // WORLD, (rank + 1) * E // WORLD)
        for name, run in runs.items():
            torch.testing.assert_close(run["y"], y_ref[mine], msg=f"{name}: output, rank {rank}")
            torch.testing.assert_close(run["dz"], dz_ref[mine], msg=f"{name}: token gradient, rank {rank}")
            torch.testing.assert_close(run["dp"], dp_ref[mine], msg=f"{name}: routing-weight gradient, rank {rank}")
            for a, b in zip(run["dw"], dw_ref):
                torch.testing.assert_close(a, b[experts], msg=f"{name}: expert gradient, rank {rank}")
            sent = torch.stack([(owner[mine] == r).sum() for r in range(WORLD)])
            received = torch.stack([(owner[r * T:(r + 1) * T] == rank).sum() for r in range(WORLD)])
            assert torch.equal(run["sent"], sent) and torch.equal(run["received"], received), name
            assert run["routed"] == T, name
