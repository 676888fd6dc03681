"""LatentMoE with a sigmoid router and Quantile Balancing (docs/k3.md §2.3, §5).

Legend: T tokens (flattened B*T), D width, L latent width, F expert hidden,
E routed experts, k experts per token, NB histogram bins.

Quantile Balancing keeps a float32 bias b [E] (a persistent buffer, never a
Parameter) that only affects which experts are selected. After routing a
training microbatch it moves b so that each expert's selection rate goes to
k/E: with alpha_i the (k+1)-th largest biased score of token i and margins
m_ij = s_ij + b_j - alpha_i, expert j is selected exactly when m_ij > 0. If
c_j, the (1 - k/E) quantile of m_:j, is positive, more than k/E of the tokens
select j; `b_j -= eta * c_j` moves that quantile to zero. The quantile comes
from per-expert histograms that are summed over the data-parallel group with
one all-reduce, so b stays bit-identical on every rank. The trainer defers the
move to just after each micro-batch's backward (`apply_deferred_updates`: one
all-reduce for every router, none inside the forward); a router used alone
moves b inside its forward.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from kernels.float32_matmul import matmul_float32
from kernels.router.reference import top_k_rows_reference
from titan_k3.models.k3.args import K3Args
from titan_k3.models.k3.layers import RMSNorm, SituGluFFN, init_linear, upcast

QB_BINS = 1024


# NOTE: copies of a count that the atomics of one call spread over (token t adds into copy t % COUNT_REPLICAS; the
# copies are summed after). One copy was bound by atomics on the busy bins: per k3-mini MoE layer on an H200
# (benchmarks/results/qb_histogram.md) the compiled margin histogram took 0.130 ms and the load counts 0.085 ms
# with one copy, 0.132 / 0.075 with 4, 0.077 / 0.039 with 16; privately-counting Triton kernels took 0.155 / 0.167.
COUNT_REPLICAS = 16


def count_ids(ids: torch.Tensor, n: int, replicas: int = COUNT_REPLICAS) -> torch.Tensor:
    """int64 [n]: how often each id in [0, n) occurs in `ids` (any shape; its last dim is a row, e.g. [T, k]).

    NOTE: not torch.bincount: on CUDA it reads the maximum back to the host
    to size its output, a device sync per call (two per MoE layer and
    micro-batch). Integer adds make the result exact in any order. The
    counts accumulate in int32 because inductor has no int64 atomic add: an
    int64 index_add falls back to a sort-based kernel (~0.8 ms per call at
    the k3-mini shape, 17 ms of a 240 ms step). A count never nears 2**31.
    Row r counts into copy r % replicas (COUNT_REPLICAS).
    """
    rows_RC = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 0 else ids.reshape(1, 1)
    return _replicated_counts(rows_RC, n, replicas)


def margin_histogram(margins_TE: torch.Tensor, half_range: torch.Tensor,
                     replicas: int = COUNT_REPLICAS) -> torch.Tensor:
    """Per-expert histogram of the margins over [-half_range, half_range], QB_BINS bins: float64 [E, NB] counts."""
    T, E = margins_TE.shape
    lo, width = -half_range, 2 * half_range / QB_BINS
    bins_TE = ((margins_TE - lo) / width).floor().clamp_(0, QB_BINS - 1).long()
    ids_TE = bins_TE + torch.arange(E, device=bins_TE.device) * QB_BINS
    return _replicated_counts(ids_TE, E * QB_BINS, replicas).view(E, QB_BINS).to(torch.float64)


def _replicated_counts(ids_RC: torch.Tensor, n: int, replicas: int) -> torch.Tensor:
    """int64 [n] counts of the ids [R, C] in [0, n), row r adding into copy r % replicas (one index_add)."""
    copy_R1 = (torch.arange(ids_RC.shape[0], device=ids_RC.device) % replicas)[:, None]
    flat = (ids_RC + copy_R1 * n).flatten()
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(replicas * n, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones)
    return counts.view(replicas, n).sum(0, dtype=torch.int64)


def histogram_quantiles(hist_XB: torch.Tensor, quantile: float, half_range_X1: torch.Tensor) -> torch.Tensor:
    """The `quantile` of each row's histogram over [-half_range, half_range], float32 [X].

    Linear interpolation inside the bin that holds the quantile. Rows may
    stack several routers' experts (half_range [X, 1] per row, or one scalar).
    """
    lo, width = -half_range_X1, 2 * half_range_X1 / QB_BINS
    cum_XB = hist_XB.cumsum(dim=1)
    target_X1 = quantile * cum_XB[:, -1:]
    bin_X1 = torch.searchsorted(cum_XB, target_X1).clamp_(max=QB_BINS - 1)
    before = torch.where(bin_X1 > 0, cum_XB.gather(1, (bin_X1 - 1).clamp(min=0)), torch.zeros_like(target_X1))
    inside = hist_XB.gather(1, bin_X1).clamp(min=1)
    frac = ((target_X1 - before) / inside).clamp(0, 1)
    return (lo + width * (bin_X1.to(torch.float64) + frac)).squeeze(1).to(torch.float32)


def margin_quantiles(
    margins_TE: torch.Tensor, quantile: float, half_range: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Per-expert `quantile` of the margins over all tokens of all ranks in `group`, float32 [E].

    Histogram over [-half_range, half_range] with QB_BINS bins, summed with one
    all-reduce, interpolated linearly inside the bin that holds the quantile.
    """
    hist_EB = margin_histogram(margins_TE, half_range)
    if group is not None:
        dist.all_reduce(hist_EB, group=group)
    return histogram_quantiles(hist_EB, quantile, half_range)


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """W_router x: [T, D] x [E, D] -> float32 [T, E] (docs/k3.md §2.3), under the trainer's bf16 autocast too.

    NOTE: autocast ran this product in bf16: for k3-mini's router at initialisation (D 512, E 176, 8,192 tokens)
    that changed the top-6 set of 12.6% of the tokens against float32 and tied the 6th and 7th score of 22.6% (ties
    go to the lowest id). Under autocast the value is the float32 product, while the gradient flows through
    autocast's own product, as every other weight's does: a float32 backward would run two more float32 products
    of the forward's size per MoE layer, at a GPU's float32 (not tensor-core) rate.
    """
    device = x_TD.device
    if not (device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type)):
        return upcast(x_TD) @ upcast(w_ED).t()
    exact = matmul_float32(x_TD.detach(), w_ED.detach().t())  # float32 operands under autocast, no gradient
    if not torch.is_grad_enabled():
        return exact
    low = (x_TD @ w_ED.t()).float()  # autocast's dtype: carries the gradient
    # NOTE: low + (exact - low) is `exact` to within one float32 rounding, and exactly it wherever the two are
    # within a factor 2 of each other (Sterbenz), as all but scores near 0 are.
    return low + (exact - low.detach())


