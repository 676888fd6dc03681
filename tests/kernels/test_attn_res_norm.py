"""The mix with the RMSNorm of what it feeds folded in (`norm_weight`, kernels.attn_res_norm_in_mix): the Triton
kernels (Triton's interpreter on CPU) against the float64 reference, the reference against the model's unfused
mix-then-norm, with gradient sinks, under torch.compile, and the model with and without it.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.attn_res import mix, pseudo_query_mix, pseudo_query_mix_reference
from kernels.attn_res.mix import MAX_SOURCES
from kernels.attn_res.sinks import GradientHandoff, GradientSink, add_handing_off, collect
from test_attn_res import debug_model_loss_and_grads, make_inputs, rel_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS, NORM_EPS = 1e-5, 1e-6


@pytest.fixture
def small_tiles(monkeypatch):
    """A few rows per tile and three tiles per backward program: many programs, ragged last ones."""
    monkeypatch.setitem(mix.LAUNCH, "fwd", dict(tile=256, num_warps=4))
    monkeypatch.setitem(mix.LAUNCH, "bwd", dict(tile=256, num_warps=4, tiles=3, hold=4))


def norm_weight(D: int, seed: int = 50) -> torch.Tensor:
    """float64 [D] away from ones, so a misplaced weight cannot pass."""
    return 1 + 0.5 * torch.randn(D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def normed_mix_with_grads(fn, sources, query, weight, dtype, weight_dtype=None, **kwargs):
    """fn's output and the gradients of every source, the query and the norm weight under a random cotangent."""
    leaves = [v.detach().to(DEVICE, dtype).requires_grad_(True) for v in sources]
    q = query.detach().to(DEVICE, dtype).requires_grad_(True)
    w = weight.detach().to(DEVICE, weight_dtype or dtype).requires_grad_(True)
    out = fn(leaves, q, EPS, norm_weight=w, norm_eps=NORM_EPS, **kwargs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out * dout.to(out)).sum().backward()
    return [out, *[v.grad for v in leaves], q.grad, w.grad]


@pytest.mark.parametrize("n_sources", [1, 2, 3, 5, MAX_SOURCES])
@pytest.mark.parametrize("shape", [(2, 5, 48), (1, 37, 96), (3, 11, 200)])
def test_float32_matches_float64_reference(small_tiles, n_sources, shape):
    """Output and every gradient (sources, query, norm weight) within float32's reach of the float64 reference,
    over ragged row counts and widths that are not powers of two."""
    sources, q = make_inputs(n_sources, shape, seed=n_sources)
    sources = [v.float().double() for v in sources]
    w = norm_weight(shape[-1]).float().double()
    got = normed_mix_with_grads(pseudo_query_mix, sources, q.float().double(), w, torch.float32)
    ref = normed_mix_with_grads(pseudo_query_mix_reference, sources, q.float().double(), w, torch.float64)
    assert got[0].dtype == torch.float32 and got[-1].dtype == torch.float32
    if n_sources == 1:  # a lone source is only normalised: the query has no gradient
        assert got[-2] is None and ref[-2] is None
        got, ref = got[:-2] + got[-1:], ref[:-2] + ref[-1:]
    for n, (a, b) in enumerate(zip(got, ref)):
        assert rel_rms(a, b) < 1e-5, n


def test_float16_sources_with_a_float32_weight_and_first_source():
    """Mixed dtypes as under autocast: the output and gradients take their own tensors' dtypes."""
    sources, q = make_inputs(3, (2, 33, 64), seed=7)
    sources = [sources[0].float().double()] + [v.half().double() for v in sources[1:]]
    w = norm_weight(64)
    leaves = [v.to(DEVICE, torch.float32 if n == 0 else torch.float16).requires_grad_(True)
              for n, v in enumerate(sources)]
    qq = q.to(DEVICE, torch.float16).requires_grad_(True)
    ww = w.to(DEVICE, torch.float32).requires_grad_(True)
    out = pseudo_query_mix(leaves, qq, EPS, norm_weight=ww, norm_eps=NORM_EPS)
    out.sum().backward()
    assert out.dtype == torch.float32 and qq.grad.dtype == torch.float16 and ww.grad.dtype == torch.float32
    assert [v.grad.dtype for v in leaves] == [torch.float32, torch.float16, torch.float16]
    ref = pseudo_query_mix_reference(sources, qq.detach().double().cpu(), EPS, w.float().double(), NORM_EPS)
    assert rel_rms(out, ref) < 2e-3


def test_the_reference_is_the_models_mix_then_its_norm():
    """In float64 (no rounding between them) the folded reference equals the model's unfused path, layers.RMSNorm
    applied to the mix, for every source count."""
    from titan_k3.models.k3.layers import RMSNorm

    norm = RMSNorm(40, NORM_EPS).double()
    with torch.no_grad():
        norm.weight.copy_(norm_weight(40))
    for n_sources in (1, 2, 4):
        sources, q = make_inputs(n_sources, (2, 9, 40), seed=20 + n_sources)
        folded = pseudo_query_mix_reference(sources, q, EPS, norm.weight, NORM_EPS)
        torch.testing.assert_close(folded, norm(pseudo_query_mix_reference(sources, q, EPS)), rtol=1e-12, atol=1e-12)


