"""kernels.attn_res: the Triton pseudo-query mix (Triton's interpreter on CPU) against the float64 reference.

Also: the backward's closed form against autograd, gradient accumulation into a source used twice,
input validation, torch.compile tracing, and the model with kernels.attn_res = triton vs torch.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from kernels.attn_res import mix, pseudo_query_mix, pseudo_query_mix_reference
from kernels.attn_res.mix import MAX_SOURCES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double().to(a.device)  # a CPU reference against a GPU result
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def make_inputs(n_sources, shape, *, q_scale=1.0, seed=0):
    """float64 sources of different scales (as block sums are) and a query of RMS q_scale."""
    gen = torch.Generator().manual_seed(seed)
    D = shape[-1]
    sources = [torch.randn(*shape, generator=gen, dtype=torch.float64) * (0.5 + n) for n in range(n_sources)]
    query = torch.randn(D, generator=gen, dtype=torch.float64) * q_scale
    return sources, query


def mix_with_grads(fn, sources, query, dtype, *, seed=1):
    """fn's output and the gradients of every source and the query under a random cotangent."""
    leaves = [v.detach().to(DEVICE, dtype).requires_grad_(True) for v in sources]
    q = query.detach().to(DEVICE, dtype).requires_grad_(True)
    out = fn(leaves, q, EPS)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out * dout.to(out)).sum().backward()
    return out, [v.grad for v in leaves], q.grad


def flat(result):
    """(out, [dv_n], dq) -> [out, dv_0, ..., dq]."""
    out, dsources, dq = result
    return [out, *dsources, dq]


