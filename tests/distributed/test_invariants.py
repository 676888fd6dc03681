"""Fault injection on 2 gloo processes: each silent distributed bug is caught by its invariant within one interval.

One spawn runs every scenario (a clean run and one run per bug) so the
processes start once. The data-parallel scenarios train a tiny model with the
real loader, the real Quantile-Balanced router and the real InvariantRunner,
summing gradients over the ranks by hand; the expert-parallel scenarios
dispatch rows with all_to_all to experts split over the ranks and compare
with the single-process gradients recomputed from the gathered tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gloo_workers import spawn_gloo

WORLD, STEPS, INTERVAL, SEQ, BATCH = 2, 4, 2, 32, 2
DP_SCENARIOS = ("clean", "same_data", "routing_drift", "local_normaliser")
EP_SCENARIOS = ("ep_clean", "ep_misscaled", "ep_dropped")


class TinyMoE(nn.Module):
    """Embedding -> QB router over E square experts (top-k, weighted) -> head; summed cross-entropy."""

    def __init__(self, vocab: int, dim: int = 16, n_experts: int = 4, top_k: int = 2):
        super().__init__()
        from titan_k3.models.k3.moe import QuantileBalancedRouter

        self.emb = nn.Embedding(vocab, dim)
        self.router = QuantileBalancedRouter(dim, n_experts, top_k)
        self.router.reset_parameters()
        self.experts = nn.Parameter(torch.randn(n_experts, dim, dim) * 0.1)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        x_TD = self.emb(ids_BT).flatten(0, 1)
        idx_TK, w_TK = self.router(x_TD)
        y_TD = x_TD + sum(w_TK[:, k, None] * torch.einsum("td,tde->te", x_TD, self.experts[idx_TK[:, k]])
                          for k in range(idx_TK.shape[1]))
        return F.cross_entropy(self.head(y_TD), labels_BT.flatten(), ignore_index=-100, reduction="sum")


def _runner(out: Path, rank: int, group):
    from titan_k3.invariants import InvariantRunner
    from titan_k3.metrics.events import EventLog

    out.mkdir(parents=True, exist_ok=True)
    cfg = SimpleNamespace(enable=True, interval=INTERVAL, abort=False)
    return InvariantRunner(cfg, EventLog(out / "events.jsonl" if rank == 0 else None), group=group, rank=rank,
                           device=torch.device("cpu"))


def _dp_scenario(bug: str, rank: int, group, tokenizer, out: Path) -> list:
    from titan_k3.data.loader import build_dataloader

    loader = build_dataloader("embedded", tokenizer, SEQ, BATCH, 0 if bug == "same_data" else rank, WORLD, seed=0, prefetch=0)
    torch.manual_seed(0)
    model = TinyMoE(tokenizer.vocab_size)
    model.router.dp_group = group
    if bug == "routing_drift" and rank == 1:
        model.router.eta = 1.5  # the drift bug: one rank moves its routing bias with another step size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizers = SimpleNamespace(lr=1e-2, optimizers={"adamw": opt})
    runner = _runner(out / bug, rank, group)
    found = []
    for step in range(1, STEPS + 1):
        batch = next(loader)
        local_valid = (batch.labels != -100).sum().double()
        global_valid = local_valid.clone()
        dist.all_reduce(global_valid, group=group)
        normaliser = local_valid if bug == "local_normaliser" else global_valid
        (model(batch.input_ids, batch.labels) / normaliser).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad, group=group)
        runner.before_clip(step, batches=[batch], model=model, optimizers=optimizers, normaliser=normaliser,
                           local_valid=local_valid, loader=loader)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        found += [[step, v.check, v.metric, v.message] for v in runner.after_clip(grad_norm)]
        opt.step()
        opt.zero_grad(set_to_none=True)
    loader.close()
    return found


def _ep_scenario(bug: str, rank: int, group, out: Path) -> list:
    """E=4 experts y = x W_e, two per rank; loss = sum over (token, k) of w <x W_e, c_token> / N_global."""
    from titan_k3.invariants import checks as C

    E, k, L, T = 4, 2, 8, 16
    per_rank = E // WORLD
    gen = torch.Generator().manual_seed(100 + rank)
    x_TL, c_TL = torch.randn(T, L, generator=gen), torch.randn(T, L, generator=gen)
    w_TK, idx_TK = torch.rand(T, E, generator=gen).topk(k, dim=-1)
    w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    n_global = T * WORLD
    torch.manual_seed(0)
    w_ELL = torch.randn(E, L, L)
    local = w_ELL[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()

    expert_R, token_R = idx_TK.flatten(), torch.arange(T).repeat_interleave(k)
    payload = torch.cat([x_TL[token_R], w_TK.flatten()[:, None] * c_TL[token_R] / n_global, expert_R[:, None].float()], 1)
    dest_R = expert_R // per_rank
    order = torch.argsort(dest_R, stable=True)
    if bug == "ep_dropped" and rank == 1:
        order = order[:-3]  # a capacity limit silently drops three routed rows
    payload, dest_R = payload[order], dest_R[order]
    send_W = torch.bincount(dest_R, minlength=WORLD)
    recv_W = torch.empty_like(send_W)
    dist.all_to_all_single(recv_W, send_W, group=group)
    recv = torch.empty(int(recv_W.sum()), payload.shape[1])
    dist.all_to_all_single(recv, payload, recv_W.tolist(), send_W.tolist(), group=group)
    xr, gr, er = recv[:, :L], recv[:, L:2 * L], recv[:, 2 * L].long() - rank * per_rank
    (torch.einsum("rl,rlm->rm", xr, local[er]) * gr).sum().backward()
    grad = local.grad / WORLD if bug == "ep_misscaled" else local.grad  # the bug: averaged as if replicated

    # Single-process semantics for the experts held here, from every rank's tokens.
    def gather(t):
        out = [torch.empty_like(t) for _ in range(WORLD)]
        dist.all_gather(out, t, group=group)
        return torch.cat(out)

    X, Cc, IDX, W = gather(x_TL), gather(c_TL), gather(idx_TK), gather(w_TK)
    ref = w_ELL[rank * per_rank:(rank + 1) * per_rank].clone().requires_grad_()
    loss = 0.0
    for j in range(k):
        mine = (IDX[:, j] // per_rank) == rank
        y = torch.einsum("tl,tlm->tm", X[mine], ref[IDX[mine, j] - rank * per_rank])
        loss = loss + (W[mine, j, None] * y * Cc[mine]).sum() / n_global
    loss.backward()

    found = C.check_ep_token_counts(send_W, recv_W, routed_tokens=T, top_k=k, group=group)
    found += C.check_expert_grad_scale({"layers.1.ffn.w1": grad}, {"layers.1.ffn.w1": ref.grad}, group)
    _runner(out / bug, rank, group).report(INTERVAL, found)
    return [[INTERVAL, v.check, v.metric, v.message] for v in found]


def _scenarios(rank: int, world: int, out_dir: str) -> None:
    from titan_k3.data.tokenizer import load_tokenizer

    group, out = dist.group.WORLD, Path(out_dir)
    tokenizer = load_tokenizer("embedded")
    results = {bug: _dp_scenario(bug, rank, group, tokenizer, out) for bug in DP_SCENARIOS}
    results.update({bug: _ep_scenario(bug, rank, group, out) for bug in EP_SCENARIOS})
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("invariants")
    spawn_gloo(WORLD, _scenarios, str(out))
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return per_rank, out


pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _events(out: Path, bug: str) -> list[dict]:
    path = out / bug / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_every_rank_reaches_the_same_verdict(results):
    per_rank, _ = results
    for bug in DP_SCENARIOS + EP_SCENARIOS:
        assert [v[:2] for v in per_rank[0][bug]] == [v[:2] for v in per_rank[1][bug]], bug


def test_clean_runs_raise_no_violation(results):
    per_rank, out = results
    assert per_rank[0]["clean"] == [] and per_rank[0]["ep_clean"] == []
    assert not any(e["kind"] == "invariant_violation" for e in _events(out, "clean") + _events(out, "ep_clean"))


@pytest.mark.parametrize("bug, check, named", [
    ("same_data", "data.disjoint_sequences", "more than one data-parallel rank"),
    ("routing_drift", "replicas.checksums", "qb_bias"),
    ("local_normaliser", "gradient_scale.loss_normaliser", "local count"),
    ("ep_misscaled", "gradient_scale.expert_grad_scale", "single-process gradients"),
    ("ep_dropped", "gradient_scale.ep_token_counts", "k x routed"),
])
def test_each_bug_is_caught_by_its_invariant_within_one_interval(results, bug, check, named):
    per_rank, out = results
    found = per_rank[0][bug]
    assert found, f"{bug}: nothing detected"
    first_step = min(step for step, *_ in found)
    assert first_step <= INTERVAL
    hits = [v for v in found if v[1] == check and v[0] == first_step]
    assert hits, f"{bug}: expected {check}, got {[v[1] for v in found]}"
    assert named in hits[0][3]
    events = [e for e in _events(out, bug) if e["kind"] == "invariant_violation" and e["check"] == check]
    assert events and events[0]["step"] == first_step and check in events[0]["message"]


def test_the_misscaled_expert_gradient_reports_its_ratio(results):
    per_rank, _ = results
    (ratio,) = [v[2] for v in per_rank[0]["ep_misscaled"] if v[1] == "gradient_scale.expert_grad_scale"]
    assert ratio == pytest.approx(1 / WORLD, rel=1e-5)
