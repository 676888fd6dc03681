"""Per-Head Muon on CUDA: bf16 Newton–Schulz at the k3-mini expert shapes against float32, the fused steps
against the PyTorch passes, bf16 slots in the multi-tensor passes, and a skipped step with no host sync."""

import functools

import pytest
import torch

from kernels.muon import decay_add_multi_, nesterov_momentum_multi_, ns_polynomial, reference
from titan_k3.optim import muon
from titan_k3.optim import orthogonalise as ns_module
from titan_k3.optim.muon import PerHeadMuon
from titan_k3.optim.orthogonalise import NS_COEFFS, newton_schulz

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("shape, chunk", [((64, 256, 544), 0), ((64, 544, 256), 0), ((4, 512, 2560), 0),
                                          ((64, 256, 544), 24), ((64, 544, 256), 24)],
                         ids=["experts", "experts transposed", "dense", "experts in chunks",
                              "experts transposed in chunks"])
def test_bf16_newton_schulz_tracks_float32(shape, chunk):
    G = torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    O16 = newton_schulz(G, 5, dtype=torch.bfloat16, chunk=chunk).float()
    O32 = newton_schulz(G.double(), 5, dtype=torch.float64).float()
    rel = ((O16 - O32).norm() / O32.norm()).item()
    assert rel < 2e-2, rel
    s = torch.linalg.svdvals(O16.double())
    assert s.min() > 0.5 and s.max() < 1.3


def _two_steps(momentum_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(parameters before, after) two PerHeadMuon steps on one per-expert parameter."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    p = torch.nn.Parameter(torch.randn(8, 256, 544, device="cuda", generator=gen))
    before = p.detach().clone()
    p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    opt = PerHeadMuon([dict(params=[p], per_expert=True)], lr=0.02, weight_decay=0.1, momentum_dtype=momentum_dtype)
    for _ in range(2):
        opt.step()
    assert opt.state[p]["momentum_buffer"].dtype == (momentum_dtype or torch.float32)
    return before, p.detach()


@pytest.mark.parametrize("momentum_dtype", [None, torch.bfloat16], ids=["float32 momentum", "bf16 momentum"])
def test_fused_step_equals_the_torch_step(monkeypatch, momentum_dtype):
    """Two PerHeadMuon steps with the fused CUDA passes equal the same steps with the PyTorch passes.

    The fused momentum rounds once (a fused multiply-add) where PyTorch rounds twice, so a few bf16
    Newton–Schulz inputs differ by one unit in the last place: the updates agree to bf16 noise.
    """
    before, fused = _two_steps(momentum_dtype)
    for module, fn in ((muon, nesterov_momentum_multi_), (muon, decay_add_multi_), (ns_module, ns_polynomial)):
        monkeypatch.setattr(module, fn.__name__, functools.partial(fn, triton_=False))
    _, plain = _two_steps(momentum_dtype)
    update, update_ref = fused - before, plain - before
    assert ((update - update_ref).norm() / update_ref.norm()).item() < 1e-2


def test_multi_tensor_passes_with_bf16_slots_match_the_reference():
    gen = torch.Generator(device="cuda").manual_seed(2)
    sizes = [4096 * 3 + 16, 0, 160, 544 * 256]
    grads = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    bufs = [torch.randn(n, device="cuda", generator=gen) for n in sizes]
    ref_bufs = [b.clone() for b in bufs]
    out, ref_out = (torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda") for _ in range(2))
    nesterov_momentum_multi_(grads, bufs, out, 0.95, True)
    nesterov_momentum_multi_(grads, ref_bufs, ref_out, 0.95, True, triton_=False)
    torch.testing.assert_close(torch.cat(bufs), torch.cat(ref_bufs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)
    params = [b.clone() for b in bufs]
    ref_params = [b.clone() for b in bufs]
    decay_add_multi_(params, out, 0.99, -0.1)
    decay_add_multi_(ref_params, out, 0.99, -0.1, triton_=False)
    torch.testing.assert_close(torch.cat(params), torch.cat(ref_params), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [4, 130, 256, 512])
@pytest.mark.parametrize("first_step", [False, True])
def test_bf16_ns_polynomial_tracks_float64(m, first_step):
    """The Triton Newton-Schulz polynomial in bf16 on the GPU against the float64 reference: bf16 rounding only."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    X = torch.randn(6, m, 2 * m, device="cuda", generator=gen, dtype=torch.float64)
    A = X @ X.mT
    sumsq = A.diagonal(dim1=-2, dim2=-1).sum(-1) if first_step else None
    if not first_step:
        A = A / A.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    coeffs = NS_COEFFS
    want = reference.ns_polynomial(A.clone(), coeffs, scale=1.7, sumsq=sumsq)
    got = ns_polynomial(A.bfloat16(), coeffs, scale=1.7, sumsq=None if sumsq is None else sumsq.float())
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(got, got.mT)


def test_skipped_step_is_bit_identical_and_never_syncs():
    """skip_if on the device: a NaN step changes nothing, and neither it nor a normal step waits for the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in [(8, 256, 544), (512, 512)]]
    opt = PerHeadMuon([dict(params=[params[0]], per_expert=True), dict(params=[params[1]], num_heads=4)], lr=0.02)

    def state() -> list[torch.Tensor]:
        return [t for p in params for t in (p.detach(), opt.state[p]["momentum_buffer"])]

    def step(skip: bool, nan: bool) -> None:
        for p in params:
            p.grad = torch.full_like(p, float("nan")) if nan else torch.randn(p.shape, device="cuda", generator=gen)
        opt.skip_if = torch.full((), skip, dtype=torch.bool, device="cuda")  # a fill, not a host copy
        opt.step()

    step(False, nan=False)
    step(True, nan=True)  # both kernel variants compiled outside the sync check
    torch.cuda.synchronize()
    before = [t.clone() for t in state()]
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(True, nan=True)
        skipped = [t.clone() for t in state()]
        step(False, nan=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(before, skipped))
    assert all(torch.isfinite(t).all() for t in state()) and not any(torch.equal(a, b) for a, b in zip(before, state()))
