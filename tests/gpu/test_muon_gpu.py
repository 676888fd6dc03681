"""Per-Head Muon on CUDA: bf16 Newton–Schulz at the k3-mini expert shapes against float32, and one fused step."""

import pytest
import torch

from kernels.muon import reference
from titan_k3.optim import muon
from titan_k3.optim.muon import PerHeadMuon, newton_schulz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape", [(64, 256, 544), (64, 544, 256), (4, 512, 2560)])
def test_bf16_newton_schulz_tracks_float32(shape):
    G = torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    O16 = newton_schulz(G, 5, dtype=torch.bfloat16).float()
    O32 = newton_schulz(G.double(), 5, dtype=torch.float64).float()
    rel = ((O16 - O32).norm() / O32.norm()).item()
    assert rel < 2e-2, rel
    s = torch.linalg.svdvals(O16.double())
    assert s.min() > 0.5 and s.max() < 1.3


def _two_steps() -> tuple[torch.Tensor, torch.Tensor]:
    """(parameters before, after) two PerHeadMuon steps on one per-expert parameter."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    p = torch.nn.Parameter(torch.randn(8, 256, 544, device="cuda", generator=gen))
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    opt = PerHeadMuon([dict(params=[p], per_expert=True)], lr=0.02, weight_decay=0.1)
    for _ in range(2):
        opt.step()
    return before, p.detach()


def test_fused_step_equals_the_torch_step(monkeypatch):
    """Two PerHeadMuon steps with the fused CUDA passes equal the same steps with the PyTorch passes.

    The fused momentum rounds once (a fused multiply-add) where PyTorch rounds twice, so a few bf16
    Newton–Schulz inputs differ by one unit in the last place: the updates agree to bf16 noise.
    """
    before, fused = _two_steps()
    monkeypatch.setattr(muon, "nesterov_momentum_", reference.nesterov_momentum_)
    monkeypatch.setattr(muon, "decay_add_", reference.decay_add_)
    _, plain = _two_steps()
    update, update_ref = fused - before, plain - before
    assert ((update - update_ref).norm() / update_ref.norm()).item() < 1e-2
