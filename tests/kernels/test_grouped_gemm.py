"""grouped_gemm: Triton kernels (CPU interpreter) and references vs float64 ground truth.

Tolerances are relative RMS errors. Float32 kernels accumulate in float32 like
the reference, so forward errors sit near 1e-6; the bound 1e-3 leaves room for
summation-order differences across block sizes without hiding a wrong row.
Gradients chain two or three float32 GEMMs plus the GLU derivative, so their
bound is 5e-3. float16 operands carry ~5e-4 rounding each, so their bound is 5e-3.
Kernels run in Triton's CPU interpreter when there is no GPU (tests/kernels/conftest.py).
"""

import pytest
import torch

from kernels.grouped_gemm import reference


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_routing(n_tokens, n_experts, top_k, gen, skew=False):
    """Distinct experts per token, renormalised probabilities; skew leaves experts empty."""
    scores = torch.rand(n_tokens, n_experts, generator=gen, dtype=torch.float64)
    if skew:
        scores[:, n_experts // 2 :] -= 2.0  # the upper half is never chosen when k <= E/2
    top, idx = scores.topk(top_k, dim=1)
    prob = torch.sigmoid(top)
    return idx, prob / prob.sum(dim=1, keepdim=True)


def make_moe(n_tokens, n_experts, top_k, latent, hidden, dtype, seed=0, skew=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, latent, generator=gen, dtype=torch.float64)
    w1 = torch.randn(n_experts, latent, hidden, generator=gen, dtype=torch.float64) / latent**0.5
    w3 = torch.randn(n_experts, latent, hidden, generator=gen, dtype=torch.float64) * 8 / latent**0.5
    w2 = torch.randn(n_experts, hidden, latent, generator=gen, dtype=torch.float64) / hidden**0.5
    idx, prob = make_routing(n_tokens, n_experts, top_k, gen, skew)
    tensors = [t.to(dtype).requires_grad_() for t in (x, w1, w3, w2, prob)]
    return tensors[:4] + [idx, tensors[4]]


def naive_moe(x, w1, w3, w2, idx, prob):
    """Per-token, per-slot dense computation in float64."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = reference.situ_glu(x[t].double() @ w1[e].double(), x[t].double() @ w3[e].double())
            y[t] += prob[t, j].double() * (h @ w2[e].double())
    return y


def test_situ_glu_formula():
    g = torch.linspace(-30, 30, 101, dtype=torch.float64)
    u = torch.linspace(-90, 90, 101, dtype=torch.float64)
    want = 4 * torch.tanh(g / 4) * torch.sigmoid(g) * 25 * torch.tanh(u / 25)
    assert torch.allclose(reference.situ_glu(g, u), want, rtol=0, atol=1e-12)
    assert reference.situ_glu(g.bfloat16(), u.bfloat16()).dtype == torch.float32


def test_reference_grouped_mm_matches_loop_and_zero_tail():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([6, 6, 20, 20], dtype=torch.int32)  # empty groups 1 and 3, tail 20:23
    y = reference.grouped_mm(x, w, offsets)
    starts = [0, 6, 6, 20]
    for e, (s, end) in enumerate(zip(starts, offsets.tolist())):
        assert torch.allclose(y[s:end], x[s:end] @ w[e])
    assert torch.equal(y[20:], torch.zeros(3, 3, dtype=torch.float64))
    y.sum().backward()
    assert torch.equal(x.grad[20:], torch.zeros(3, 5, dtype=torch.float64))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("skew", [False, True])
def test_reference_moe_matches_naive(dtype, tol, skew):
    x, w1, w3, w2, idx, prob = make_moe(37, 8, 3, 16, 24, dtype, seed=2, skew=skew)
    y = reference.moe_experts(x, w1, w3, w2, idx, prob)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_rms(y, naive_moe(x, w1, w3, w2, idx, prob)) < tol


def test_route_permutation_groups_slots_stably():
    gen = torch.Generator().manual_seed(10)
    idx = torch.randint(0, 7, (50, 3), generator=gen)
    idx[:, :] = torch.where(idx == 4, 5, idx)  # expert 4 stays empty
    order, offsets = reference.route_permutation(idx, 9)
    flat = idx.reshape(-1)
    assert offsets.dtype == torch.int32
    assert torch.equal(offsets, torch.bincount(flat, minlength=9).cumsum(0).to(torch.int32))
    assert torch.equal(flat[order], flat.sort().values)
    starts = [0] + offsets[:-1].tolist()
    for e, (s, end) in enumerate(zip(starts, offsets.tolist())):
        assert (order[s:end].diff() > 0).all(), e  # stable: original slot order within an expert


def test_reference_moe_grads_match_naive():
    x, w1, w3, w2, idx, prob = make_moe(19, 6, 2, 8, 12, torch.float64, seed=3, skew=True)
    gen = torch.Generator().manual_seed(4)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    params = (x, w1, w3, w2, prob)
    got = torch.autograd.grad(reference.moe_experts(x, w1, w3, w2, idx, prob), params, dy)
    want = torch.autograd.grad(naive_moe(x, w1, w3, w2, idx, prob), params, dy)
    for g, w in zip(got, want):
        assert rel_rms(g, w) < 1e-12


# ---------------------------------------------------------------- Triton kernels (interpreter on CPU)

from kernels.grouped_gemm import grouped_mm, moe_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def float64_grads(fn, inputs, dy):
    """fn's output and input gradients evaluated in float64 (inputs: floats get grads)."""
    leaves = [t.detach().double().requires_grad_() if t.is_floating_point() else t for t in inputs]
    y = fn(*leaves)
    grads = torch.autograd.grad(y, [t for t in leaves if t.is_floating_point()], dy.double())
    return y, grads


# (rows, K, M, offsets): empty groups, one group holding every row, rows past
# offsets[-1], widths that no block size divides.
GROUPED_CASES = [
    (70, 40, 72, [10, 10, 45, 45, 61]),
    (50, 33, 20, [0, 50, 50]),
    (41, 24, 50, [0, 0, 0, 7]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_rows,red,n_cols,ends", GROUPED_CASES)
def test_grouped_mm_matches_loop(n_rows, red, n_cols, ends, dtype):
    gen = torch.Generator().manual_seed(n_rows)
    x = torch.randn(n_rows, red, generator=gen).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(len(ends), red, n_cols, generator=gen).to(DEVICE, dtype).requires_grad_()
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    dy = torch.randn(n_rows, n_cols, generator=gen).to(DEVICE, dtype)
    y = grouped_mm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    want, (want_dx, want_dw) = float64_grads(reference.grouped_mm, (x, w, offsets), dy)
    assert y.dtype == dtype
    assert rel_rms(y, want) < (1e-3 if dtype == torch.float32 else 5e-3)
    assert rel_rms(dx, want_dx) < 5e-3
    assert rel_rms(dw, want_dw) < 5e-3
    tail = ends[-1]
    assert torch.equal(y[tail:], torch.zeros_like(y[tail:]))
    assert torch.equal(dx[tail:], torch.zeros_like(dx[tail:]))
    empty = [e for e in range(len(ends)) if ends[e] == (ends[e - 1] if e else 0)]
    assert torch.equal(dw[empty], torch.zeros_like(dw[empty]))


def test_grouped_mm_tail_ignores_garbage():
    """Rows past offsets[-1] hold NaN: they must not leak into any output or gradient."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 16, generator=gen)
    x[30:] = float("nan")
    x = x.to(DEVICE).requires_grad_()
    w = torch.randn(3, 16, 8, generator=gen).to(DEVICE).requires_grad_()
    offsets = torch.tensor([12, 20, 30], dtype=torch.int32, device=DEVICE)
    y = grouped_mm(x, w, offsets)
    dx, dw = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(dw).all()
    assert torch.equal(y[30:], torch.zeros_like(y[30:]))
    assert torch.equal(dx[30:], torch.zeros_like(dx[30:]))


@pytest.mark.parametrize("skew", [False, True])
def test_moe_experts_matches_float64_reference(skew):
    x, w1, w3, w2, idx, prob = make_moe(37, 8, 3, 40, 72, torch.float32, seed=6, skew=skew)
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2)]
    idx = idx.to(DEVICE)
    prob = prob.detach().to(DEVICE).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    y = moe_experts(*inputs, idx, prob)
    grads = torch.autograd.grad(y, (*inputs, prob), dy)
    want, want_grads = float64_grads(
        lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), (*inputs, prob), dy
    )
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert rel_rms(y, want) < 1e-3
    for name, got, ref in zip(("x", "w1", "w3", "w2", "topk_weight"), grads, want_grads):
        assert got.shape == ref.shape, name
        assert rel_rms(got, ref) < 5e-3, name
    if skew:
        assert torch.equal(grads[1][4:], torch.zeros_like(grads[1][4:]))  # unused experts
    # deterministic: no atomics anywhere
    assert torch.equal(moe_experts(*inputs, idx, prob), y)


def test_moe_experts_gate_far_from_zero():
    """g spread over about +-400: the kernels take both of the gate's factors from one exp(-g/2), which must not
    overflow into inf / inf where g is far below zero, and the gate saturates at 4 far above it."""
    x, w1, w3, w2, idx, prob = make_moe(29, 4, 2, 32, 40, torch.float32, seed=26)
    w1 = (w1.detach() * 120).requires_grad_()  # g ~ N(0, 120^2)
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2)]
    idx = idx.to(DEVICE)
    prob = prob.detach().to(DEVICE).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(27)).to(DEVICE)
    g = x.detach().double() @ w1.detach().double()[0]
    assert g.min() < -200 and g.max() > 200  # the test reaches where exp(-g/2) would overflow float32
    y = moe_experts(*inputs, idx, prob)
    grads = torch.autograd.grad(y, (*inputs, prob), dy)
    want, want_grads = float64_grads(
        lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), (*inputs, prob), dy
    )
    assert torch.isfinite(y).all() and all(torch.isfinite(t).all() for t in grads)
    assert rel_rms(y, want) < 1e-3
    for name, got, ref in zip(("x", "w1", "w3", "w2", "topk_weight"), grads, want_grads):
        assert rel_rms(got, ref) < 5e-3, name


WEIGHT_MODES = ["cast-pass", "cast-in-kernel", "shadows"]


@pytest.mark.parametrize("mode", WEIGHT_MODES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_moe_experts_float32_master_weights(compiled, mode):
    """float32 weights with float16 x: the products run on the float16 weights, and each weight's gradient is the
    float32 accumulator itself: rounded to float16 it is bit for bit the gradient of weights cast outside. The
    same whether a pass casts the weights, the GEMMs round each tile as they load it (cast_in_kernel), or the
    caller hands in float16 shadows of the masters."""
    x, w1, w3, w2, idx, prob = make_moe(37, 8, 3, 40, 72, torch.float32, seed=16)
    masters = [t.detach().to(DEVICE).requires_grad_() for t in (w1, w3, w2)]
    x16 = x.detach().to(DEVICE, torch.float16).requires_grad_()
    prob16 = prob.detach().to(DEVICE, torch.float16).requires_grad_()
    idx = idx.to(DEVICE)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(17)).to(DEVICE, torch.float16)
    shadows = tuple(m.detach().half() for m in masters) if mode == "shadows" else None

    def block(a, b, c, d, p, cast_in_kernel=False, shadows=None):
        return moe_experts(a, b, c, d, idx, p, cast_in_kernel=cast_in_kernel, shadows=shadows)

    torch._dynamo.reset()
    run = torch.compile(block, fullgraph=True, backend="aot_eager") if compiled else block
    y = run(x16, *masters, prob16, cast_in_kernel=mode == "cast-in-kernel", shadows=shadows)
    got = torch.autograd.grad(y, (x16, *masters, prob16), dy)
    cast = [m.detach().half().requires_grad_() for m in masters]
    y_cast = block(x16, *cast, prob16)
    want = torch.autograd.grad(y_cast, (x16, *cast, prob16), dy)
    assert torch.equal(y, y_cast)
    assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4])  # dx, d(prob)
    for name, g, w, m in zip(("w1", "w3", "w2"), got[1:4], want[1:4], masters):
        assert g.dtype == torch.float32 and g.shape == m.shape, name
        assert torch.equal(g.half(), w), name
        assert not torch.equal(g, w.float()), name  # not a float16 gradient widened: the bits below it are kept


@pytest.mark.parametrize("mode", WEIGHT_MODES)
def test_moe_experts_keep_float16_weight_copies_for_backward_only_with_a_cast_pass(mode):
    """What the forward saves for the backward: with a cast pass, a float16 copy of each float32 master weight;
    with the cast in the kernels, the masters themselves (no copy); with shadows, the shadows (no copy)."""
    x, w1, w3, w2, idx, prob = make_moe(21, 4, 2, 32, 48, torch.float32, seed=18)
    masters = [t.detach().to(DEVICE).requires_grad_() for t in (w1, w3, w2)]
    shadows = tuple(m.detach().half() for m in masters) if mode == "shadows" else None
    x16 = x.detach().to(DEVICE, torch.float16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        moe_experts(x16, *masters, idx.to(DEVICE), prob.detach().to(DEVICE, torch.float16),
                    cast_in_kernel=mode == "cast-in-kernel", shadows=shadows)
    ptrs = {t.data_ptr() for t in saved}
    copies = [t for t in saved if t.dtype == torch.float16 and any(t.shape == m.shape for m in masters)
              and t.data_ptr() not in {s.data_ptr() for s in shadows or ()}]
    kept = ptrs & {m.data_ptr() for m in masters}
    kept_shadows = ptrs & {s.data_ptr() for s in shadows or ()}
    assert (len(copies), len(kept), len(kept_shadows)) == {"cast-pass": (3, 0, 0), "cast-in-kernel": (0, 3, 0),
                                                           "shadows": (0, 0, 3)}[mode]


@pytest.mark.parametrize("bad", ["cast_in_kernel", "dtype", "shape", "count"])
def test_moe_experts_refuses_shadows_that_cannot_stand_for_the_masters(bad):
    x, w1, w3, w2, idx, prob = make_moe(5, 4, 2, 8, 16, torch.float32, seed=19)
    masters = [t.detach().to(DEVICE) for t in (w1, w3, w2)]
    shadows = [m.half() for m in masters]
    if bad == "dtype":
        shadows[1] = shadows[1].float()
    elif bad == "shape":
        shadows[2] = shadows[2][:, :, :4].contiguous()
    elif bad == "count":
        shadows = shadows[:2]
    with pytest.raises(ValueError, match="moe_experts: .*shadow"):
        moe_experts(x.detach().to(DEVICE, torch.float16), *masters, idx.to(DEVICE), prob.detach().to(DEVICE).half(),
                    cast_in_kernel=bad == "cast_in_kernel", shadows=tuple(shadows))


@pytest.mark.parametrize("fn", [moe_experts, reference.moe_experts], ids=["triton", "reference"])
def test_moe_experts_sentinel_slots_contribute_nothing(fn, monkeypatch):
    """Slots with the id E (the EP all_gather dispatch's "another rank's expert") equal slots that are not there.

    Half the slots point past the last expert: output and every gradient must equal a float64 run in which those
    slots' weights are zero and their ids valid (any expert), and their weight gradients must be exactly zero.
    Every new floating tensor starts as NaN, so a buffer row the kernels leave unwritten (the sentinel slots' tail)
    and that anything then reads shows up.
    """
    _poison_new_tensors(monkeypatch)
    x, w1, w3, w2, idx, prob = make_moe(29, 6, 3, 24, 40, torch.float32, seed=13)
    foreign = torch.rand(idx.shape, generator=torch.Generator().manual_seed(14)) < 0.5
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2)]
    prob = torch.where(foreign, 0.0, prob.detach()).to(DEVICE).requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    y = fn(*inputs, torch.where(foreign, 6, idx).to(DEVICE), prob)
    grads = torch.autograd.grad(y, (*inputs, prob), dy)
    want, want_grads = float64_grads(
        lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx.to(DEVICE), p), (*inputs, prob), dy
    )
    assert rel_rms(y, want) < 1e-3
    for name, got, ref in zip(("x", "w1", "w3", "w2"), grads, want_grads):
        assert rel_rms(got, ref) < 5e-3, name
    d_prob = grads[4].cpu()
    assert torch.equal(d_prob[foreign], torch.zeros_like(d_prob[foreign]))
    assert rel_rms(d_prob[~foreign], want_grads[4].cpu()[~foreign]) < 5e-3


def _poison_new_tensors(monkeypatch) -> None:
    """torch.empty / empty_like return NaN-filled floating tensors (stale memory made visible) until the test ends."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))


@pytest.mark.parametrize("fn", [moe_experts, reference.moe_experts], ids=["triton", "reference"])
def test_moe_experts_empty_batch(fn):
    """No tokens (an empty microbatch shard): zero-size output, zero weight gradients."""
    x, w1, w3, w2, idx, prob = make_moe(0, 4, 2, 16, 24, torch.float32, seed=11)
    params = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2, prob)]
    y = fn(*params[:4], idx.to(DEVICE), params[4])
    grads = torch.autograd.grad(y.sum(), params)
    assert y.shape == (0, 16)
    assert [g.shape for g in grads] == [p.shape for p in params]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_moe_experts_rejects_bad_input():
    x, w1, w3, w2, idx, prob = make_moe(8, 4, 2, 16, 16, torch.float32, seed=8)
    with pytest.raises(ValueError, match="topk_idx_TK"):
        moe_experts(x, w1, w3, w2, idx.int(), prob)
    with pytest.raises(ValueError, match="w2_EFL"):
        moe_experts(x, w1, w3, w2[:, :8], idx, prob)
    with pytest.raises(ValueError, match="w1_ELF"):
        moe_experts(x, w1.double(), w3, w2, idx, prob)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mm(x, w1, torch.tensor([2, 4, 6, 8]))


def test_custom_ops_compile_without_graph_break():
    """fullgraph=True fails on any graph break; aot_eager runs the fake impls and autograd formulas."""
    x, w1, w3, w2, idx, prob = make_moe(16, 4, 2, 16, 24, torch.float32, seed=9)
    inputs = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2, prob)]
    idx = idx.to(DEVICE)

    def block(a, b, c, d, p):
        return moe_experts(a, b, c, d, idx, p).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(*inputs), inputs)
    want = torch.autograd.grad(block(*inputs), inputs)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_measured_key_compiles_its_winner_alone(monkeypatch):
    """kernels/grouped_gemm/tuned.py: on the measured GPU, dtype and key, autotune gets one candidate; else all."""
    from kernels.grouped_gemm import tuned

    class Operand:  # what the prune reads of a kernel's first argument
        def __init__(self, device="cuda", dtype=torch.bfloat16):
            self.device, self.dtype = torch.device(device), dtype

    monkeypatch.setattr(tuned.torch.cuda, "get_device_capability", lambda device: (9, 0))
    prune = tuned.prune_to_tuned("glu_up", ["L", "F", "N_EXPERTS", "STORE_GU"])
    candidates = ["c0", "c1", "c2"]
    measured = {"x_ptr": Operand(), "n_rows": 4096, "L": 256, "F": 544, "STORE_GU": True}
    assert prune(candidates, measured, N_EXPERTS=176) == ["c2"]
    assert prune(candidates, {**measured, "F": 512}, N_EXPERTS=176) == candidates  # another shape
    assert prune(candidates, measured, N_EXPERTS=88) == candidates  # another expert count (EP's local experts)
    assert prune(candidates, {**measured, "x_ptr": Operand(dtype=torch.float16)}, N_EXPERTS=176) == candidates
    assert prune(candidates, {**measured, "x_ptr": Operand("cpu")}, N_EXPERTS=176) == candidates
    monkeypatch.setattr(tuned.torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert prune(candidates, measured, N_EXPERTS=176) == candidates  # another GPU architecture


def test_every_known_winner_names_a_candidate_of_its_kernel(monkeypatch):
    """The GPU candidate lists (not the interpreter's single config) hold every tuned index, with the tile the
    results name (benchmarks/results/grouped_gemm.md: session 8, and the broader sweep of session 14)."""
    from kernels.grouped_gemm import triton_gemm, tuned

    monkeypatch.setattr(triton_gemm, "INTERPRET", False)
    candidates = {"mm": triton_gemm.mm_configs(), "mm_dual": triton_gemm.epilogue_configs(),
                  "wgrad": triton_gemm.wgrad_configs(dual=False), "wgrad_dual": triton_gemm.wgrad_configs(dual=True),
                  "glu_up": triton_gemm.epilogue_configs()}
    winners = {(kernel, key[0]): (candidates[kernel][index].kwargs, candidates[kernel][index].num_warps,
                                  candidates[kernel][index].num_stages)
               for (kernel, _, _, key), index in tuned.TUNED.items()}
    assert winners == {
        ("mm", 544): ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, 8, 3),
        ("mm", 256): ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 3),
        ("mm_dual", 544): ({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, 8, 3),
        ("wgrad", 544): ({"BLOCK_K": 128, "BLOCK_N": 128, "BLOCK_R": 64}, 8, 3),
        ("wgrad_dual", 256): ({"BLOCK_K": 128, "BLOCK_N": 64, "BLOCK_R": 64}, 4, 4),
        ("glu_up", 256): ({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64}, 4, 3),
    }


