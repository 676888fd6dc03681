"""Per-Head Muon: Newton–Schulz, per-head and per-expert blocks, Nesterov momentum."""

import math

import pytest
import torch

from titan_k3.optim import ParamSpec, PerHeadMuon, muon_update, newton_schulz
from titan_k3.optim.orthogonalise import muon_scale

# The quintic's fixed band: 5 steps leave singular values in about [0.68, 1.14].
NS_BAND = (0.6, 1.25)


def _with_spectrum(rows, cols, svals, gen):
    """A [rows, cols] matrix with the given singular values and random singular vectors."""
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    return (U * torch.as_tensor(svals, dtype=torch.float64)) @ V.T


def _step(param, grad, **kw):
    opt = PerHeadMuon([{"params": [param], **kw.pop("group", {})}], lr=kw.pop("lr", 0.1), **kw)
    param.grad = grad
    opt.step()
    return opt


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (3, 32, 32)])
def test_newton_schulz_lands_in_band_from_spread_spectrum(shape):
    gen = torch.Generator().manual_seed(0)
    *batch, m, n = shape
    k = min(m, n)
    svals = torch.logspace(-1.5, 0, k, dtype=torch.float64)
    G = torch.stack([_with_spectrum(m, n, svals, gen) for _ in range(batch[0] if batch else 1)])
    G = G.float().reshape(shape)
    s_out = torch.linalg.svdvals(newton_schulz(G).double())
    s_in = torch.linalg.svdvals(G.double())
    s_in = s_in / s_in.amax(-1, keepdim=True)
    assert NS_BAND[0] <= s_out.min() and s_out.max() <= NS_BAND[1]
    assert (s_out - 1).abs().max() < 0.4 < 0.9 < (s_in - 1).abs().max()


