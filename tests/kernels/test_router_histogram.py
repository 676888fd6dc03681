"""kernels.router: Quantile Balancing's two histograms as Triton kernels (Triton's interpreter on CPU) against the
references.

Exact equality: integer counts, and every margin binned with the reference's float32 arithmetic, so with ragged
token blocks, several programs adding into one histogram, expert counts that are not powers of two, margins on
bin edges and outside the range, strided views, heavy repeats of one id, input validation and torch.compile.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch._dynamo.utils import counters

from kernels.router import expert_counts, expert_counts_reference, expert_margin_histogram
from kernels.router import expert_margin_histogram_reference as margin_reference
from kernels.router import histogram

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of a few elements: ragged blocks inside a program, several programs adding into each output row."""
    monkeypatch.setitem(histogram.LAUNCH, "margins", dict(group_e=2, tokens_per_program=48, block_t=16, num_warps=4))
    monkeypatch.setitem(histogram.LAUNCH, "counts", dict(ids_per_program=40, block=16, num_warps=4))


def router_inputs(n_tokens: int, n_experts: int, k: int, seed: int, bias_std: float = 0.05):
    """s = sigmoid(normal scores) [T, E], a bias of both signs [E], alpha = the (k+1)-th largest of s + bias (a
    strided column of the top-k values, as the router passes it), half_range as the router computes it, and the
    selected ids [T, k] (a column slice)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.sigmoid(torch.randn(n_tokens, n_experts, generator=gen)).to(DEVICE)
    bias = (bias_std * torch.randn(n_experts, generator=gen)).to(DEVICE)
    top = torch.topk(s + bias, min(k + 1, n_experts), dim=-1)
    half_range = 1.0 + (bias.max() - bias.min()).float()
    return s, bias, top.values[:, -1], half_range, top.indices[:, :k]


@pytest.mark.parametrize("n_tokens, n_experts, k, n_bins", [(1, 1, 0, 1024), (37, 7, 2, 1024), (60, 176, 6, 1024),
                                                              (129, 5, 4, 64), (33, 3, 1, 1000), (50, 9, 3, 1)])
def test_margin_histogram_matches_the_reference_exactly(small_tiles, n_tokens, n_experts, k, n_bins):
    s, bias, alpha, half_range, _ = router_inputs(n_tokens, n_experts, k, seed=n_tokens * n_experts + n_bins)
    hist = expert_margin_histogram(s, bias, alpha, half_range, n_bins)
    assert hist.dtype == torch.int32 and hist.shape == (n_experts, n_bins)
    assert torch.equal(hist, margin_reference(s, bias, alpha, half_range, n_bins))
    assert (hist.sum(dim=1) == n_tokens).all()


def test_margin_histogram_at_the_default_tiles_and_k3_mini_width():
    """One program per expert over every token (the default LAUNCH): the output rows are each program's own."""
    s, bias, alpha, half_range, _ = router_inputs(70, 176, 6, seed=4)
    assert torch.equal(expert_margin_histogram(s, bias, alpha, half_range, 1024),
                       margin_reference(s, bias, alpha, half_range, 1024))


def test_margins_on_bin_edges_and_outside_the_range(small_tiles):
    """Margins exactly on edges (a power-of-two width: edges are exact), in the float32 neighbourhood of edges
    that are not representable (a width of 0.14), and beyond both ends (clamped into the end bins)."""
    edges = torch.arange(-12, 13, dtype=torch.float32) * 0.125  # -1.5 .. 1.5 on a width of 0.125 (16 bins)
    s = torch.stack([edges, edges + 0.25, edges.flip(0)], dim=1).to(DEVICE)  # [25, 3]
    bias, alpha = torch.tensor([0.0, -0.25, 0.0], device=DEVICE), torch.zeros(25, device=DEVICE)
    half_range = torch.tensor(1.0, device=DEVICE)
    hist = expert_margin_histogram(s, bias, alpha, half_range, 16)
    assert torch.equal(hist, margin_reference(s, bias, alpha, half_range, 16))
    assert hist[0, 0] == 5 and hist[0, 15] == 6 and (hist[0, 1:15] == 1).all()  # -1.5..-1 and 0.875..1.5 clamp

    half_range = torch.tensor(0.7, device=DEVICE)
    lo, width = -half_range, 2 * half_range / 10
    on_edges = lo + width * torch.arange(-2, 13, device=DEVICE, dtype=torch.float32)
    near = torch.cat([on_edges, on_edges.nextafter(on_edges + 1), on_edges.nextafter(on_edges - 1)])
    alpha = torch.linspace(-0.5, 0.5, near.numel(), device=DEVICE)
    s = (near + alpha)[:, None].repeat(1, 2)  # (s + 0) - alpha rounds back onto or next to the edges
    bias = torch.zeros(2, device=DEVICE)
    assert torch.equal(expert_margin_histogram(s, bias, alpha, half_range, 10),
                       margin_reference(s, bias, alpha, half_range, 10))