def test_experts_cast_in_kernel_is_our_kernels_lever_and_refused_without_them():
    import functools

    from titan_k3.config import load_job_config
    from titan_k3.models.k3.impl import resolve_impl

    cfg = load_job_config(["--kernels.experts", "triton", "--kernels.experts_cast_in_kernel", "true"])
    impl = resolve_impl(cfg.kernels, torch.device(DEVICE))
    assert isinstance(impl.experts, functools.partial) and impl.experts.func is moe_experts
    assert impl.experts.keywords == {"cast_in_kernel": True}
    assert [(c.op, c.chosen) for c in impl.choices if c.op == "expert_weights"] == [("expert_weights", "cast_in_kernel")]
    plain = resolve_impl(load_job_config(["--kernels.experts", "triton"]).kernels, torch.device(DEVICE))
    assert plain.experts is moe_experts
    assert [(c.op, c.chosen) for c in plain.choices if c.op == "expert_weights"] == [("expert_weights", "cast_pass")]
    cfg = load_job_config(["--kernels.experts", "torch", "--kernels.experts_cast_in_kernel", "true"])
    with pytest.raises(ValueError, match=r"'kernels.experts_cast_in_kernel' = true: needs our Triton experts, but "
                                         r"this run's experts is the torch reference \(kernels.experts = 'torch'\)"):
        resolve_impl(cfg.kernels, torch.device("cpu"))
    # NOTE: auto without CUDA runs the reference, a reported fallback; the lever falls back with it (as a GPU recipe
    # run on a CPU does), reported too, so job.strict refuses both.
    impl = resolve_impl(load_job_config(["--kernels.experts_cast_in_kernel", "true"]).kernels, torch.device("cpu"))
    assert impl.experts is reference.moe_experts
    [lever] = [c for c in impl.choices if c.op == "expert_weights"]
    assert (lever.requested, lever.chosen, lever.fallback) == ("cast_in_kernel", "cast_pass", True)
    assert lever.reason.startswith("kernels.experts_cast_in_kernel needs our Triton experts; experts fell back: no CUDA")