# NOTE: a module global, not a class attribute: a compiled router must guard on it (one graph for the forward, one
# for the recompute), and torch 2.11's dynamo installs no guard on a class attribute read through a function: the
# recompute ran the forward's graph, counted the expert load twice and, without deferred updates, moved the bias
# again (torch 2.13 guards on both).
_routing_recompute_active = False


@contextlib.contextmanager
def routing_recompute():
    """Marks an activation-checkpoint recompute: routers reuse the forward's bias and update nothing.

    Whoever recomputes a forward in backward (titan_k3/parallel's checkpoint
    wrapper, via `checkpoint(..., context_fn=...)`) runs the recompute inside it.
    """
    global _routing_recompute_active
    previous, _routing_recompute_active = _routing_recompute_active, True
    try:
        yield
    finally:
        _routing_recompute_active = previous


def in_routing_recompute() -> bool:
    """True inside `routing_recompute` (an activation-checkpoint recompute in backward)."""
    return _routing_recompute_active


class QuantileBalancedRouter(nn.Module):
    """Sigmoid router, top-k selection on s + b, renormalised weights, and the QB update."""

    def __init__(self, dim: int, n_experts: int, top_k: int, eta: float = 1.0,
                 top_k_rows: Callable = top_k_rows_reference, scores: Callable = router_logits):
        super().__init__()
        self.n_experts, self.top_k, self.eta = n_experts, top_k, eta
        self.top_k_rows = top_k_rows  # (x [T, E], k) -> (values, ids) [T, k]: `kernels.router` or its reference
        self.scores = scores  # (x [T, D], w [E, D]) -> float32 [T, E]: `kernels.router.router_scores` or router_logits
        self.update_enabled = True
        # NOTE: a trainer sets defer_update and calls `apply_deferred_updates` after each micro-batch's
        # backward: the forward then keeps its local histogram (no all-reduce inside the forward, which made
        # every MoE layer a point where the data-parallel ranks wait for each other) and one all-reduce
        # serves every router. The bias moves exactly as without deferral, before the next micro-batch routes.
        self.defer_update = False
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.dp_group: dist.ProcessGroup | None = None
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.register_buffer("qb_bias", torch.zeros(n_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("load_counts", torch.zeros(n_experts, dtype=torch.float64), persistent=False)
        self._bias_for_recompute: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02, a=-0.06, b=0.06)
        self.qb_bias.zero_()
        self.load_counts.zero_()

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (expert ids int64 [T, k], weights float32 [T, k])."""
        s_TE = torch.sigmoid(self.scores(x_TD, self.weight))
        # NOTE: an activation-checkpoint recompute runs inside backward: it must
        # route with the bias the original forward used and must not update it.
        # The checkpoint wrapper says so (`routing_recompute`); a compiled router
        # guards on the flag and keeps one graph for each case.
        recompute = in_routing_recompute()
        if recompute and self._bias_for_recompute is not None:
            bias = self._bias_for_recompute
        else:
            bias = self.qb_bias.clone()
        with torch.no_grad():
            top_vals, top_idx = self.top_k_rows(s_TE + bias, self.top_k + 1)
        experts_TK = top_idx[:, : self.top_k]
        s_sel = s_TE.gather(1, experts_TK)
        weights_TK = s_sel / s_sel.sum(dim=-1, keepdim=True)
        if self.training and not recompute:
            self._bias_for_recompute = bias
            with torch.no_grad():
                self.load_counts += count_ids(experts_TK, self.n_experts).to(torch.float64)
                if self.update_enabled and self.defer_update:
                    self._pending = self._histogram(s_TE.detach(), bias, top_vals[:, self.top_k])
                elif self.update_enabled:
                    self._update_bias(s_TE.detach(), bias, top_vals[:, self.top_k])
        return experts_TK, weights_TK

    @torch.no_grad()
    def _histogram(self, s_TE: torch.Tensor, bias_E: torch.Tensor, alpha_T: torch.Tensor) -> tuple:
        """(local margin histogram [E, NB], its half range, the bias it was routed with)."""
        margins_TE = s_TE + bias_E - alpha_T[:, None]
        half_range = 1.0 + (bias_E.max() - bias_E.min()).float()
        return margin_histogram(margins_TE, half_range), half_range, bias_E

    @torch.no_grad()
    def _update_bias(self, s_TE: torch.Tensor, bias_E: torch.Tensor, alpha_T: torch.Tensor) -> None:
        self._pending = self._histogram(s_TE, bias_E, alpha_T)
        apply_deferred_updates([self], self.dp_group)


@torch.no_grad()
def apply_deferred_updates(routers: list[QuantileBalancedRouter], group: dist.ProcessGroup | None) -> None:
    """Move every router's bias by the histogram its last training forward kept (`defer_update`).

    One all-reduce of all the routers' histograms over `group`, then the
    quantiles and bias moves of all routers at once; the same numbers as each
    router updating itself inside its forward. Routers with nothing pending
    are left alone.
    """
    pending = [r for r in routers if r._pending is not None]
    if not pending:
        return
    hists, half_ranges, biases = (torch.stack(parts) for parts in zip(*(r._pending for r in pending)))
    if group is not None:
        dist.all_reduce(hists, group=group)
    top_k, n_experts, eta = pending[0].top_k, pending[0].n_experts, pending[0].eta
    if any((r.top_k, r.n_experts, r.eta) != (top_k, n_experts, eta) for r in pending):
        raise ValueError("apply_deferred_updates: routers differ in top_k, n_experts or eta")
    R, E, NB = hists.shape
    c_RE = histogram_quantiles(hists.view(R * E, NB), 1.0 - top_k / n_experts,
                               half_ranges.repeat_interleave(E).view(R * E, 1)).view(R, E)
    new_RE = biases - eta * c_RE
    torch._foreach_copy_([r.qb_bias for r in pending], list((new_RE - new_RE.mean(dim=1, keepdim=True)).unbind(0)))
    for r in pending:
        r._pending = None


SHADOWED = ("w1", "w3", "w2")
"""The routed experts' weights that kernels.expert_weight_shadows keeps copies of."""


class LatentMoE(nn.Module):
    """y = Shared(x) + W_up RMSNorm_L(sum_e p_e Expert_e(W_down x))."""

    def __init__(self, args: K3Args, experts_fn: Callable, qb_eta: float = 1.0,
                 top_k_rows: Callable = top_k_rows_reference, shadow_dtype: torch.dtype | None = None,
                 router_scores: Callable = router_logits):
        """shadow_dtype: keep w1, w3, w2's copies in this dtype as buffers (w1_shadow, ...) and hand them to
        experts_fn in place of its cast pass (kernels.expert_weight_shadows; expert_shadows.py keeps them equal to
        the masters' casts). router_scores: the router's float32 scores (`QuantileBalancedRouter`'s scores)."""
        super().__init__()
        D, L, F, E = args.dim, args.latent_dim, args.expert_hidden, args.n_experts
        self.experts_fn = experts_fn
        self.router = QuantileBalancedRouter(D, E, args.top_k, qb_eta, top_k_rows, router_scores)
        self.w_down = nn.Linear(D, L, bias=False)
        self.latent_norm = RMSNorm(L, args.norm_eps)
        self.w_up = nn.Linear(L, D, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, L, F))
        self.w3 = nn.Parameter(torch.empty(E, L, F))
        self.w2 = nn.Parameter(torch.empty(E, F, L))
        self.shared = SituGluFFN(D, args.n_shared_experts * F) if args.n_shared_experts else None
        self.shadowed = shadow_dtype is not None
        for name in SHADOWED if self.shadowed else ():
            # NOTE: not persistent: a checkpoint holds the masters only; the trainer casts them again after a load.
            self.register_buffer(f"{name}_shadow", torch.empty_like(getattr(self, name), dtype=shadow_dtype),
                                 persistent=False)

    @torch.no_grad()
    def shadow_mismatches(self) -> list[str]:
        """One line per weight whose shadow differs from its cast (none without shadows, or while they are kept)."""
        lines = []
        for name in SHADOWED if self.shadowed else ():
            master, shadow = getattr(self, name), getattr(self, f"{name}_shadow")
            n = int((shadow != master.to(shadow.dtype)).sum())
            if n:
                lines.append(f"{name}: {n} of {master.numel()} elements of its {shadow.dtype} shadow differ from "
                             "its cast")
        return lines

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        init_linear(self.w_down)
        init_linear(self.w_up)
        self.latent_norm.reset_parameters()
        for w in (self.w1, self.w3, self.w2):
            nn.init.trunc_normal_(w, std=0.02, a=-0.06, b=0.06)
        if self.shared is not None:
            for lin in (self.shared.w1, self.shared.w3, self.shared.w2):
                init_linear(lin)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        experts_TK, weights_TK = self.router(x_TD)
        z_TL = self.w_down(x_TD)
        # NOTE: a dispatch that waits on the host (EP all_to_all) goes after the shared expert, so the GPU runs
        # it meanwhile; any other goes first, so the shared expert overlaps the collective that brings y home.
        waits = getattr(self.experts_fn, "waits_on_host", False)
        shared_BTD = self.shared(x_BTD) if self.shared is not None and waits else None
        # NOTE: the weights go in as they are: an experts function runs its products in z's dtype and hands
        # float32 weights their gradients in float32 (kernels.grouped_gemm.moe_experts: no cast pass either way).
        shadows = {"shadows": (self.w1_shadow, self.w3_shadow, self.w2_shadow)} if self.shadowed else {}
        y_TL = self.experts_fn(z_TL, self.w1, self.w3, self.w2, experts_TK, weights_TK.to(z_TL.dtype), **shadows)
        if self.shared is not None and not waits:
            shared_BTD = self.shared(x_BTD)
        # NOTE: the sum below makes a fresh tensor; FSDP2 warns about (and may mishandle) a block output that is a view.
        y_BTD = self.w_up(self.latent_norm(y_TL)).view(B, T, D)
        return y_BTD + shared_BTD if shared_BTD is not None else y_BTD.clone()
