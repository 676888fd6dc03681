"""ParallelDims: degrees resolve and bad ones stop with one clear line; each layout's meshes hold the ranks that
titan_k3/parallel/dims.py describes, without torch's mesh warnings; AC keeps Quantile Balancing single-update."""

import warnings
from types import SimpleNamespace

import pytest
import torch

from titan_k3.config import ConfigError
from titan_k3.parallel.dims import ParallelDims


def _p(rep=1, shard=-1, ep=1):
    return SimpleNamespace(data_parallel_replicate_degree=rep, data_parallel_shard_degree=shard, expert_parallel_degree=ep)


def test_degrees_resolve():
    d = ParallelDims.from_config(_p(rep=2, ep=2), world_size=8, n_experts=8)
    assert (d.dp_replicate, d.dp_shard, d.ep, d.efsdp, d.dp) == (2, 4, 2, 2, 8)
    assert ParallelDims.from_config(_p(), world_size=1, n_experts=8).dp == 1


@pytest.mark.parametrize(
    "parallelism, world, experts, key",
    [
        (_p(rep=3), 4, 8, "data_parallel_replicate_degree"),
        (_p(shard=3), 4, 8, "data_parallel_shard_degree"),
        (_p(rep=2, shard=4), 4, 8, "data_parallel_shard_degree"),
        (_p(ep=4), 2, 8, "expert_parallel_degree"),
        (_p(ep=4), 4, 6, "expert_parallel_degree"),
    ],
)
def test_bad_degree_is_one_line_config_error(parallelism, world, experts, key):
    with pytest.raises(ConfigError) as err:
        ParallelDims.from_config(parallelism, world, experts)
    message = str(err.value)
    assert f"parallelism.{key}" in message and "\n" not in message


# name: (dp_replicate, ep) on 4 ranks, dp_shard the rest
LAYOUTS = {"fsdp4": (1, 1), "fsdp4_ep2": (1, 2), "fsdp4_ep4": (1, 4), "hsdp_2x2": (2, 1), "hsdp_2x2_ep2": (2, 2)}


def _mesh_groups(rank: int, world: int) -> dict:
    """Per layout: the ranks of every mesh the run uses, whether the views share the process groups that building
    the mesh made, and the mesh warnings torch raised while building and slicing."""
    import torch.distributed as dist

    from titan_k3.parallel.distributed import setup_distributed

    def ranks(mesh):
        return [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]

    out = {}
    for name, (rep, ep) in LAYOUTS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = setup_distributed(_p(rep=rep, ep=ep), torch.device("cpu"), n_experts=8)
            dims, mesh = run.dims, run.mesh
            dense, dp_shard = dims.dense_mesh(mesh), dims.dp_shard_mesh(mesh)
            groups = {"dp": ranks(dims.dp_mesh(mesh)), "dp_shard": ranks(dp_shard), "dense": ranks(dense)}
            if ep > 1:
                groups.update(ep=ranks(mesh["ep"]), expert=ranks(dims.expert_mesh(mesh)))
            shared = (run.dp_group is dims.dp_mesh(mesh).get_group()
                      and dense.get_group(dense.ndim - 1) is dp_shard.get_group()
                      and (rep == 1 or dense.get_group(0) is mesh.get_group("dp_replicate")))
        warned = [f"{w.category.__name__}: {w.message}" for w in caught
                  if "mesh" in f"{w.message} {w.filename}".lower()]
        out[name] = (groups, (run.dp_rank, run.dp_world), shared, warned)
    return out


def _expected_groups(rank: int, world: int, rep: int, ep: int) -> dict:
    """The ranks as build_mesh always laid them out: replicas outermost, then efsdp, EP innermost."""
    shard = world // rep
    efsdp = shard // ep
    first = rank - rank % shard
    replicas = [rank % shard + r * shard for r in range(rep)]
    shards = list(range(first, first + shard))
    groups = {"dp": [list(range(world))], "dp_shard": [shards], "dense": [replicas, shards] if rep > 1 else [shards]}
    if ep > 1:
        experts = [first + e * ep + rank % ep for e in range(efsdp)]
        groups.update(ep=[list(range(rank - rank % ep, rank - rank % ep + ep))],
                      expert=[replicas, experts] if rep > 1 else [experts])
    return groups


def test_each_layout_builds_its_meshes_without_mesh_warnings(tmp_path):
    """FSDP, FSDP+EP, HSDP and HSDP+EP on 4 gloo ranks: the meshes hold the same ranks as they always did, the
    views reuse the groups made once, and no flattened dim is sliced from the world mesh (torch's UserWarning)."""
    from gloo_workers import spawn_gloo

    world = 4
    ranks = spawn_gloo(world, _mesh_groups, result_file=tmp_path / "out.pt")
    for rank, layouts in enumerate(ranks):
        for name, (rep, ep) in LAYOUTS.items():
            groups, dp_position, shared, warned = layouts[name]
            assert groups == _expected_groups(rank, world, rep, ep), (name, rank)
            assert dp_position == (rank, world) and shared, (name, rank)
            assert warned == [], (name, rank)