def test_newton_schulz_batched_and_transposed_match_single():
    G = torch.randn(3, 20, 12, generator=torch.Generator().manual_seed(1))
    O = newton_schulz(G)
    for i in range(3):
        torch.testing.assert_close(O[i], newton_schulz(G[i]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(O[i], newton_schulz(G[i].T).T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(20, 12), (3, 544, 256), (2, 9, 4)], ids=["tall", "expert w2 blocks", "narrow"])
def test_a_tall_newton_schulz_equals_the_reference_on_its_transpose(shape):
    """A tall matrix iterates through a transposed copy of its input; the reference transposes it and iterates B' X
    on the wide side: the same numbers in float64, in chunks and written over the input too."""
    from kernels.muon import reference

    G = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    want = reference.newton_schulz(G, 5, dtype=torch.float64, scale=0.7)
    got = newton_schulz(G, dtype=torch.float64, scale=0.7)
    assert got.shape == G.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    scratch = G.clone()
    in_place = newton_schulz(scratch, dtype=torch.float64, scale=0.7, chunk=1, overwrite=True)
    assert in_place.data_ptr() == scratch.data_ptr()
    torch.testing.assert_close(in_place, want, rtol=1e-10, atol=1e-12)


def test_newton_schulz_rejects_vector():
    with pytest.raises(ValueError, match="at least 2 dims"):
        newton_schulz(torch.randn(5))


def test_per_head_blocks_are_orthogonalised_each():
    # A tall weight (like W_kvb) whose heads have very different gradient scales:
    # whole-matrix NS cannot give each 16x12 head block unit singular values, per-head NS does.
    gen = torch.Generator().manual_seed(2)
    H, r, c = 4, 16, 12
    grad = torch.cat([torch.randn(r, c, generator=gen) * 10.0**h for h in range(H)])
    w = torch.zeros(H * r, c)
    lr = 0.5
    _step(w, grad.clone(), lr=lr, weight_decay=0.0, momentum=0.0, group={"num_heads": H})
    update = -w / lr
    for h in range(H):
        s = torch.linalg.svdvals(update[h * r:(h + 1) * r] / muon_scale(r, c))
        assert NS_BAND[0] <= s.min() and s.max() <= NS_BAND[1], (h, s)
    whole = newton_schulz(grad)
    s_small_head = torch.linalg.svdvals(whole[:r])
    assert s_small_head.max() < 0.1, "whole-matrix NS would have drowned the small head"


def test_per_head_equals_separate_whole_matrix_params_and_h1_is_whole_matrix():
    gen = torch.Generator().manual_seed(3)
    H, r, c = 3, 8, 20
    w0 = torch.randn(H * r, c, generator=gen)
    grads = [torch.randn(H * r, c, generator=gen) for _ in range(2)]
    w = w0.clone()
    parts = [w0[h * r:(h + 1) * r].clone() for h in range(H)]
    opt = PerHeadMuon([{"params": [w], "num_heads": H}], lr=0.05)
    opt_parts = PerHeadMuon(parts, lr=0.05)
    for g in grads:
        w.grad = g.clone()
        for h, p in enumerate(parts):
            p.grad = g[h * r:(h + 1) * r].clone()
        opt.step()
        opt_parts.step()
    torch.testing.assert_close(w, torch.cat(parts), rtol=1e-5, atol=1e-6)

    # H = 1: one Nesterov step from zero momentum is (1 + mu) * g, orthogonalised whole.
    whole = torch.randn(12, 20, generator=gen)
    g = torch.randn(12, 20, generator=gen)
    _step(whole_copy := whole.clone(), g.clone(), lr=0.05, weight_decay=0.0)
    expected = whole - 0.05 * muon_scale(12, 20) * newton_schulz(1.95 * g)
    torch.testing.assert_close(whole_copy, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(w, w0 - 0.05 * muon_scale(H * r, c) * newton_schulz(1.95 * grads[0]), atol=1e-3)


def test_per_expert_batched_equals_loop_over_experts():
    gen = torch.Generator().manual_seed(4)
    E, a, b = 4, 10, 6
    w = torch.randn(E, a, b, generator=gen)
    experts = [w[e].clone() for e in range(E)]
    opt = PerHeadMuon([{"params": [w], "per_expert": True}], lr=0.02)
    opt_loop = PerHeadMuon(experts, lr=0.02)
    for _ in range(2):
        g = torch.randn(E, a, b, generator=gen)
        w.grad = g.clone()
        for e, p in enumerate(experts):
            p.grad = g[e].clone()
        opt.step()
        opt_loop.step()
    torch.testing.assert_close(w, torch.stack(experts), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_matches_hand_reference_over_three_steps(nesterov):
    gen = torch.Generator().manual_seed(5)
    H, r, c = 2, 6, 10
    lr, wd, mu = 0.03, 0.1, 0.95
    w = torch.randn(H * r, c, generator=gen)
    ref = w.clone()
    buf = torch.zeros_like(w)
    opt = PerHeadMuon([{"params": [w], "num_heads": H}], lr=lr, weight_decay=wd, momentum=mu, nesterov=nesterov)
    for _ in range(3):
        g = torch.randn(H * r, c, generator=gen)
        w.grad = g.clone()
        opt.step()
        buf = mu * buf + g
        d = g + mu * buf if nesterov else buf
        O = torch.cat([newton_schulz(d[h * r:(h + 1) * r]) for h in range(H)])
        ref = ref * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(r, c)) * O
    torch.testing.assert_close(w, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[w]["momentum_buffer"], buf)


def test_muon_update_is_pure_in_its_arguments():
    g = torch.randn(8, 4)
    buf = torch.ones(8, 4)
    u = muon_update(g, buf, ParamSpec(use_muon=True, num_heads=2), momentum=0.5)
    torch.testing.assert_close(buf, 0.5 + g)
    assert u.shape == g.shape and u.dtype == g.dtype


def test_rejects_bad_groups():
    with pytest.raises(ValueError, match="does not divide"):
        PerHeadMuon([{"params": [torch.zeros(10, 4)], "num_heads": 3}], lr=0.1)
    with pytest.raises(ValueError, match="2-D"):
        PerHeadMuon([torch.zeros(10)], lr=0.1)
    with pytest.raises(ValueError, match="momentum"):
        PerHeadMuon([torch.zeros(4, 4)], lr=0.1, momentum=1.0)


def test_step_batched_over_parameters_equals_muon_update_per_parameter():
    """Parameters whose blocks share a shape are updated in one batch; each must get its own per-parameter update."""
    gen = torch.Generator().manual_seed(6)
    # two same-shape matrices, a 2-head matrix with the same [8, 12] blocks, an expert tensor of [8, 12] experts,
    # one other shape, a second group (another lr) of the same block shape, and a parameter without a gradient
    groups = [
        {"params": [torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen), torch.randn(5, 7, generator=gen)]},
        {"params": [torch.randn(16, 12, generator=gen)], "num_heads": 2},
        {"params": [torch.randn(3, 8, 12, generator=gen)], "per_expert": True},
        {"params": [torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)], "lr": 0.05},
    ]
    specs = [ParamSpec(use_muon=True), ParamSpec(use_muon=True, num_heads=2),
             ParamSpec(use_muon=True, num_heads=1, per_expert=True), ParamSpec(use_muon=True)]
    refs = [[p.clone() for p in g["params"]] for g in groups]
    bufs = [[torch.zeros_like(p) for p in g["params"]] for g in groups]
    opt = PerHeadMuon(groups, lr=0.02, weight_decay=0.1)
    no_grad = groups[3]["params"][1]
    for _ in range(3):
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if p is no_grad:
                    continue
                g = torch.randn(p.shape, generator=gen)
                p.grad = g.clone()
                lr = group["lr"]
                update = muon_update(g, bufs[gi][pi], specs[gi])
                refs[gi][pi] = refs[gi][pi] * (1 - lr * 0.1) - lr * update
        opt.step()
    for group, ref in zip(opt.param_groups, refs):
        for p, r in zip(group["params"], ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert no_grad.grad is None and torch.equal(no_grad, refs[3][1]) and "momentum_buffer" not in opt.state[no_grad]


def test_newton_schulz_scale_rides_on_the_last_step():
    G = torch.randn(2, 12, 20, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(newton_schulz(G, scale=0.7), 0.7 * newton_schulz(G), rtol=1e-5, atol=1e-6)


def test_step_in_bf16_newton_schulz_matches_the_per_parameter_update():
    """The GPU recipe (NS in bf16): directions go to bf16 before the norm, updates stay bf16 until added to fp32."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(32, 48, generator=gen), torch.randn(4, 32, 48, generator=gen)]
    specs = [ParamSpec(use_muon=True, num_heads=2), ParamSpec(use_muon=True, per_expert=True)]
    groups = [{"params": [params[0]], "num_heads": 2}, {"params": [params[1]], "per_expert": True}]
    before = [p.clone() for p in params]
    opt = PerHeadMuon(groups, lr=0.1, weight_decay=0.0, ns_dtype=torch.bfloat16)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    for p, b, g, spec in zip(params, before, grads, specs):
        assert p.dtype == torch.float32
        exact = muon_update(g, torch.zeros_like(g), spec, ns_dtype=torch.float32)
        bf16 = muon_update(g, torch.zeros_like(g), spec, ns_dtype=torch.bfloat16)
        got = (b - p) / 0.1
        err, noise = ((got - exact).norm() / exact.norm()).item(), ((bf16 - exact).norm() / exact.norm()).item()
        assert err < 1.25 * noise + 1e-3, (err, noise)  # no worse than bf16 Newton–Schulz itself


def _muon_trajectory(momentum_dtype, steps=6):
    """(parameters at the start, after `steps` updates, momentum buffers) of one per-head matrix and one expert
    stack."""
    gen = torch.Generator().manual_seed(7)
    params = [torch.randn(32, 24, generator=gen), torch.randn(3, 16, 24, generator=gen)]
    start = [p.clone() for p in params]
    opt = PerHeadMuon([{"params": [params[0]], "num_heads": 4}, {"params": [params[1]], "per_expert": True}],
                      lr=0.02, ns_dtype=torch.float32, momentum_dtype=momentum_dtype)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return start, params, [opt.state[p]["momentum_buffer"] for p in params]


def test_bf16_momentum_is_stored_in_bf16_and_tracks_the_float32_run():
    start, ref_params, ref_bufs = _muon_trajectory(None)
    _, params, bufs = _muon_trajectory(torch.bfloat16)
    assert all(b.dtype == torch.float32 for b in ref_bufs) and all(b.dtype == torch.bfloat16 for b in bufs)
    for b, r in zip(bufs, ref_bufs):
        # one bf16 rounding per update, forgotten at rate 1 - 0.95: the buffers agree to bf16's precision
        assert (b.float() - r).norm() / r.norm() < 6e-3
    for p, r, p0 in zip(params, ref_params, start):
        moved = (r - p0).norm()
        assert 0 < (p - r).norm() < 6e-3 * moved  # the option changes the numbers, by ~0.1% of the distance moved


def test_momentum_dtype_float16_is_refused_by_name():
    with pytest.raises(ValueError, match="momentum_dtype=torch.float16"):
        PerHeadMuon([torch.zeros(4, 4)], lr=0.1, momentum_dtype=torch.float16)


@pytest.mark.parametrize("shape, chunk", [((7, 12, 20), 3), ((5, 20, 12), 2), ((2, 3, 8, 10), 4), ((4, 6, 9), 4),
                                          ((4, 6, 9), 9)], ids=["ragged tail", "transposed", "4-d", "one chunk",
                                                                "chunk above the count"])
def test_newton_schulz_in_chunks_equals_all_at_once(shape, chunk):
    """chunk only changes how many matrices each product covers, never a matrix's math (float64)."""
    G = torch.randn(shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    whole = newton_schulz(G, dtype=torch.float64, scale=0.7)
    chunked = newton_schulz(G, dtype=torch.float64, scale=0.7, chunk=chunk)
    assert chunked.shape == G.shape and chunked.is_contiguous() and chunked.dtype == torch.float64
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    # each matrix of the chunked result is that matrix's own Newton-Schulz
    torch.testing.assert_close(chunked.reshape(-1, *shape[-2:])[-1],
                               newton_schulz(G.reshape(-1, *shape[-2:])[-1], dtype=torch.float64, scale=0.7),
                               rtol=1e-12, atol=1e-12)


def test_newton_schulz_refuses_a_negative_chunk():
    with pytest.raises(ValueError, match="chunk=-1"):
        newton_schulz(torch.randn(3, 4, 5), chunk=-1)
    with pytest.raises(ValueError, match="ns_chunk=-2"):
        PerHeadMuon([torch.zeros(4, 4)], lr=0.1, ns_chunk=-2)


def test_step_with_newton_schulz_in_chunks_equals_the_unchunked_step():
    """Blocks of one shape from several parameters (experts, heads, plain matrices) in chunks that straddle them."""
    def run(ns_chunk):
        gen = torch.Generator().manual_seed(9)
        params = [torch.randn(5, 8, 12, generator=gen, dtype=torch.float64),
                  torch.randn(24, 12, generator=gen, dtype=torch.float64),
                  torch.randn(8, 12, generator=gen, dtype=torch.float64)]
        opt = PerHeadMuon([{"params": [params[0]], "per_expert": True}, {"params": [params[1]], "num_heads": 3},
                           {"params": [params[2]]}], lr=0.05, ns_dtype=torch.float64, ns_chunk=ns_chunk)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
        return params

    for got, want in zip(run(3), run(0)):  # 9 blocks of [8, 12]: chunks of 3 cross the parameters' boundaries
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_ns_chunk_config_key_is_checked_before_any_work():
    from titan_k3.config import load_job_config
    from titan_k3.config.errors import ConfigError

    with pytest.raises(ConfigError, match="'optimizer.ns_chunk' = -1: must be >= 0"):
        load_job_config(["--optimizer.ns_chunk", "-1"])


@pytest.mark.parametrize("shape, chunk", [((7, 12, 20), 3), ((5, 20, 12), 2), ((6, 10, 14), 0)],
                         ids=["chunked", "transposed, chunked", "all at once"])
def test_newton_schulz_written_over_its_input_equals_a_fresh_output(shape, chunk):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    want = newton_schulz(G, dtype=torch.float64, scale=0.7)
    scratch = G.clone()
    got = newton_schulz(scratch, dtype=torch.float64, scale=0.7, chunk=chunk, overwrite=True)
    assert got.data_ptr() == scratch.data_ptr() and got.shape == G.shape  # no output allocated
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # not when it cannot: one step (the only product reads G), another dtype (G is not the iterate), or not asked
    for kw, src in (({"steps": 1}, G.clone()), ({}, G.float()), ({"overwrite": False}, G.clone())):
        before = src.clone()
        out = newton_schulz(src, **{"dtype": torch.float64, "chunk": chunk, "overwrite": True, **kw})
        assert out.data_ptr() != src.data_ptr() and torch.equal(src, before), kw
