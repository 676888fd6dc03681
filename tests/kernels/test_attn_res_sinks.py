"""Gradient sinks and handoffs (kernels/attn_res/sinks.py, kernels.attn_res_grad_in_place): the mixes' backward
kernels sum a residual block's gradient in place and add the gradient a residual add hands them, and every gradient
equals autograd's sum (Triton's interpreter on CPU).
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.attn_res import mix, pseudo_query_mix, pseudo_query_mix_reference
from kernels.attn_res.sinks import GradientHandoff, GradientSink, add_handing_off, collect
from test_attn_res import debug_model_loss_and_grads

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double().to(a.device)
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def randn(*shape, seed, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(
        DEVICE, dtype)


@pytest.fixture
def small_tiles(monkeypatch):
    """A few rows per tile and three tiles per backward program: many programs, ragged last ones."""
    monkeypatch.setitem(mix.LAUNCH, "fwd", dict(tile=256, num_warps=4))
    monkeypatch.setitem(mix.LAUNCH, "bwd", dict(tile=256, num_warps=4, tiles=3, hold=4))


def saved_mix(N, shape):
    """(sources, query, dout, what the forward saved, the backward's gradients with nothing added) of a float32 mix."""
    sources = [randn(*shape, seed=n, dtype=torch.float32, scale=0.5 + n) for n in range(N)]
    query = randn(shape[-1], seed=9, dtype=torch.float32)
    dout = randn(*shape, seed=10, dtype=torch.float32)
    _, *saved = mix.mix_forward(sources, query, EPS)
    return sources, query, dout, saved, mix.mix_backward(sources, query, dout, *saved)


def test_the_backward_kernel_adds_into_the_buffers_it_is_given_and_writes_the_others(small_tiles):
    N, shape = 4, (2, 13, 48)
    sources, query, dout, (score, rstd, smax), fresh = saved_mix(N, shape)
    held = {1: randn(*shape, seed=11, dtype=torch.float32), 3: randn(*shape, seed=12, dtype=torch.float32)}
    before = {n: t.clone() for n, t in held.items()}
    into = [held.get(n) for n in range(N)]
    got = mix.mix_backward(sources, query, dout, score, rstd, smax, into=into)
    for n in range(N):
        if n in held:
            assert got[n] is held[n]  # written in place, returned as the gradient
            torch.testing.assert_close(got[n], before[n] + fresh[n], rtol=1e-6, atol=1e-6)
        else:
            torch.testing.assert_close(got[n], fresh[n], rtol=0, atol=0)
    torch.testing.assert_close(got[N], fresh[N], rtol=0, atol=0)  # the query's gradient


def test_the_backward_kernel_adds_a_handed_off_gradient_to_the_last_sources_and_leaves_it_as_it_was(small_tiles):
    N, shape = 3, (2, 13, 48)
    sources, query, dout, (score, rstd, smax), fresh = saved_mix(N, shape)
    handed = randn(*shape, seed=13, dtype=torch.float16)  # another dtype than the source's: read, not written
    before = handed.clone()
    held = randn(*shape, seed=14, dtype=torch.float32)
    held_before = held.clone()
    got = mix.mix_backward(sources, query, dout, score, rstd, smax, into=[None, None, held], add_last=handed)
    assert got[N - 1] is held and torch.equal(handed, before)
    torch.testing.assert_close(got[N - 1], held_before + fresh[N - 1] + handed.float(), rtol=1e-6, atol=1e-6)
    for n in range(N - 1):
        torch.testing.assert_close(got[n], fresh[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"add_last must be contiguous \(2, 13, 48\) like the last source"):
        mix.mix_backward(sources, query, dout, score, rstd, smax, add_last=handed[:, :5])


def stream_loss(sources_fn, leaves, queries, with_sinks: bool):
    """A residual stream of mixes as the model runs it: the embedding (block 0) and a block 1 completed after two
    mixes; every later mix reads them both and the open block's sum. Block 1 is also read outside the mixes (its
    gradient then arrives through autograd as well as through its sink)."""
    e, w = leaves
    sinks = [GradientSink(), GradientSink()] if with_sinks else None
    blocks = [torch.tanh(e)]
    if with_sinks:
        blocks[0] = collect(blocks[0], sinks[0])

    def mix(sources, q, handoff=None):
        kwargs = {}
        if with_sinks:
            kwargs = dict(sinks=sinks[: len(blocks)] + [None] * (len(sources) - len(blocks)), handoff=handoff)
        return sources_fn(sources, q, EPS, **kwargs)

    def add(p, term_of_mix):
        """p + term_of_mix(handoff): a residual add whose term comes from a mix reading p (its last source)."""
        handoff = GradientHandoff() if with_sinks else None
        term = term_of_mix(handoff)
        return p + term if handoff is None else add_handing_off(p, term, handoff)

    partial = torch.sin(mix(blocks + [blocks[0] * w], queries[0]))
    partial = add(partial, lambda h: torch.cos(mix(blocks + [partial], queries[1], h)))
    blocks.append(collect(partial, sinks[1]) if with_sinks else partial)
    partial = torch.sigmoid(mix(blocks, queries[2]))
    partial = add(partial, lambda h: partial * mix(blocks + [partial], queries[3], h))
    out = mix(blocks + [partial], queries[4])
    g = randn(*out.shape, seed=40, dtype=out.dtype)
    loss = (out * g).sum() + (blocks[1] * blocks[1]).sum() * 0.1
    return loss, sinks


def stream_grads(fn, dtype, with_sinks):
    e = randn(2, 11, 40, seed=30, dtype=dtype).requires_grad_(True)
    w = randn(40, seed=31, dtype=dtype).requires_grad_(True)
    queries = [randn(40, seed=32 + i, dtype=dtype).requires_grad_(True) for i in range(5)]
    loss, sinks = stream_loss(fn, (e, w), queries, with_sinks)
    loss.backward()
    return [e.grad, w.grad] + [q.grad for q in queries], sinks


def test_a_stream_of_mixes_with_sinks_has_autograds_gradients(small_tiles):
    """Blocks read by several mixes: with sinks, every leaf's and query's gradient is the float64 reference's
    (and the Triton mixes' without sinks), and each sink is empty once its block's gradient is handed on."""
    truth, _ = stream_grads(pseudo_query_mix_reference, torch.float64, with_sinks=False)
    plain, _ = stream_grads(pseudo_query_mix, torch.float32, with_sinks=False)
    sunk, sinks = stream_grads(pseudo_query_mix, torch.float32, with_sinks=True)
    for got, base, ref in zip(sunk, plain, truth):
        assert rel_rms(got, ref) < 1e-5 and rel_rms(base, ref) < 1e-5
    assert all(sink.grad is None for sink in sinks)


def test_k3_minis_stream_backward_leaves_one_add_of_its_69():
    """The stream of k3-mini's 25 mixes (12 layers, blocks of 4): autograd's backward adds 69 gradient pairs; with
    sinks and handoffs one is left (block 0's, which layer 0's attention sublayer also reads directly)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.attn_res import MixStream

    counts = {}
    for with_sinks in (False, True):
        stream = MixStream("k3-mini", pseudo_query_mix, with_sinks).to(DEVICE)
        x = torch.randn(1, 4, 512, device=DEVICE, requires_grad=True)
        out = stream(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out.backward(torch.ones_like(out))
        counts[with_sinks] = sum(e.name in ("aten::add", "aten::add_") for e in prof.events())
    assert counts == {False: 69, True: 1}


def test_a_mix_that_runs_its_backward_before_the_add_handing_off_to_it_is_an_error_not_a_lost_gradient():
    """The add must run its backward first (its term comes from the mix). Built the other way round, the mix takes
    an empty handoff; the add then raises instead of dropping its gradient for p."""
    x = torch.randn(2, 5, 16, device=DEVICE, requires_grad=True)
    p = x * 2
    handoff = GradientHandoff()
    s = add_handing_off(p, torch.ones_like(p), handoff)  # created before the mix: autograd runs it after
    m = pseudo_query_mix([x, p], torch.zeros(16, device=DEVICE), EPS, handoff=handoff)
    with pytest.raises(RuntimeError, match="ran its backward before this add's"):
        (s.sum() + m.sum()).backward()


def test_a_handoff_to_a_mix_of_one_source_is_refused():
    with pytest.raises(ValueError, match="a handoff needs a mix of two or more sources"):
        pseudo_query_mix([torch.zeros(2, 3, 8, device=DEVICE)], torch.zeros(8, device=DEVICE), EPS,
                         handoff=GradientHandoff())


def test_a_sink_whose_block_no_mix_reads_hands_on_autograds_gradient():
    x = torch.randn(3, 4, requires_grad=True)
    sink = GradientSink()
    (collect(x * 2, sink) * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3, 4), 6.0))
    assert sink.grad is None


@pytest.mark.parametrize(
    "sinks, message",
    [
        ([GradientSink()], "sinks has 1 entries for 2 sources"),
        ([object(), None], "must be None or a kernels.attn_res.sinks.GradientSink"),
        ("shared", "two sources share one GradientSink"),
    ],
)
def test_bad_sinks_raise_one_clear_error(sinks, message):
    if sinks == "shared":
        sink = GradientSink()
        sinks = [sink, sink]
    sources = [torch.zeros(2, 3, 8, device=DEVICE)] * 2
    with pytest.raises(ValueError, match=message):
        pseudo_query_mix(sources, torch.zeros(8, device=DEVICE), EPS, sinks=sinks)


def test_a_buffer_unlike_its_source_is_refused():
    sources = [torch.randn(2, 3, 8, device=DEVICE) for _ in range(2)]
    query = torch.zeros(8, device=DEVICE)
    _, score, rstd, smax = mix.mix_forward(sources, query, EPS)
    with pytest.raises(ValueError, match=r"into\[1\] must be contiguous \(2, 3, 8\) torch.float32"):
        mix.mix_backward(sources, query, torch.ones_like(sources[0]), score, rstd, smax,
                         into=[None, torch.zeros(2, 3, 8, dtype=torch.float16, device=DEVICE)])
    shared = torch.zeros_like(sources[0])
    with pytest.raises(ValueError, match="two sources' gradients would be written to one buffer"):
        mix.mix_backward(sources, query, torch.ones_like(sources[0]), score, rstd, smax, into=[shared, shared])


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_the_model_with_gradients_in_place_trains_like_without(ac_mode):
    """kernels.attn_res_grad_in_place: the debug flavor's loss and every parameter's gradient as without it, with
    and without activation checkpointing (whose recompute must not disturb the sinks)."""
    loss_in, grads_in, impl = debug_model_loss_and_grads("--kernels.attn_res", "triton",
                                                         "--kernels.attn_res_grad_in_place", "true", ac_mode=ac_mode)
    loss_out, grads_out, plain = debug_model_loss_and_grads("--kernels.attn_res", "triton")
    assert impl.attn_res_sinks and not plain.attn_res_sinks
    for resolved, sums in ((impl, "in_place"), (plain, "autograd")):  # what the kernel report says
        assert [(c.op, c.chosen) for c in resolved.choices if c.op == "attn_res_grads"] == [("attn_res_grads", sums)]
    torch.testing.assert_close(loss_in, loss_out, rtol=1e-6, atol=0.0)
    assert grads_in.keys() == grads_out.keys() and any("tok_embeddings" in n for n in grads_in)
    for name in grads_out:
        assert rel_rms(grads_in[name], grads_out[name]) < 1e-5, name


@pytest.mark.parametrize("lever", ["attn_res_grad_in_place", "attn_res_norm_in_mix"])
def test_a_lever_of_the_triton_mix_is_refused_with_the_reference_and_falls_back_with_auto(lever):
    """Both levers of the mixes (gradients in place; the pre-norms in the mixes, tests/kernels/test_attn_res_norm.py)
    need the Triton mix: asked of the torch reference they stop in one line; asked of auto without CUDA they fall back
    with the mix, reported."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.impl import resolve_impl

    cfg = load_job_config(["--kernels.attn_res", "torch", f"--kernels.{lever}", "true"])
    with pytest.raises(ValueError, match=rf"'kernels.{lever}' = true: needs the Triton mix, but this "
                                         r"run's attn_res is the torch reference \(kernels.attn_res = 'torch'\)"):
        resolve_impl(cfg.kernels, torch.device("cpu"))
    # NOTE: auto without CUDA runs the reference mix, a reported fallback; the lever falls back with it (as a GPU
    # recipe run on a CPU does), reported too, so job.strict refuses both.
    impl = resolve_impl(load_job_config([f"--kernels.{lever}", "true"]).kernels, torch.device("cpu"))
    op, on, off = {"attn_res_grad_in_place": ("attn_res_grads", "in_place", "autograd"),
                   "attn_res_norm_in_mix": ("pre_norms", "in_mix", "in_sublayer")}[lever]
    [choice] = [c for c in impl.choices if c.op == op]
    assert (choice.requested, choice.chosen, choice.fallback) == (on, off, True)
    assert choice.reason.startswith(f"kernels.{lever} needs the Triton mix; attn_res fell back: no CUDA device")
    assert not impl.attn_res_sinks and not impl.attn_res_norm
