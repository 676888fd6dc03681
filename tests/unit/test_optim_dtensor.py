"""The optimizers and QK-Clip on DTensor parameters sharded on dim 0 (FSDP2's layout) equal the plain run.

Two CPU processes over gloo; rows that do not divide evenly across the ranks are included.
"""

import pytest
import torch
import torch.distributed as dist

from gloo_workers import spawn_gloo
from titan_k3.optim import ParamSpec, build_optimizers, qk_clip_

WORLD = 2
SHAPES = {"wq": (15, 8), "experts": (3, 6, 4), "embed": (9, 8), "norm": (8,)}
SPECS = {
    "wq": ParamSpec(use_muon=True, num_heads=3),
    "experts": ParamSpec(use_muon=True, per_expert=True),
    "embed": ParamSpec(use_muon=False),
    "norm": ParamSpec(use_muon=False, weight_decay=False),
}
H, NOPE, ROPE, V = 3, 4, 2, 3


def _inputs():
    gen = torch.Generator().manual_seed(0)
    params = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=gen) for n, s in SHAPES.items()} for _ in range(2)]
    w_qb = torch.randn(H * (NOPE + ROPE), 5, generator=gen)
    w_kvb = torch.randn(H * (NOPE + V), 7, generator=gen)
    return params, grads, w_qb, w_kvb


def _run(make, params, grads, w_qb, w_kvb):
    """Two optimizer steps and one QK-Clip; `make` turns a full tensor into the kind under test."""
    ps = {n: torch.nn.Parameter(make(t.clone())) for n, t in params.items()}
    opts = build_optimizers(ps.items(), lambda n, p: SPECS[n], lr=0.05)
    for g in grads:
        for n, p in ps.items():
            p.grad = make(g[n].clone())
        opts.step()
    qb, kvb = make(w_qb.clone()), make(w_kvb.clone())
    qk_clip_(qb, kvb, torch.tensor([10.0, 300.0, 150.0]), n_heads=H, nope_dim=NOPE, rope_dim=ROPE, v_dim=V)
    return {n: p.detach() for n, p in ps.items()}, qb, kvb


def _compare(rank, world):
    """The plain run, and the sharded one gathered whole."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    inputs = _inputs()
    plain = _run(lambda t: t, *inputs)
    params, qb, kvb = _run(lambda t: distribute_tensor(t, mesh, [Shard(0)]), *inputs)
    full = ({n: p.full_tensor() for n, p in params.items()}, qb.full_tensor(), kvb.full_tensor())
    return {"plain": plain, "sharded": full}


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_sharded_params_match_plain(tmp_path):
    result, _ = spawn_gloo(WORLD, _compare, result_file=tmp_path / "result.pt")
    (plain_params, plain_qb, plain_kvb), (params, qb, kvb) = result["plain"], result["sharded"]
    for n in SHAPES:
        torch.testing.assert_close(params[n], plain_params[n], rtol=1e-5, atol=1e-6, msg=n)
    torch.testing.assert_close(qb, plain_qb)
    torch.testing.assert_close(kvb, plain_kvb)
    assert not torch.equal(plain_qb, _inputs()[2]), "QK-Clip did nothing; the comparison proves nothing"
