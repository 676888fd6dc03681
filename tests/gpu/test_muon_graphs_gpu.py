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


def test_graphs_match_eager_over_steps_with_skip_and_scale():
    eager, graphed = _params(0), _params(0)
    opt_e = build_optimizers(eager, _spec, lr=1e-2)
    opt_g = build_optimizers(graphed, _spec, lr=1e-2, ns_cuda_graphs=True)
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
