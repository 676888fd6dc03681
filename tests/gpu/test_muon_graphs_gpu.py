"""Per-Head Muon with its Newton-Schulz replayed as CUDA graphs equals the eager optimizer, step for step."""

import pytest
import torch

from titan_k3.optim import ParamSpec, build_optimizers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _params(seed: int) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shapes = {"heads": (8 * 64, 256), "dense": (256, 512), "tall": (512, 128), "experts": (6, 128, 96)}
    return [(n, torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)) for n, s in shapes.items()]


def _spec(name, _p):
    return ParamSpec(use_muon=True, num_heads=8 if name == "heads" else 1, per_expert=name == "experts")


@pytest.mark.parametrize("ns_chunk", [0, 2], ids=["all blocks at once", "blocks in chunks of 2"])
def test_graphs_match_eager_over_steps_with_skip_and_scale(ns_chunk):
    eager, graphed = _params(0), _params(0)
    opt_e = build_optimizers(eager, _spec, lr=1e-2, ns_chunk=ns_chunk)
    opt_g = build_optimizers(graphed, _spec, lr=1e-2, ns_cuda_graphs=True, ns_chunk=ns_chunk)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):  # step 1 eager warm-up, step 2 capture, steps 3-5 replays
        skip = torch.tensor(step == 3, device="cuda")
        scale = torch.tensor(0.5 + 0.1 * step, device="cuda")
        for (_, pe), (_, pg) in zip(eager, graphed):
            g = torch.randn(pe.shape, device="cuda", generator=gen)
            pe.grad, pg.grad = g.clone(), g.clone()
        opt_e.step(skip_if=skip, grad_scale=scale)
        opt_g.step(skip_if=skip, grad_scale=scale)
        for (name, pe), (_, pg) in zip(eager, graphed):
            torch.testing.assert_close(pg, pe, rtol=1e-5, atol=1e-7, msg=f"{name}, step {step + 1}")
    muon = opt_g.optimizers["muon"]
    assert muon.ns_graphs is not None and len(muon.ns_graphs._graphs) > 0, "no graph was captured"


# name: (shape, num_heads, per_expert); with two ranks the straddling heads and the whole matrices are gathered
# to an owner rank, the others stay local (tests/distributed/test_muon_sharded.py has the CPU twin).
SHARDED = {"heads_aligned": ((8 * 64, 256), 8, False), "heads_straddle": ((15 * 20, 128), 15, False),
           "whole": ((256, 384), 1, False), "experts": ((6, 128, 96), 1, True)}


def _sharded_worker(rank: int, world: int, port: int, out: dict) -> None:
    import os

    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from titan_k3.optim import PerHeadMuon

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cuda", (world,))
        gen = torch.Generator(device="cuda").manual_seed(0)
        full = {n: torch.randn(s, device="cuda", generator=gen) * 0.02 for n, (s, _, _) in SHARDED.items()}
        sets = [{n: torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for n, t in full.items()}
                for _ in range(2)]
        opts = [PerHeadMuon([{"params": [ps[n]], "num_heads": h, "per_expert": e} for n, (_, h, e) in SHARDED.items()],
                            lr=1e-2, ns_cuda_graphs=graphed) for ps, graphed in zip(sets, (False, True))]
        for step in range(5):  # step 1 eager warm-up, step 2 capture, steps 3-5 replays
            grads = {n: torch.randn(s, device="cuda", generator=gen) for n, (s, _, _) in SHARDED.items()}
            for ps, opt in zip(sets, opts):
                for n, p in ps.items():
                    p.grad = distribute_tensor(grads[n].clone(), mesh, [Shard(0)])
                opt.step()
            for n in SHARDED:
                torch.testing.assert_close(sets[1][n].to_local(), sets[0][n].to_local(), rtol=1e-5, atol=1e-7,
                                           msg=f"{n}, step {step + 1}, rank {rank}")
        out[rank] = len(opts[1].ns_graphs._graphs)
    finally:
        dist.destroy_process_group()


def test_sharded_graphs_match_eager_on_every_rank():
    """The FSDP2 path (`_step_sharded`): local groups and (with two GPUs) the owner-gathered ones as graphs."""
    import torch.multiprocessing as mp
    from ports import free_port

    world = min(2, torch.cuda.device_count())
    port = free_port()
    out = mp.Manager().dict()
    mp.spawn(_sharded_worker, args=(world, port, out), nprocs=world, join=True)
    assert sorted(out.keys()) == list(range(world)) and all(n > 0 for n in out.values()), dict(out)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager Newton-Schulz", "Newton-Schulz graphs"])
def test_a_side_stream_changes_no_number(graphs):
    """optimizer.side_stream: AdamW's step and Muon's update passes on a second stream give the very same parameters
    and states as one stream, with skip and scale, over warm-up, capture and replays (a pass that read an update
    block the next group had already reused, or a flag not yet written, shows as a mismatch)."""
    def params(seed):
        named = _params(seed)
        gen = torch.Generator(device="cuda").manual_seed(seed + 7)
        return named + [("norm", torch.nn.Parameter(1 + 0.1 * torch.randn(512, device="cuda", generator=gen)))]

    def spec(name, p):
        return ParamSpec(use_muon=False) if name == "norm" else _spec(name, p)

    one, two = params(0), params(0)
    opts = [build_optimizers(ps, spec, lr=1e-2, ns_cuda_graphs=graphs, ns_chunk=2, side_stream=side)
            for ps, side in ((one, False), (two, True))]
    assert opts[0].side_stream is None and opts[1].side_stream is not None
    gen = torch.Generator(device="cuda").manual_seed(1)
    for step in range(5):
        skip = torch.tensor(step == 3, device="cuda")
        scale = torch.tensor(0.5 + 0.1 * step, device="cuda")
        for (_, pa), (_, pb) in zip(one, two):
            g = torch.randn(pa.shape, device="cuda", generator=gen)
            pa.grad, pb.grad = g.clone(), g.clone()
        for opt in opts:
            opt.step(skip_if=skip, grad_scale=scale)
        for (name, pa), (_, pb) in zip(one, two):
            assert torch.equal(pa, pb), f"{name}, step {step + 1}"
    for key in ("muon", "adamw"):
        sa, sb = (o.optimizers[key].state for o in opts)
        for pa, pb in zip(sa, sb):
            for k, v in sa[pa].items():
                assert torch.equal(v, sb[pb][k]), f"{key} state {k}"