def test_reference_gradcheck_in_float64():
    """torch.autograd.gradcheck of the references (the kernels' ground truth for gradients): grouped_mm over an
    empty group and rows past offsets[-1], the expert block over every differentiable input."""
    gen = torch.Generator().manual_seed(50)
    x = torch.randn(7, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 2, 6], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda x, w: reference.grouped_mm(x, w, offsets), (x, w))
    x, w1, w3, w2, idx, prob = make_moe(5, 3, 2, 3, 4, torch.float64, seed=51)
    assert torch.autograd.gradcheck(lambda *p: reference.moe_experts(*p[:4], idx, p[4]), (x, w1, w3, w2, prob))


def test_strided_inputs_match_the_float64_reference():
    """Transposed and sliced views (never made contiguous by the caller): the kernels read them through their
    strides."""
    gen = torch.Generator().manual_seed(52)
    x = torch.randn(8, 30, generator=gen).t().to(DEVICE).requires_grad_()  # [30, 8], column-major
    w = torch.randn(3, 5, 8, generator=gen).transpose(1, 2).to(DEVICE).requires_grad_()  # [3, 8, 5]
    offsets = torch.tensor([10, 10, 27], dtype=torch.int32, device=DEVICE)
    dy = torch.randn(30, 5, generator=gen).to(DEVICE)
    y = grouped_mm(x, w, offsets)
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    want, want_grads = float64_grads(reference.grouped_mm, (x, w, offsets), dy)
    for name, a, b in zip(("y", "dx", "dw"), got, (want, *want_grads)):
        assert rel_rms(a, b) < 1e-5, name
    x, w1, w3, w2, idx, prob = make_moe(9, 4, 2, 16, 24, torch.float32, seed=53)
    x_view = torch.cat([x.detach(), x.detach()], dim=1)[:, ::2].to(DEVICE).requires_grad_()  # column stride 2
    w2_view = w2.detach().transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE).requires_grad_()
    inputs = [x_view, w1.detach().to(DEVICE).requires_grad_(), w3.detach().to(DEVICE).requires_grad_(), w2_view]
    prob = prob.detach().to(DEVICE).requires_grad_()
    idx = idx.to(DEVICE)
    dy = torch.randn(x.shape, generator=gen).to(DEVICE)
    y = moe_experts(*inputs, idx, prob)
    got = (y, *torch.autograd.grad(y, (*inputs, prob), dy))
    want, want_grads = float64_grads(lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), (*inputs, prob), dy)
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), got, (want, *want_grads)):
        assert rel_rms(a, b) < 1e-5, name


