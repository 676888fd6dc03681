"""kernels.router: the Triton top-k (Triton's interpreter on CPU) against the reference.

Exact equality: the kernel and the reference pick by comparisons alone, so values and ids must match
bit for bit, with ragged token blocks, expert counts that are not powers of two, ties, a strided view,
NaN rows, input validation and torch.compile tracing.
"""

import os

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from torch._dynamo.utils import counters

from kernels.router import top_k_rows, top_k_rows_reference
from kernels.router import kernel as router_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n_rows, n_cols, k", [(1, 8, 1), (37, 176, 7), (300, 176, 7), (65, 5, 5), (33, 100, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_reference_exactly(n_rows, n_cols, k, dtype):
    x = torch.randn(n_rows, n_cols, generator=torch.Generator().manual_seed(n_rows * n_cols + k)).to(DEVICE, dtype)
    values, ids = top_k_rows(x, k)
    ref_values, ref_ids = top_k_rows_reference(x, k)
    assert values.dtype == dtype and ids.dtype == torch.int64 and values.shape == ids.shape == (n_rows, k)
    assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
    if dtype == torch.float32:  # no ties in random float32 rows: then it is torch.topk
        assert torch.equal(ids, torch.topk(x, k, dim=-1).indices)


def test_ties_go_to_the_lowest_id_and_the_row_tile_holds_several_rows(monkeypatch):
    """Quantised scores tie often; a tile of several rows (monkeypatched small) keeps rows apart."""
    monkeypatch.setattr(router_kernel, "TILE_ELEMENTS", 64)  # 2 rows of 32 padded columns per program
    x = (torch.randint(0, 4, (9, 20), generator=torch.Generator().manual_seed(1)).float() / 4).to(DEVICE)
    values, ids = top_k_rows(x, 6)
    ref_values, ref_ids = top_k_rows_reference(x, 6)
    assert torch.equal(ids, ref_ids) and torch.equal(values, ref_values)
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]], device=DEVICE)
    values, ids = top_k_rows(tied, 3)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]] and values.tolist() == [[3.0] * 3, [2.0] * 3]


def test_a_strided_view_and_a_nan_row():
    base = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    view = base[:, :40]  # row stride 64
    assert torch.equal(top_k_rows(view, 4)[1], top_k_rows_reference(view, 4)[1])
    cols = base[:, ::2]  # column stride 2: made contiguous first
    assert torch.equal(top_k_rows(cols, 4)[1], top_k_rows_reference(cols, 4)[1])
    nan = base[:, :40].clone()
    nan[3, 5] = float("nan")
    ids = top_k_rows(nan, 4)[1]
    assert ids.min() >= 0 and ids.max() < 40  # a NaN row still names experts that exist
    others = [r for r in range(16) if r != 3]
    assert torch.equal(ids[others], top_k_rows_reference(nan, 4)[1][others])


def test_empty_and_bad_inputs():
    values, ids = top_k_rows(torch.empty(0, 8, device=DEVICE), 2)
    assert values.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match=r"k = 9 must be an int in \[1, E = 8\]"):
        top_k_rows(torch.zeros(4, 8, device=DEVICE), 9)
    with pytest.raises(ValueError, match=r"x must be a floating tensor \[T, E\]"):
        top_k_rows(torch.zeros(4, 8, 2, device=DEVICE), 2)
    with pytest.raises(ValueError, match="float64 runs in kernels.router.top_k_rows_reference"):
        top_k_rows(torch.zeros(4, 8, dtype=torch.float64, device=DEVICE), 2)


def test_needs_triton_somewhere(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if DEVICE == "cuda":
        pytest.skip("on a GPU the kernel runs")
    with pytest.raises(ValueError, match="needs CUDA tensors, got device cpu"):
        top_k_rows(torch.zeros(4, 8), 2)


def test_compiles_without_graph_break():
    """Inside torch.compile(fullgraph=True) the op traces as one opaque call and gives eager's values."""
    counters.clear()

    # NOTE: the compiled graph adds the bias exactly as eager does (a compiled sigmoid may differ in its last bit,
    # and then a near tie could pick another expert: not what this test is about).
    def route(scores, bias):
        with torch.no_grad():
            return top_k_rows(scores + bias, 3)

    scores = torch.rand(40, 12, generator=torch.Generator().manual_seed(3)).to(DEVICE).requires_grad_(True)
    bias = torch.linspace(-0.5, 0.5, 12, device=DEVICE)
    compiled = torch.compile(route, backend="inductor" if DEVICE == "cuda" else "aot_eager", fullgraph=True)
    for got, want in zip(compiled(scores, bias), route(scores, bias)):
        assert torch.equal(got, want)
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_the_config_key_reaches_every_router():
    """kernels.router: auto takes the kernel on CUDA (the reference elsewhere, said to be a fallback), triton hands
    the kernel to every MoE router of the model, and on a GPU the scores' kernel with it (in the CPU interpreter the
    scores stay the reference's: bf16 products are wrong there)."""
    from kernels.router import router_scores
    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.models.k3.moe import router_logits

    device = torch.device(DEVICE)
    auto = resolve_impl(load_job_config([]).kernels, device)
    [choice] = [c for c in auto.choices if c.op == "router"]
    if device.type == "cuda":
        assert auto.router is top_k_rows and (choice.chosen, choice.fallback) == ("triton", False)
    else:
        assert auto.router is top_k_rows_reference and (choice.chosen, choice.fallback) == ("torch", True)
    asked = resolve_impl(load_job_config(["--kernels.router", "triton"]).kernels, device)
    [choice] = [c for c in asked.choices if c.op == "router"]
    assert asked.router is top_k_rows and (choice.chosen, choice.fallback) == ("triton", False)
    with torch.device("meta"):
        model = K3Model(get_flavor("debug"), asked)
    routers = model.moe_routers().values()
    assert routers and all(r.top_k_rows is top_k_rows for r in routers)
    scores = router_scores if device.type == "cuda" else router_logits
    assert asked.router_scores is scores and all(r.scores is scores for r in routers)
    reference = resolve_impl(load_job_config(["--kernels.router", "torch"]).kernels, device)
    assert reference.router_scores is router_logits