def test_margins_are_summed_in_the_reference_order():
    """(s + bias) - alpha, rounded after each step, then (m - lo) / width: tokens whose margins sit on bin edges,
    where another order ((s - alpha) + bias, or (m - lo) * (1 / width)) puts some in the next bin."""
    gen = torch.Generator().manual_seed(8)
    bias, alpha, half_range = 0.3 * torch.randn(8, generator=gen), torch.rand(2000, generator=gen), torch.tensor(1.3)
    lo, width = -half_range, 2 * half_range / 4096
    on_edges = lo + width * torch.randint(0, 4096, (2000, 8), generator=gen)
    s = on_edges + alpha[:, None] - bias

    def bins(m, scaled=lambda x: x / width):
        return scaled(m - lo).floor().clamp(0, 4095)

    ours = bins(s + bias - alpha[:, None])
    rows = ((bins(s - alpha[:, None] + bias) != ours) | (bins(s + bias - alpha[:, None], lambda x: x * (1 / width))
                                                        != ours)).any(dim=1)
    assert rows.sum() >= 3  # the test tells the orders apart
    s, alpha, bias, half_range = s[rows].to(DEVICE), alpha[rows].to(DEVICE), bias.to(DEVICE), half_range.to(DEVICE)
    assert torch.equal(expert_margin_histogram(s, bias, alpha, half_range, 4096),
                       margin_reference(s, bias, alpha, half_range, 4096))