def test_moe_experts_float16_matches_float64_reference():
    x, w1, w3, w2, idx, prob = make_moe(13, 4, 2, 16, 24, torch.float16, seed=54)
    params = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2, prob)]
    idx = idx.to(DEVICE)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(55)).to(DEVICE, torch.float16)
    y = moe_experts(*params[:4], idx, params[4])
    got = (y, *torch.autograd.grad(y, params, dy))
    want, want_grads = float64_grads(lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), params, dy)
    assert all(g.dtype == torch.float16 for g in got)
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), got, (want, *want_grads)):
        assert rel_rms(a, b) < 5e-3, name


@pytest.mark.parametrize("moved, message", [
    ("w", "grouped_mm: w is on meta, x on"),
    ("offsets", "grouped_mm: offsets is on meta, x on"),
])
def test_grouped_mm_tensor_on_another_device_stops_with_one_line(moved, message):
    """The kernels read every pointer as x's device's memory: a tensor elsewhere ran on garbage in the interpreter
    (an illegal address on a GPU). The meta device stands in for another device here."""
    args = dict(x=torch.randn(8, 4, device=DEVICE), w=torch.randn(2, 4, 3, device=DEVICE),
                offsets=torch.tensor([4, 8], dtype=torch.int32, device=DEVICE))
    args[moved] = args[moved].to("meta")
    with pytest.raises(ValueError, match=message):
        grouped_mm(args["x"], args["w"], args["offsets"])