def test_activation_checkpointing_reuses_routing_and_updates_once():
    """Full AC recomputes every block in backward: gradients and QB state must equal the plain run's.

    Compiled blocks, with and without AC, must give the same numbers, and the
    router's recompute detection must not break the compiled graph.
    """
    from torch._dynamo.utils import counters

    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.models.k3.moe import apply_deferred_updates
    from titan_k3.parallel.parallelize import apply_ac, apply_compile

    args = get_flavor("debug", 512)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 32), generator=gen)
    runs = {}
    # "defer": the trainer's way, the bias moved by apply_deferred_updates after each backward.
    for mode in ("none", "full", "compile", "full+compile", "full+compile+defer"):
        torch._dynamo.reset()
        counters.clear()
        model = K3Model(args, reference_impl())
        model.init_weights(seed=0)
        if "full" in mode:
            apply_ac(model, "full")
        if "compile" in mode:
            apply_compile(model, "aot_eager")
        updates = []
        routers = list(model.moe_routers().values())
        for router in routers:
            original = router._update_bias
            router._update_bias = lambda *a, _o=original: (updates.append(1), _o(*a))
            router.defer_update = "defer" in mode
        for _ in range(2):  # the second forward routes with the bias the first one produced
            model(ids, ids).loss_sum.backward()
            apply_deferred_updates(routers, None)
        runs[mode] = (model, len(updates))
        if mode == "compile":
            breaks = list(counters["graph_break"])
            assert not any(b.startswith("torch.* op returned non-Tensor") for b in breaks), breaks
    (plain, n_plain), (ac, n_ac) = runs["none"], runs["full"]
    assert n_plain == n_ac == 2 * len(plain.moe_routers()), "a recompute updated the routing state again"
    for mode, (other, _) in runs.items():
        for layer, router in plain.moe_routers().items():
            assert torch.equal(router.qb_bias, other.moe_routers()[layer].qb_bias), (mode, layer)
            # a recompute that is not seen as one counts the expert load a second time (torch 2.11's compiled
            # routers, before the flag was a module global)
            assert torch.equal(router.load_counts, other.moe_routers()[layer].load_counts), (mode, layer)
            assert router.qb_bias.abs().max() > 0
        for (name, p), q in zip(plain.named_parameters(), other.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=f"{mode}: {name}")


def test_torchrun_with_one_process_trains_as_a_plain_process(monkeypatch):
    """A mesh of one has nothing to shard: no process group, no FSDP (its copies and hooks are pure overhead)."""
    import torch.distributed as dist

    from titan_k3.config import load_job_config
    from titan_k3.parallel.distributed import setup_distributed

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999", "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(key, value)
    out = setup_distributed(load_job_config([]).parallelism, torch.device("cpu"), n_experts=8)
    assert out.mesh is None and out.dp_group is None and (out.dp_rank, out.dp_world) == (0, 1)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="expert_parallel_degree"):  # degrees are still checked against the world
        setup_distributed(load_job_config(["--parallelism.expert_parallel_degree", "2"]).parallelism,
                          torch.device("cpu"), n_experts=8)


def _root_after_forward(rank: int, world: int) -> dict:
    """FSDP2 with fsdp_reshard_after_forward on: which parameters are still gathered between forward and backward,
    and whether the backward that follows gives every parameter a finite gradient."""
    from torch.distributed.tensor import DTensor

    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.parallel.distributed import setup_distributed
    from titan_k3.parallel.parallelize import apply_fsdp

    run = setup_distributed(_p(), torch.device("cpu"), n_experts=8)
    model = K3Model(get_flavor("debug", 512), reference_impl())
    model.init_weights(seed=0)
    apply_fsdp(model, run.dims, run.mesh, torch.float32, reshard_after_forward=True)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(rank))
    out = model(ids, ids)
    gathered = {name: not isinstance(p, DTensor) for name, p in
                (("output.weight", model.output.weight), ("layers.0 first weight", next(model.layers["0"].parameters())))}
    out.loss_sum.backward()
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in model.named_parameters() if p.grad is not None}
    return {"gathered": gathered, "head grad": "output.weight" in grads,
            "not finite": [name for name, g in grads.items() if not torch.isfinite(g).all()]}


def test_the_root_stays_gathered_between_forward_and_backward(tmp_path):
    """The root's parameters (the head among them) are used last in forward and first in backward: FSDP2 must not
    reshard them after forward whatever fsdp_reshard_after_forward says. Told to, torch 2.13 resharded the root and
    gathered it again for backward, and torch 2.11's loss backward read the freed head weight ('setStorage ... out of
    bounds for storage of size 0')."""
    from gloo_workers import spawn_gloo

    for result in spawn_gloo(2, _root_after_forward, result_file=tmp_path / "out.pt"):
        assert result["gathered"] == {"output.weight": True, "layers.0 first weight": False}, result
        assert result["head grad"] and result["not finite"] == [], result