def assert_matches_reference(sources, query, dtype, out_tol=5e-3, grad_tol=2e-2):
    """Ours in `dtype` against the float64 reference on the same (rounded to `dtype`) inputs."""
    sources, query = [v.to(dtype).double() for v in sources], query.to(dtype).double()
    out, dsources, dq = mix_with_grads(pseudo_query_mix, sources, query, dtype)
    ref, dsources_ref, dq_ref = mix_with_grads(pseudo_query_mix_reference, sources, query, torch.float64)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_rms(out, ref) < out_tol
    for n, (dv, dv_ref) in enumerate(zip(dsources, dsources_ref)):
        assert dv.dtype == dtype and rel_rms(dv, dv_ref) < grad_tol, n
    assert dq.dtype == dtype and rel_rms(dq, dq_ref) < grad_tol


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of 256 elements: a few rows per tile, so grids have many programs and ragged last ones; each backward
    program walks three tiles, the last ones past the rows."""
    monkeypatch.setitem(mix.LAUNCH, "fwd", dict(tile=256, num_warps=4))
    monkeypatch.setitem(mix.LAUNCH, "bwd", dict(tile=256, num_warps=4, tiles=3, hold=4))


def test_backward_closed_form_matches_autograd_in_float64():
    """The formulas the backward kernel implements, in float64 PyTorch, against autograd of the reference."""
    sources, q = make_inputs(4, (3, 7, 40), seed=3)
    out, dsources_ref, dq_ref = mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    D = q.shape[0]
    v = torch.stack(sources)
    rstd = (v.pow(2).mean(-1) + EPS).rsqrt()
    s = rstd * (v @ q)
    w = torch.softmax(s, dim=0)
    ds = w * ((g * v).sum(-1) - (g * out.detach().cpu()).sum(-1))  # sum_m w_m <g, v_m> = <g, out>
    dv = w[..., None] * g + (ds * rstd)[..., None] * (q - (rstd * s)[..., None] * v / D)
    dq = ((ds * rstd)[..., None] * v).sum((0, 1, 2))
    for n in range(4):
        assert rel_rms(dv[n], dsources_ref[n]) < 1e-12
    assert rel_rms(dq, dq_ref) < 1e-12


@pytest.mark.parametrize("n_sources", [2, 3, 5, MAX_SOURCES])
@pytest.mark.parametrize("shape", [(2, 5, 48), (1, 37, 96), (3, 11, 200)])
def test_float32_matches_float64_reference(small_tiles, n_sources, shape):
    sources, q = make_inputs(n_sources, shape, seed=n_sources)
    assert_matches_reference(sources, q, torch.float32, out_tol=1e-5, grad_tol=1e-5)


@pytest.mark.parametrize("n_sources, shape", [(2, (2, 33, 64)), (5, (1, 19, 200))])
def test_float16_matches_float64_reference(small_tiles, n_sources, shape):
    sources, q = make_inputs(n_sources, shape, seed=7)
    assert_matches_reference(sources, q, torch.float16)


def test_default_tiles_with_many_rows_per_program():
    """LAUNCH as shipped: 16 rows per program at D = 200, with a ragged last program."""
    sources, q = make_inputs(3, (2, 45, 200), seed=11)
    assert_matches_reference(sources, q, torch.float32, out_tol=1e-5, grad_tol=1e-5)


def test_zero_query_is_a_plain_average_with_a_nonzero_query_gradient(small_tiles):
    """The init: q = 0 gives equal weights, and the gradient that moves q off zero is right."""
    sources, _ = make_inputs(3, (2, 9, 48), seed=5)
    zero = torch.zeros(48, dtype=torch.float64)
    out, _, dq = mix_with_grads(pseudo_query_mix, sources, zero, torch.float32)
    torch.testing.assert_close(out.double().cpu(), sum(sources) / 3, rtol=1e-5, atol=1e-6)
    assert dq.abs().max() > 0
    assert_matches_reference(sources, zero, torch.float32, out_tol=1e-5, grad_tol=1e-5)


def test_large_nearly_equal_scores_are_as_exact_as_float32_autograd(small_tiles):
    """Scores of +-hundreds (exp overflows float32 past 88) that differ by a few units between
    sources that nearly agree: the softmax must subtract its max, and the gradients are as badly
    conditioned as they get (sum_n ds_n = 0 cancels): ours may be no worse than autograd of the
    float32 reference on the same inputs."""
    (base, *noise), q = make_inputs(5, (2, 9, 96), q_scale=60.0, seed=6)
    sources, q = [(base + 1e-3 * e).float().double() for e in noise], q.float().double()
    scores = torch.stack([F.rms_norm(v, (96,), eps=EPS) @ q for v in sources])
    assert (scores.abs() > 200).float().mean() > 0.5 and (scores.max(0).values - scores.min(0).values).max() < 20
    truth = mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float64)
    eager32 = mix_with_grads(pseudo_query_mix_reference, sources, q, torch.float32)
    ours = mix_with_grads(pseudo_query_mix, sources, q, torch.float32)
    for got, ref, exact in zip(flat(ours), flat(eager32), flat(truth)):
        assert torch.isfinite(got).all()
        assert rel_rms(got, exact) <= max(1.5 * rel_rms(ref, exact), 1e-5)


def test_a_source_used_twice_and_elsewhere_accumulates_its_gradients(small_tiles):
    sources, q = make_inputs(3, (2, 7, 48), seed=8)
    grads = {}
    for name, fn, dtype in (("ours", pseudo_query_mix, torch.float32), ("ref", pseudo_query_mix_reference, torch.float64)):
        a, b, c = (v.to(DEVICE, dtype).requires_grad_(True) for v in sources)
        qq = q.to(DEVICE, dtype).requires_grad_(True)
        out = fn([a, b, a, c], qq, EPS)
        gen = torch.Generator().manual_seed(2)
        dout, da = (torch.randn(a.shape, generator=gen, dtype=torch.float64).to(a) for _ in range(2))
        ((out * dout).sum() + (a * da).sum() + fn([c, a], qq, EPS).sum()).backward()
        grads[name] = (a.grad, b.grad, c.grad, qq.grad)
    for got, ref in zip(grads["ours"], grads["ref"]):
        assert rel_rms(got, ref) < 1e-5


def test_non_contiguous_sources_and_a_query_of_another_dtype(small_tiles):
    sources, q = make_inputs(3, (2, 9, 48), seed=9)
    # transposed storage: the op makes each source contiguous first
    strided = [v.transpose(0, 1).contiguous().transpose(0, 1) for v in sources]
    assert not strided[0].is_contiguous()
    out = pseudo_query_mix([v.float().to(DEVICE) for v in strided], q.half().to(DEVICE), EPS)
    ref = pseudo_query_mix_reference(sources, q.half().double(), EPS)
    assert rel_rms(out, ref) < 1e-5
    _, _, dq = mix_with_grads(lambda s, q, eps: pseudo_query_mix(s, q.half(), eps), sources, q, torch.float32)
    _, _, dq_ref = mix_with_grads(lambda s, q, eps: pseudo_query_mix_reference(s, q.half().double(), eps),
                                  sources, q, torch.float64)
    assert dq.dtype == torch.float32 and rel_rms(dq, dq_ref) < 2e-3  # dq is rounded to the query's float16


@pytest.mark.parametrize("fn", [pseudo_query_mix, pseudo_query_mix_reference], ids=["triton", "reference"])
def test_sources_of_mixed_dtypes(small_tiles, fn):
    """bf16 autocast hands the mix a float32 embedding (source 0) and half-precision sublayer outputs."""
    sources, q = make_inputs(4, (2, 9, 48), seed=21)
    dtypes = [torch.float32, torch.float16, torch.float16, torch.float32]
    rounded = [v.to(dt).double() for v, dt in zip(sources, dtypes)]
    leaves = [v.to(DEVICE, dt).requires_grad_(True) for v, dt in zip(rounded, dtypes)]
    out = fn(leaves, q.float().to(DEVICE), EPS)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out * dout.to(out)).sum().backward()
    ref, dsources_ref, _ = mix_with_grads(pseudo_query_mix_reference, rounded, q.float().double(), torch.float64, seed=3)
    assert out.dtype == torch.float32 and rel_rms(out, ref) < 5e-3
    for v, dv_ref, dt in zip(leaves, dsources_ref, dtypes):
        assert v.grad.dtype == dt and rel_rms(v.grad, dv_ref) < 2e-2


def test_one_source_is_returned_as_it_is():
    v = torch.randn(2, 3, 8, device=DEVICE)
    assert pseudo_query_mix([v], torch.zeros(8, device=DEVICE), EPS) is v
    assert pseudo_query_mix_reference([v], torch.zeros(8, device=DEVICE), EPS) is v


def test_no_rows_gives_empty_outputs_and_a_zero_query_gradient():
    sources, q = make_inputs(3, (0, 5, 8), seed=14)
    out, dsources, dq = mix_with_grads(pseudo_query_mix, sources, q, torch.float32)
    assert out.shape == (0, 5, 8) and all(dv.shape == (0, 5, 8) for dv in dsources)
    assert torch.equal(dq, torch.zeros_like(dq))


@pytest.mark.parametrize(
    "sources, query, message",
    [
        ([], torch.zeros(8), "non-empty list"),
        (torch.zeros(2, 3, 8), torch.zeros(8), "non-empty list of"),
        ([torch.zeros(2, 3, 8), torch.zeros(2, 4, 8)], torch.zeros(8), r"source 1 is \(2, 4, 8\)"),
        ([torch.zeros(2, 3, 8), torch.zeros(2, 3, 8, device="meta")], torch.zeros(8), "on meta"),
        ([torch.zeros(2, 3, 8)] * 2, torch.zeros(7), r"query must be a floating tensor \[D\] = \[8\]"),
        ([torch.zeros(2, 3, 8)] * 2, torch.zeros(2, 8), r"got \(2, 8\)"),
        ([torch.zeros(2, 3, 8)] * 2, torch.zeros(8, dtype=torch.int64), "torch.int64"),
        ([torch.zeros(2, 3, 8, dtype=torch.int32)] * 2, torch.zeros(8), "floating tensors"),
        ([torch.zeros(2, 3, 8)] * 2, torch.zeros(8, device="meta"), "query must be on the sources' device"),
        ([torch.zeros(2, 3, 8, dtype=torch.float64)] * 2, torch.zeros(8), "float64 runs in"),
        ([torch.zeros(2, 3, 8)] * (MAX_SOURCES + 1), torch.zeros(8), f"at most {MAX_SOURCES} sources .* N={MAX_SOURCES + 1}"),
    ],
)
def test_bad_inputs_raise_one_clear_error(sources, query, message):
    with pytest.raises(ValueError, match=message):
        pseudo_query_mix(sources, query, EPS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error without the interpreter")
def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="pseudo_query_mix_reference on CPU"):
        pseudo_query_mix([torch.zeros(2, 3, 8)] * 2, torch.zeros(8), EPS)


@pytest.mark.parametrize("norm", [False, True])
def test_custom_ops_pass_opcheck(norm):
    """Schema, fake kernels and autograd registration agree with the real kernels (with and without the norm)."""
    from kernels.attn_res.ops import _mix_fwd_op

    sources, q = make_inputs(3, (2, 5, 24), seed=12)
    nw = (1 + 0.1 * torch.randn(24)).to(DEVICE).requires_grad_(True) if norm else None
    args = ([v.float().to(DEVICE).requires_grad_(True) for v in sources], q.float().to(DEVICE).requires_grad_(True), EPS,
            nw, 1e-6)
    torch.library.opcheck(_mix_fwd_op, args)


def test_compiles_without_graph_break():
    """Under torch.compile(fullgraph=True) the ops trace as opaque calls and give eager's values and gradients."""
    torch._dynamo.reset()
    counters.clear()
    sources, q = make_inputs(3, (2, 9, 48), seed=13)

    def loss(sources, q):
        return F.silu(pseudo_query_mix(sources, q, EPS)).sum()

    compiled = torch.compile(loss, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    results = []
    for fn in (loss, compiled):
        leaves = [v.float().to(DEVICE).requires_grad_(True) for v in sources]
        qq = q.float().to(DEVICE).requires_grad_(True)
        value = fn(leaves, qq)
        value.backward()
        results.append([value] + [v.grad for v in leaves] + [qq.grad])
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not counters["graph_break"], dict(counters["graph_break"])


def debug_model_loss_and_grads(*kernel_args: str, ac_mode: str = "none"):
    """The debug flavor's summed loss and every parameter's gradient on one fixed batch, in float32, with the torch
    reference everywhere but what `kernel_args` set; the pseudo-queries off their zero init (so the mixes are not
    plain averages) and the norms' weights off ones, and the routers frozen. Returns (loss, {name: grad}, the resolved
    Impl)."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.parallel.parallelize import apply_ac

    cfg = load_job_config(["--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch",
                           "--kernels.attention", "math", *kernel_args])
    impl = resolve_impl(cfg.kernels, torch.device(DEVICE))
    torch.manual_seed(0)
    model = K3Model(get_flavor("debug", 256), impl).to(DEVICE)
    model.init_weights(seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("query"):
                p.normal_(0, 0.5, generator=torch.Generator(DEVICE).manual_seed(len(name)))
            if name.endswith("norm.weight"):
                p.normal_(1, 0.3, generator=torch.Generator(DEVICE).manual_seed(len(name)))
    for r in model.moe_routers().values():
        r.update_enabled = False
    if ac_mode != "none":
        apply_ac(model, ac_mode)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = model(ids, ids)
    out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, impl


def test_model_with_triton_mixes_equals_torch_mixes():
    """kernels.attn_res = triton and = torch: the same loss and gradients on the debug flavor in float32."""
    results = {}
    for choice in ("triton", "torch"):
        loss, grads, impl = debug_model_loss_and_grads("--kernels.attn_res", choice)
        assert [(c.op, c.chosen) for c in impl.choices if c.op == "attn_res"] == [("attn_res", choice)]
        results[choice] = (loss, grads)
    (loss_t, grads_t), (loss_r, grads_r) = results["triton"], results["torch"]
    torch.testing.assert_close(loss_t, loss_r, rtol=1e-5, atol=0.0)
    assert grads_t.keys() == grads_r.keys() and any(n.endswith("mix.query") for n in grads_t)
    for name in grads_r:
        assert rel_rms(grads_t[name], grads_r[name]) < 1e-4, name


def test_a_model_with_more_sources_than_the_kernel_takes_is_refused_or_reported_before_any_work():
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl

    assert get_flavor("k3").max_mix_sources == 9 and get_flavor("k3-mini").max_mix_sources == 4
    deep = get_flavor("debug").replace(n_layers=2 * MAX_SOURCES, attn_res_block_size=2)  # 1 + 12 sources
    cuda = torch.device("cuda")  # resolving touches no GPU
    with pytest.raises(ValueError, match=f"'kernels.attn_res' = 'triton': .* up to {MAX_SOURCES + 1} sources"):
        resolve_impl(load_job_config(["--kernels.attn_res", "triton"]).kernels, cuda, deep.max_mix_sources)
    impl = resolve_impl(load_job_config([]).kernels, cuda, deep.max_mix_sources)
    choice = next(c for c in impl.choices if c.op == "attn_res")
    assert impl.attn_res is pseudo_query_mix_reference and choice.fallback and "at most" in choice.reason
    fits = resolve_impl(load_job_config([]).kernels, cuda, get_flavor("k3").max_mix_sources)
    assert fits.attn_res is pseudo_query_mix


@pytest.mark.parametrize("n_layers, block", [(4, 2), (5, 2), (3, 4), (6, 1)])
def test_max_mix_sources_is_what_the_model_reads(n_layers, block):
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl
    from titan_k3.models.k3.model import K3Model

    args = get_flavor("debug", 64).replace(n_layers=n_layers, attn_res_block_size=block)
    seen = []
    impl = reference_impl()
    impl.attn_res = lambda sources, query, eps: seen.append(len(sources)) or pseudo_query_mix_reference(sources, query, eps)
    model = K3Model(args, impl)
    model.init_weights(seed=0)
    model(torch.randint(0, 64, (1, 8)))
    assert max(seen) == args.max_mix_sources


@pytest.mark.parametrize("n_sources, norm", [(3, False), (3, True), (1, True)])
def test_reference_gradcheck_in_float64(n_sources, norm):
    """torch.autograd.gradcheck of the reference (the kernels' ground truth for gradients) in every source, the
    query and the norm weight; a lone source counts only with a norm (without one it is returned as it is)."""
    sources, query = make_inputs(n_sources, (2, 3, 5), seed=60)
    weight = torch.randn(5, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (*sources, query, *([weight] if norm else []))]

    def f(*args):
        return pseudo_query_mix_reference(list(args[:n_sources]), args[n_sources], EPS,
                                          norm_weight=args[n_sources + 1] if norm else None)

    assert torch.autograd.gradcheck(f, leaves)


def test_reference_scores_stay_float32_under_bf16_autocast():
    """The trainer runs the model under bf16 autocast, which casts a matmul's operands to bf16: the reference's
    scores (and with them the mix and every gradient) stay float32 there (docs/k3.md §2.4), as the Triton mix's do.
    (With the score product in bf16: 2.9e-3 relative error in the mix, up to 7.5e-3 in the gradients.)"""
    sources, query = make_inputs(3, (2, 33, 64), q_scale=0.5, seed=70)
    want = flat(mix_with_grads(pseudo_query_mix_reference, sources, query, torch.float64))
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = flat(mix_with_grads(pseudo_query_mix_reference, sources, query, torch.float32))
    assert all(t.dtype == torch.float32 for t in got)
    errors = [rel_rms(a, b) for a, b in zip(got, want)]  # the mix, each source's gradient, the query's
    assert max(errors) < 1e-6, errors