def test_a_weight_of_ones_normalises_the_plain_mixs_output(small_tiles):
    """Weight ones, eps 0: the folded mix is F.rms_norm of the plain mix's output (no other change to the mix)."""
    sources, q = make_inputs(3, (2, 13, 48), seed=4)
    f32 = [v.float() for v in sources]
    plain = pseudo_query_mix(f32, q.float(), EPS)
    folded = pseudo_query_mix(f32, q.float(), EPS, norm_weight=torch.ones(48), norm_eps=0.0)
    expect = torch.nn.functional.rms_norm(plain.double(), (48,), None, 0.0)
    assert rel_rms(folded, expect) < 1e-6


def test_with_sinks_and_a_handoff_the_gradients_are_autograds(small_tiles):
    """The folded norm in the mix that also adds into sinks and a handed-off gradient (both levers on): every
    gradient as the float64 reference's through autograd."""

    def run(fn, dtype, with_sinks):
        e = (torch.randn(2, 11, 40, generator=torch.Generator().manual_seed(30), dtype=torch.float64)).to(
            DEVICE, dtype).requires_grad_(True)
        qs = [torch.randn(40, generator=torch.Generator().manual_seed(31 + i), dtype=torch.float64).to(
            DEVICE, dtype).requires_grad_(True) for i in range(2)]
        ws = [norm_weight(40, seed=40 + i).to(DEVICE, dtype).requires_grad_(True) for i in range(2)]
        sink = GradientSink() if with_sinks else None
        block = torch.tanh(e)
        if with_sinks:
            block = collect(block, sink)
        partial = torch.sin(block) * 0.7
        handoff = GradientHandoff() if with_sinks else None
        kwargs = dict(sinks=[sink, None], handoff=handoff) if with_sinks else {}
        term = torch.cos(fn([block, partial], qs[0], EPS, norm_weight=ws[0], norm_eps=NORM_EPS, **kwargs))
        partial = partial + term if handoff is None else add_handing_off(partial, term, handoff)
        kwargs = dict(sinks=[sink, None]) if with_sinks else {}
        out = fn([block, partial], qs[1], EPS, norm_weight=ws[1], norm_eps=NORM_EPS, **kwargs)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(41), dtype=torch.float64).to(out)
        (out * g).sum().backward()
        return [e.grad, *[q.grad for q in qs], *[w.grad for w in ws]]

    truth = run(pseudo_query_mix_reference, torch.float64, with_sinks=False)
    for with_sinks in (False, True):
        for n, (got, ref) in enumerate(zip(run(pseudo_query_mix, torch.float32, with_sinks), truth)):
            assert rel_rms(got, ref) < 1e-5, (with_sinks, n)


def test_compiles_without_graph_break_and_gives_eagers_values():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    sources, q = make_inputs(3, (2, 9, 48), seed=13)
    w = norm_weight(48)

    def loss(leaves, qq, ww):
        return torch.nn.functional.silu(pseudo_query_mix(leaves, qq, EPS, norm_weight=ww, norm_eps=NORM_EPS)).sum()

    compiled = torch.compile(loss, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    results = []
    for fn in (loss, compiled):
        leaves = [v.float().to(DEVICE).requires_grad_(True) for v in sources]
        qq, ww = q.float().to(DEVICE).requires_grad_(True), w.float().to(DEVICE).requires_grad_(True)
        value = fn(leaves, qq, ww)
        value.backward()
        results.append([value, *[v.grad for v in leaves], qq.grad, ww.grad])
    assert not counters["graph_break"]
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("weight, message", [
    (torch.ones(7), r"norm_weight must be a floating tensor \[D\] = \[8\] \(the sources' width\), got \(7,\)"),
    (torch.ones(8, dtype=torch.int32), r"norm_weight must be a floating tensor \[D\] = \[8\].*torch.int32"),
    (torch.ones(8, dtype=torch.float64), r"needs bfloat16/float16/float32 sources, query and norm weight, got "
                                         r"torch.float32, torch.float64"),
])
def test_a_bad_norm_weight_raises_one_clear_error(weight, message):
    sources = [torch.randn(2, 3, 8, device=DEVICE) for _ in range(2)]
    with pytest.raises(ValueError, match=message):
        pseudo_query_mix(sources, torch.zeros(8, device=DEVICE), EPS, norm_weight=weight.to(DEVICE))


@pytest.mark.parametrize("extra, ac_mode", [([], "none"), (["--kernels.attn_res_grad_in_place", "true"], "none"),
                                            (["--kernels.attn_res_grad_in_place", "true"], "full")])
def test_the_model_with_norms_in_the_mixes_trains_like_without(extra, ac_mode):
    """kernels.attn_res_norm_in_mix: the debug flavor's loss and every parameter's gradient (the norms' weights
    included, moved off their init) as without it, alone, with the gradients summed in place, and with every block
    recomputed in the backward (activation checkpointing runs the mixes and their norms again)."""
    loss_in, grads_in, impl = debug_model_loss_and_grads("--kernels.attn_res", "triton",
                                                         "--kernels.attn_res_norm_in_mix", "true", *extra,
                                                         ac_mode=ac_mode)
    loss_out, grads_out, plain = debug_model_loss_and_grads("--kernels.attn_res", "triton")
    assert impl.attn_res_norm and not plain.attn_res_norm
    for resolved, where in ((impl, "in_mix"), (plain, "in_sublayer")):  # what the kernel report says
        assert [(c.op, c.chosen) for c in resolved.choices if c.op == "pre_norms"] == [("pre_norms", where)]
    torch.testing.assert_close(loss_in, loss_out, rtol=1e-5, atol=0.0)
    assert grads_in.keys() == grads_out.keys()
    assert any(name.endswith("attn_norm.weight") for name in grads_in) and "norm.weight" in grads_in
    for name in grads_out:
        assert rel_rms(grads_in[name], grads_out[name]) < 1e-4, name