def test_margin_histogram_reads_strided_views(small_tiles):
    base = torch.rand(40, 24, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    bias = torch.linspace(-0.3, 0.3, 24, device=DEVICE)[::2]  # stride 2
    alpha = base[:, 1::3][:, 0]  # stride 24
    half_range = torch.tensor(0.5, device=DEVICE)
    for s in (base[:, 2:14], base[:, ::2]):  # row stride 24; column stride 2 (copied first)
        assert torch.equal(expert_margin_histogram(s, bias, alpha, half_range, 128),
                           margin_reference(s, bias, alpha, half_range, 128))


@pytest.mark.parametrize("shape, n", [((37, 6), 176), ((5,), 7), ((3, 4, 5), 11), ((300, 2), 1), ((90, 3), 2500)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_counts_match_the_reference_exactly(small_tiles, shape, n, dtype):
    """n = 2500 takes three windows of ids."""
    ids = torch.randint(0, n, shape, generator=torch.Generator().manual_seed(n)).to(DEVICE, dtype)
    counts = expert_counts(ids, n)
    assert counts.dtype == torch.int64 and counts.shape == (n,)
    assert torch.equal(counts, expert_counts_reference(ids, n))


def test_counts_of_the_routers_strided_ids(small_tiles):
    _, _, _, _, experts_TK = router_inputs(101, 176, 6, seed=6)
    assert experts_TK.stride() == (7, 1)  # a column slice of the top-(k+1) ids
    assert torch.equal(expert_counts(experts_TK, 176), expert_counts_reference(experts_TK, 176))


def test_counts_of_heavy_repeats():
    """Every token chose expert 5 (k = 64): one bin takes every id, from each of several programs."""
    same = torch.full((500, 64), 5, device=DEVICE)
    counts = expert_counts(same, 176)
    assert counts[5] == 500 * 64 and counts.sum() == 500 * 64
    assert torch.equal(expert_counts(same.t(), 176), counts)  # a transposed view: column stride 64


def test_ids_outside_the_range_are_not_counted(small_tiles):
    ids = torch.tensor([[-1, 0, 3], [4, 3, 100]], device=DEVICE)
    assert expert_counts(ids, 4).tolist() == [1, 0, 0, 2]


def test_empty_inputs_count_nothing():
    assert torch.equal(expert_counts(torch.empty(0, 6, dtype=torch.int64, device=DEVICE), 5),
                       torch.zeros(5, dtype=torch.int64, device=DEVICE))
    hist = expert_margin_histogram(torch.empty(0, 3, device=DEVICE), torch.zeros(3, device=DEVICE),
                                   torch.empty(0, device=DEVICE), torch.tensor(1.0, device=DEVICE), 8)
    assert hist.shape == (3, 8) and not hist.any()


def test_bad_inputs_raise_one_line_value_errors():
    s, bias, alpha, half = (torch.zeros(4, 3, device=DEVICE), torch.zeros(3, device=DEVICE),
                            torch.zeros(4, device=DEVICE), torch.tensor(1.0, device=DEVICE))
    bad = [
        ((s.double(), bias, alpha, half, 8), r"s must be a float32 tensor \[T, E\], got \(4, 3\) torch.float64"),
        ((s[0], bias, alpha, half, 8), r"s must be a float32 tensor \[T, E\]"),
        ((s, bias[:2], alpha, half, 8), r"bias must be a float32 tensor \[3\] \(s is \[4, 3\]\), got \(2,\)"),
        ((s, bias, alpha.half(), half, 8), r"alpha must be a float32 tensor \[4\]"),
        ((s, bias, alpha, half[None], 8), r"half_range must be a float32 tensor \[\]"),
        ((s, bias, alpha, 1.0, 8), r"half_range must be a float32 tensor \[\] \(s is \[4, 3\]\), got float"),
        ((s, bias.to("meta"), alpha, half, 8), r"bias is on meta, s on"),
        ((s, bias, alpha, half, 0), r"n_bins = 0 must be an int >= 1"),
        ((s, bias, alpha, half, 2.0), r"n_bins = 2.0 must be an int >= 1"),
        ((s, bias, alpha, half, histogram.MAX_BINS + 1), rf"holds up to {histogram.MAX_BINS} bins"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            expert_margin_histogram(*args)
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"ids must be an int64 or int32 tensor, got \(4, 2\) torch.float32"):
        expert_counts(ids.float(), 3)
    with pytest.raises(ValueError, match=r"n = 0 must be an int >= 1"):
        expert_counts(ids, 0)
    with pytest.raises(ValueError, match=r"s must be a float32 or float64 tensor"):  # the reference also routes
        margin_reference(s.half(), bias, alpha, half, 8)                                # a float64 model


def test_needs_triton_somewhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cuda":
        pytest.skip("on a GPU the kernels run")
    with pytest.raises(ValueError, match="needs CUDA tensors, got device cpu; use kernels.router.expert_counts_ref"):
        expert_counts(torch.zeros(4, 2, dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="needs CUDA tensors, got device cpu; use kernels.router.expert_margin_hist"):
        expert_margin_histogram(torch.zeros(4, 3), torch.zeros(3), torch.zeros(4), torch.tensor(1.0), 8)


def test_compiles_without_graph_break(small_tiles):
    """Inside torch.compile(fullgraph=True) both ops trace as opaque calls and give eager's counts."""
    counters.clear()

    def histograms(s, bias, alpha, experts):
        with torch.no_grad():
            half_range = 1.0 + (bias.max() - bias.min()).float()
            hist = expert_margin_histogram(s, bias, alpha, half_range, 256).to(torch.float64)
            return hist, expert_counts(experts, s.shape[1])

    s, bias, alpha, _, experts = router_inputs(60, 12, 3, seed=7)
    compiled = torch.compile(histograms, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    for got, want in zip(compiled(s, bias, alpha, experts), histograms(s, bias, alpha, experts)):
        assert torch.equal(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_config_key_reaches_every_router():
    """kernels.qb_histograms: triton hands both kernels to every MoE router, torch both references; a model built
    with the kernels counts the same integers as one with the references (a training forward of the debug flavor,
    float32)."""
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import reference_impl, resolve_impl
    from titan_k3.models.k3.model import K3Model

    device = torch.device(DEVICE)
    asked = resolve_impl(load_job_config(["--kernels.qb_histograms", "triton"]).kernels, device)
    torch_ = resolve_impl(load_job_config(["--kernels.qb_histograms", "torch"]).kernels, device)
    chosen = {c.op: (c.chosen, c.fallback) for c in asked.choices}
    assert chosen["qb_counts"] == chosen["qb_margin_histogram"] == ("triton", False)
    assert (asked.expert_counts, asked.margin_histogram) == (expert_counts, expert_margin_histogram)
    assert (torch_.expert_counts, torch_.margin_histogram) == (expert_counts_reference, margin_reference)

    kernels_impl = reference_impl()
    kernels_impl.expert_counts, kernels_impl.margin_histogram = asked.expert_counts, asked.margin_histogram
    ids = torch.randint(0, get_flavor("debug").vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    counts = []
    for impl in (kernels_impl, reference_impl()):
        model = K3Model(get_flavor("debug"), impl)
        model.init_weights(seed=0)
        model.to(device).train()
        routers = list(model.moe_routers().values())
        assert routers and all((r.counts, r.margin_histogram) == (impl.expert_counts, impl.margin_histogram)
                               for r in routers)
        for r in routers:
            r.defer_update = True  # keep each router's histogram pending, to compare
        model(ids.to(device))
        counts.append([(r.load_counts.clone(), r._pending[0].clone()) for r in routers])
    for (load_k, hist_k), (load_r, hist_r) in zip(*counts):
        assert torch.equal(load_k, load_r) and load_k.sum() > 0
        assert torch.equal(hist_k, hist_r) and hist_k.sum() > 0