@pytest.mark.parametrize("moved", ["w2_EFL", "topk_idx_TK", "topk_weight_TK"])
def test_moe_experts_tensor_on_another_device_stops_with_one_line(moved):
    x, w1, w3, w2, idx, prob = make_moe(5, 2, 1, 8, 6, torch.float32, seed=56)
    args = {name: t.detach().to(DEVICE) for name, t in
            dict(x_TL=x, w1_ELF=w1, w3_ELF=w3, w2_EFL=w2, topk_idx_TK=idx, topk_weight_TK=prob).items()}
    args[moved] = args[moved].to("meta")
    with pytest.raises(ValueError, match=f"moe_experts: {moved} is on meta, x_TL on"):
        moe_experts(*args.values())


def test_many_experts_past_a_power_of_two_with_empty_groups():
    """37 experts (the kernels search the group table padded to 64) over 50 rows, so that many groups are empty and
    several rows share no group; the expert block at the same expert count, k = 3."""
    gen = torch.Generator().manual_seed(57)
    n_experts, n_rows = 37, 50
    ends = torch.sort(torch.randint(0, n_rows, (n_experts,), generator=gen)).values.to(torch.int32).to(DEVICE)
    x = torch.randn(n_rows, 8, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(n_experts, 8, 6, generator=gen).to(DEVICE).requires_grad_()
    dy = torch.randn(n_rows, 6, generator=gen).to(DEVICE)
    y = grouped_mm(x, w, ends)
    got = (y, *torch.autograd.grad(y, (x, w), dy))
    want, want_grads = float64_grads(reference.grouped_mm, (x, w, ends), dy)
    for name, a, b in zip(("y", "dx", "dw"), got, (want, *want_grads)):
        assert rel_rms(a, b) < 1e-5, name
    x, w1, w3, w2, idx, prob = make_moe(20, n_experts, 3, 8, 12, torch.float32, seed=58)
    params = [t.detach().to(DEVICE).requires_grad_() for t in (x, w1, w3, w2, prob)]
    idx = idx.to(DEVICE)
    dy = torch.randn(x.shape, generator=gen).to(DEVICE)
    y = moe_experts(*params[:4], idx, params[4])
    got = (y, *torch.autograd.grad(y, params, dy))
    want, want_grads = float64_grads(lambda a, b, c, d, p: reference.moe_experts(a, b, c, d, idx, p), params, dy)
    for name, a, b in zip(("y", "x", "w1", "w3", "w2", "topk_weight"), got, (want, *want_grads)):
        assert rel_rms(a, b) < 1e-5, name


def test_grouped_mm_no_rows():
    """An empty group table's worth of rows (an expert-parallel rank that received no tokens): empty output, a
    zero weight gradient."""
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    w = torch.randn(3, 8, 5, device=DEVICE, requires_grad=True)
    y = grouped_mm(x, w, torch.zeros(3, dtype=torch.int32, device=DEVICE))
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert y.shape == (0, 5) and dx.shape == (0, 8) and torch.equal(dw, torch.zeros_like(dw))
