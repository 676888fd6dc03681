"""Quantile Balancing (docs/k3.md §5): the update direction, the state flow and checkpoint-recompute safety."""

import contextlib
import shutil

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from titan_k3.metrics.moe_stats import expert_load_stats
from titan_k3.models.k3.moe import QuantileBalancedRouter, margin_quantiles, routing_recompute


def skewed_router(E=16, k=4, D=32, seed=0):
    torch.manual_seed(seed)
    router = QuantileBalancedRouter(D, E, k)
    router.reset_parameters()
    with torch.no_grad():
        router.weight[:3, 0] += 3.0  # with feature 0 always on, experts 0-2 win for almost every token
    return router.train()


def tokens(n, D=32):
    x = torch.randn(n, D)
    x[:, 0] = 1.0
    return x


def selection_counts(router, x):
    router.eval()
    with torch.no_grad():
        idx, _ = router(x)
    router.train()
    return torch.bincount(idx.flatten(), minlength=router.n_experts)


def test_margin_quantile_matches_exact_quantile():
    torch.manual_seed(0)
    m = torch.randn(4000, 5) * 0.3
    approx = margin_quantiles(m, 0.75, torch.tensor(1.5), None)
    exact = torch.quantile(m, 0.75, dim=0)
    torch.testing.assert_close(approx, exact, atol=4e-3, rtol=0)


def test_a_few_updates_balance_a_skewed_router():
    router = skewed_router()
    x = tokens(2048)
    before = expert_load_stats(selection_counts(router, x), router.qb_bias)
    assert before["maxvio"] > 1.0  # clearly collapsed at the start
    for _ in range(6):
        router(x)
    counts = selection_counts(router, x)
    stats = expert_load_stats(counts, router.qb_bias)
    assert stats["maxvio"] < 0.1, counts
    rates = counts.double() / x.shape[0]
    torch.testing.assert_close(rates, torch.full_like(rates, 4 / 16), atol=0.1 * 4 / 16, rtol=0)
    assert abs(float(router.qb_bias.mean())) < 1e-6


def test_next_microbatch_routes_with_the_updated_state():
    router = skewed_router()
    x1, x2 = tokens(512), tokens(512)
    b0 = router.qb_bias.clone()
    router(x1)
    b1 = router.qb_bias.clone()
    assert not torch.equal(b0, b1)
    idx2, _ = router(x2)
    s = torch.sigmoid(x2 @ router.weight.detach().t())
    expected = torch.topk(s + b1, router.top_k + 1, dim=-1).indices[:, : router.top_k]
    assert torch.equal(idx2, expected)


def test_evaluation_never_updates():
    router = skewed_router().eval()
    b0 = router.qb_bias.clone()
    router(tokens(256))
    assert torch.equal(router.qb_bias, b0)
    assert router.load_counts.sum() == 0


def test_recompute_reuses_the_forward_state_and_updates_once():
    router = skewed_router()
    x = tokens(256).requires_grad_()

    def f(inp):
        idx, w = router(inp)
        return (w * idx.float()).sum()

    b0 = router.qb_bias.clone()
    plain = skewed_router()
    plain(x.detach())
    # NOTE: the recompute is marked the way titan_k3's checkpoint wrapper marks it.
    loss = checkpoint(f, x, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), routing_recompute()))
    after_forward = router.qb_bias.clone()
    loss.backward()  # recompute happens here
    assert torch.equal(router.qb_bias, after_forward)  # no second update
    assert torch.equal(after_forward, plain.qb_bias)
    assert not torch.equal(after_forward, b0)
    assert router.load_counts.sum() == 256 * router.top_k  # counted once


def test_count_ids_equals_bincount_without_reading_a_maximum():
    """The sync-free counter used for QB histograms, expert loads and EP dispatch counts."""
    from titan_k3.models.k3.moe import count_ids

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 37, (64, 6), generator=gen)
    counts = count_ids(ids, 40)
    assert counts.dtype == torch.int64 and counts.shape == (40,)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=40))
    assert counts[37:].eq(0).all() and int(counts.sum()) == ids.numel()


@pytest.mark.parametrize("replicas", [1, 3, 16, 200])
def test_counts_into_replicas_are_the_same_integers(replicas):
    """Spreading the atomics over copies of a count (COUNT_REPLICAS) changes no count: the load counts equal
    bincount, and the margin histogram equals a float64 per-expert count of each bin's [edge, next edge)."""
    from titan_k3.models.k3.moe import QB_BINS, count_ids, margin_histogram

    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 9, (150, 4), generator=gen)
    ids[:100, 0] = 3  # a hot expert
    assert torch.equal(count_ids(ids, 11, replicas), torch.bincount(ids.flatten(), minlength=11))
    margins = torch.randn(150, 7, generator=gen) * 0.6
    margins[:50, 2] = 0.0  # a hot bin
    margins[0, 0], margins[1, 0] = 5.0, -5.0  # outside the range: the end bins
    hist = margin_histogram(margins, torch.tensor(1.0), replicas)
    bins = ((margins.double() + 1.0) / (2.0 / QB_BINS)).floor().clamp(0, QB_BINS - 1).long()
    want = torch.stack([torch.bincount(bins[:, e], minlength=QB_BINS) for e in range(7)]).double()
    assert hist.dtype == torch.float64 and torch.equal(hist, want)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_count_ids_compiles_to_an_atomic_add_not_a_sort_fallback():
    """An int64 index_add makes inductor fall back to a sort-based aten kernel (17 ms of a k3-mini step)."""
    from torch._inductor.utils import run_and_get_code

    from titan_k3.models.k3.moe import count_ids

    ids = torch.randint(0, 37, (64, 6), generator=torch.Generator().manual_seed(4))
    counts, codes = run_and_get_code(torch.compile(count_ids, backend="inductor", fullgraph=True), ids, 40)
    assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=40))
    code = "\n".join(codes)
    fallbacks = [op for op in ("aten.index_put", "aten._index_put_impl_", "aten.index_add") if op in code]
    assert "atomic_add" in code and not fallbacks, fallbacks


def test_top_k_rows_is_topk_with_ties_to_the_lowest_index():
    from kernels.router import top_k_rows_reference as top_k_rows

    x = torch.randn(300, 176, generator=torch.Generator().manual_seed(0))
    values, indices = top_k_rows(x, 7)
    expected = torch.topk(x, 7, dim=-1)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    values, indices = top_k_rows(tied, 3)
    assert indices.tolist() == [[1, 2, 4], [0, 1, 2]] and values.tolist() == [[3.0] * 3, [2.0] * 3]


def test_deferred_updates_move_every_bias_as_the_forward_would():
    """defer_update + apply_deferred_updates (one call for several routers) equals each router updating itself
    inside its forward, micro-batch after micro-batch; nothing moves before the call, nothing twice."""
    from titan_k3.models.k3.moe import apply_deferred_updates

    now = [skewed_router(seed=s) for s in (0, 1, 2)]
    later = [skewed_router(seed=s) for s in (0, 1, 2)]
    for r in later:
        r.defer_update = True
    for step in range(4):
        x = tokens(384)
        for a, b in zip(now, later):
            a(x)
            before = b.qb_bias.clone()
            b(x)
            assert torch.equal(b.qb_bias, before), "a deferred router moved inside its forward"
        apply_deferred_updates(later, group=None)
        apply_deferred_updates(later, group=None)  # nothing pending: a no-op
        for a, b in zip(now, later):
            assert torch.equal(b.qb_bias, a.qb_bias), f"step {step}"
    assert any(r.qb_bias.abs().max() > 0 for r in later)
