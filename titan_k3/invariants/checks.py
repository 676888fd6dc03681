"""The invariant checks, each a function of explicit inputs (tensors, counts, a process group).

Every check is collective over `group` (all its ranks call it with the same
tensor shapes) and returns the violations it found, identical on every rank,
so that every rank can report or abort the same way. With `group=None` (one
process) the cross-rank checks have nothing to compare and return [].

Names: data.disjoint_sequences, data.source_mix, replicas.checksums,
gradient_scale.grad_norm_agreement, gradient_scale.grad_norm_audit,
gradient_scale.loss_normaliser, gradient_scale.ep_token_counts,
gradient_scale.probe_reference, gradient_scale.expert_grad_scale, weights.expert_shadows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from titan_k3.parallel.distributed import all_gather_small, all_reduce_small

CHECKS = (
    "data.disjoint_sequences",
    "data.source_mix",
    "replicas.checksums",
    "gradient_scale.grad_norm_agreement",
    "gradient_scale.grad_norm_audit",
    "gradient_scale.loss_normaliser",
    "gradient_scale.ep_token_counts",
    "gradient_scale.probe_reference",
    "gradient_scale.expert_grad_scale",
    "weights.expert_shadows",
)


@dataclass
class Violation:
    check: str
    """One of CHECKS."""
    metric: float
    """The number that broke the invariant (duplicates, relative error, ratio, ...)."""
    message: str
    details: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------- weights


def check_expert_shadows(mismatches: list[str]) -> list[Violation]:
    """Each expert weight's shadow (kernels.expert_weight_shadows) must be its master's cast, bit for bit.

    mismatches: one line per shadow that is not (`LatentMoE.shadow_mismatches`); metric: how many. Local to each
    rank (its own weights); the trainer refreshes a shadow whose master any torch op wrote, so a violation means a
    master written behind the version counter's back (a kernel other than Muon's update pass).
    """
    if not mismatches:
        return []
    return [Violation("weights.expert_shadows", float(len(mismatches)),
                      f"{len(mismatches)} expert weight shadow(s) differ from their masters' casts, so the experts "
                      f"compute with stale weights: {mismatches[0]}", {"shadows": mismatches})]


# ---------------------------------------------------------------------------- data


def check_disjoint_sequences(fingerprints: torch.Tensor, group) -> list[Violation]:
    """fingerprints int64 [N]: this rank's sequences in this update; no sequence may sit on two ranks."""
    if group is None:
        return []
    all_WN = all_gather_small(fingerprints.to(torch.int64).cpu(), group)
    owner: dict[int, int] = {}
    shared: dict[int, set[int]] = {}
    for rank, row in enumerate(all_WN.tolist()):
        for fp in set(row):
            if fp in owner:
                shared.setdefault(fp, {owner[fp]}).add(rank)
            else:
                owner[fp] = rank
    if not shared:
        return []
    ranks = sorted(set().union(*shared.values()))
    return [Violation(
        "data.disjoint_sequences", float(len(shared)),
        f"{len(shared)} of {len(owner)} sequences of this update are trained on by more than one data-parallel rank "
        f"(ranks {ranks}): the ranks read overlapping data; build each rank's loader with its data-parallel rank and "
        "size (not the global rank, not 0), and do not trust this run's updates since its last clean check",
        {"ranks": ranks},
    )]


def check_source_mix(source_tokens: dict[str, int], weights: dict[str, float], group, slack_tokens: float) -> list[Violation]:
    """Cumulative tokens per source (this rank's) summed over `group` must track the configured weights.

    A source violates when |observed - weight x total| > slack_tokens + 2% of the total.
    """
    names = sorted(weights)
    local = torch.tensor([float(source_tokens.get(n, 0)) for n in names], dtype=torch.float64)
    local = all_reduce_small(local, group)
    total = float(local.sum())
    if total == 0:
        return []
    off = {n: float(local[i]) - weights[n] * total for i, n in enumerate(names)}
    bad = {n: d for n, d in off.items() if abs(d) > slack_tokens + 0.02 * total}
    if not bad:
        return []
    worst = max(bad, key=lambda n: abs(bad[n]))
    share = (off[worst] + weights[worst] * total) / total
    return [Violation(
        "data.source_mix", abs(bad[worst]) / total,
        f"source '{worst}' is {100 * share:.1f}% of the {total:,.0f} tokens trained on, configured {100 * weights[worst]:.1f}%: "
        "check data.mixture against the dataset's sources and that every rank's loader samples every source",
        {"deviation_tokens": bad},
    )]


# ---------------------------------------------------------------------------- replicas

_DRIFT_REMEDY = ("the replicas have drifted apart and will diverge further: resume from the last checkpoint saved "
                 "before the first violation, and look for state one rank updates alone (a rank-dependent branch, a "
                 "replicated gradient that is not all-reduced)")

_BIT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 scalar over the exact bits of t, sensitive to position (two's-complement wrap-around is fine)."""
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.int8)
    bits = t.view(_BIT_VIEW[t.element_size()]).flatten().to(torch.int64) if t.is_floating_point() else t.flatten().to(torch.int64)
    position = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
    return (bits * position).sum() + bits.numel()


def check_replicas(named: dict[str, torch.Tensor], group) -> list[Violation]:
    """Every tensor in `named` (same names on every rank) must be bit-identical on every rank of `group`."""
    if group is None or not named:
        return []
    names = sorted(named)
    local = torch.stack([checksum(named[n]).cpu() for n in names])
    all_WN = all_gather_small(local, group)
    differs = (all_WN != all_WN[0]).any(dim=0)
    if not differs.any():
        return []
    bad = [n for n, d in zip(names, differs.tolist()) if d]
    ranks = [r for r in range(all_WN.shape[0]) if (all_WN[r] != all_WN[0]).any()]
    return [Violation(
        "replicas.checksums", float(len(bad)),
        f"{len(bad)} replicated tensors differ across ranks (rank(s) {ranks} disagree with rank 0): {', '.join(bad[:6])}"
        + (" ..." if len(bad) > 6 else "") + "; " + _DRIFT_REMEDY,
        {"tensors": bad, "ranks": ranks},
    )]


def check_replicated_shards(groups: list[tuple[dist.ProcessGroup, dict[str, torch.Tensor]]], dp_group) -> list[Violation]:
    """Shards replicated along a mesh dim (HSDP's dp_replicate) must be bit-identical across that dim's group.

    groups: (the group of ranks holding replicas of the same shards, {name: this rank's local shard}), in the
    same order with the same names on every rank. Collective over `dp_group`, which agrees on the verdict:
    the rank that sees a differing replica may share no group with rank 0.
    """
    if dp_group is None or not groups:
        return []
    names: list[str] = []
    flags: list[torch.Tensor] = []
    mine = False
    for group, named in groups:
        keys = sorted(named)
        local = torch.stack([checksum(named[n]).cpu() for n in keys])
        all_RN = all_gather_small(local, group)
        flags.append((all_RN != all_RN[0]).any(dim=0).to(torch.int64))
        mine = mine or bool((local != all_RN[0]).any())
        names += keys
    flag_N = all_reduce_small(torch.cat(flags), dp_group, dist.ReduceOp.MAX)
    ranks_W = torch.zeros(dist.get_world_size(dp_group), dtype=torch.int64)
    ranks_W[dist.get_rank(dp_group)] = int(mine)
    ranks_W = all_reduce_small(ranks_W, dp_group, dist.ReduceOp.MAX)
    if not flag_N.any():
        return []
    bad = [n for n, f in zip(names, flag_N.tolist()) if f]
    ranks = ranks_W.nonzero().flatten().tolist()
    return [Violation(
        "replicas.checksums", float(len(bad)),
        f"{len(bad)} replicated shards differ between their replicas (data-parallel rank(s) {ranks} disagree with "
        f"the first replica of their group): {', '.join(bad[:6])}" + (" ..." if len(bad) > 6 else "") + "; " + _DRIFT_REMEDY,
        {"tensors": bad, "ranks": ranks},
    )]


# ---------------------------------------------------------------------------- gradient scale


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _scale_remedy(ratio: float, world: int) -> str:
    """What to do about gradients `ratio` x the single-process ones, reduced over `world` data-parallel ranks."""
    if world > 1 and abs(ratio * world - 1) < 0.05:
        return (f"1/{world} of the right gradient: a reduction averages over the {world} ranks where it must sum "
                "(the loss is already divided by the update's targets: FSDP2's gradient divide factor must be 1)")
    if world > 1 and abs(ratio / world - 1) < 0.05:
        return f"{world}x the right gradient: a gradient is summed over the ranks twice"
    return "a gradient reduction is missing, doubled or over the wrong group: compare the parallel plan with one process"


def check_grad_norm_agreement(grad_norm: float, group, rtol: float = 1e-6) -> list[Violation]:
    """The global grad norm each rank clipped with must be the same on every rank.

    A norm that is non-finite on every rank skips the update everywhere (reported as such); non-finite on some ranks
    only is a violation (metric: how many ranks), since those ranks skip the update the others apply.
    """
    if group is None:
        return []
    norms = all_gather_small(torch.tensor([grad_norm], dtype=torch.float64), group).flatten()
    finite = torch.isfinite(norms)
    if not finite.any():
        return []
    if not finite.all():
        ranks = (~finite).nonzero().flatten().tolist()
        return [Violation(
            "gradient_scale.grad_norm_agreement", float(len(ranks)),
            f"data-parallel rank(s) {ranks} clipped with a non-finite global grad norm where the others' is finite "
            f"({[round(x, 6) for x in norms.tolist()]} by data-parallel rank): those ranks skip this update and the "
            "others apply it, so the replicas part; the norm must be reduced over every shard on every rank, not taken "
            "over local gradients",
            {"ranks": ranks},
        )]
    spread = float(norms.max() - norms.min())
    scale = max(float(norms.abs().max()), 1e-30)
    if spread <= rtol * scale:
        return []
    return [Violation(
        "gradient_scale.grad_norm_agreement", spread / scale,
        f"ranks clipped with different global grad norms {[round(x, 6) for x in norms.tolist()]} (by data-parallel rank): "
        "the norm must be reduced over every shard on every rank, not taken over local gradients",
    )]


def layout_grad_norm(grads: Iterable[torch.Tensor]) -> float:
    """L2 norm of the whole gradient, from every rank's per-tensor sums of squares (collective over the world).

    One all-gather of an [N] float64 vector (N gradient tensors) instead of
    gathering every sharded gradient. Each DTensor's square is summed over the
    ranks of its mesh that hold distinct shards (the first replica along every
    Replicate dim); a plain tensor is a replica and counts once. This follows
    the placements, not the clipping path's per-dim all-reduces, so it audits
    that path rather than repeating it.
    """
    grads = list(grads)
    if not grads:
        return 0.0
    # NOTE: float64 accumulation: a float32 norm of a large CPU tensor can be off by 1e-4 relative.
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    sq_N = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64).square() for t in local]).cpu()  # one sync
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return math.sqrt(float(sq_N.sum()))
    sq_WN = all_gather_small(sq_N, dist.group.WORLD)
    total = 0.0
    for j, g in enumerate(grads):
        if not isinstance(g, DTensor):
            total += float(sq_N[j])
            continue
        ranks = g.device_mesh.mesh
        for dim in reversed(range(ranks.ndim)):
            if isinstance(g.placements[dim], Replicate):
                ranks = ranks.select(dim, 0)
        total += float(sq_WN[ranks.flatten(), j].sum())
    return math.sqrt(total)


def check_grad_norm_audit(reported: float, gathered: float, rtol: float = 1e-3) -> list[Violation]:
    """The clipped-with norm must equal the norm recomputed from the shards' layout (`layout_grad_norm`).

    metric: the relative error, or 1.0 where the clipped-with norm is finite and the recomputed one is not.
    """
    if not math.isfinite(reported):
        return []  # a non-finite update is skipped and reported as such
    if not math.isfinite(gathered):
        # NOTE: the update is applied (its norm is finite) with non-finite gradients the clipping path did not see.
        return [Violation(
            "gradient_scale.grad_norm_audit", 1.0,
            f"global grad norm {reported:.6g} is finite but the norm recomputed from every rank's shards is "
            f"{gathered}: a gradient shard holds inf or NaN that the clipping path never summed, so this update is "
            "applied with it instead of skipped; the clipping path misses a sharded dim",
        )]
    err = abs(reported - gathered) / max(gathered, 1e-30)
    if err <= rtol:
        return []
    return [Violation(
        "gradient_scale.grad_norm_audit", err,
        f"global grad norm {reported:.6g} differs from the norm recomputed from every rank's shards {gathered:.6g} "
        f"({100 * err:.2f}%): the clipping path sums a replicated dim twice or misses a sharded one",
    )]


def check_loss_normaliser(normaliser: float, local_valid: int, group, rtol: float = 1e-5) -> list[Violation]:
    """The loss divisor must be the count of valid targets of this update summed over every rank.

    NOTE: the trainer counts and all-reduces in float32, exact only up to 2^24 targets: past that (a 16M-token
    update) the divisor is the true count rounded, off by ~1e-7 relative. A wrong divisor is off by a factor
    (a local count: 1/W), so the comparison is relative.
    """
    mine = torch.tensor([float(normaliser), float(local_valid)], dtype=torch.float64)
    all_W2 = mine[None] if group is None else all_gather_small(mine, group)
    expected = float(all_W2[:, 1].sum())
    if expected == 0:  # an update without targets is clamped to 1; nothing to compare
        return []
    wrong = ((all_W2[:, 0] - expected).abs() > rtol * expected).nonzero().flatten().tolist()
    if not wrong:
        return []
    first = float(all_W2[wrong[0], 0])
    local = first == float(all_W2[wrong[0], 1])
    return [Violation(
        "gradient_scale.loss_normaliser", first / expected,
        f"data-parallel rank(s) {wrong} divided the loss by {first:g} valid targets, but the update has {expected:g} "
        f"over all ranks" + (" (that is the rank's own count)" if local else "") + ": divide every micro-batch's "
        "summed loss by the update's valid targets all-reduced over the data-parallel group, never by a local count",
        {"ranks": wrong, "normaliser": first, "expected": expected},
    )]


def check_ep_token_counts(send_counts_W: torch.Tensor, recv_counts_W: torch.Tensor, routed_tokens: int, top_k: int,
                          group) -> list[Violation]:
    """Expert-parallel dispatch: rows sent to each rank and received from each rank, and tokens routed here.

    Invariants: what rank s sends to rank r is what r receives from s, and the
    rows dispatched over the group equal the rows received equal k x tokens routed.
    """
    sends_WW = all_gather_small(send_counts_W.to(torch.int64).cpu(), group) if group is not None else send_counts_W[None].cpu()
    recvs_WW = all_gather_small(recv_counts_W.to(torch.int64).cpu(), group) if group is not None else recv_counts_W[None].cpu()
    routed = torch.tensor([routed_tokens], dtype=torch.int64)
    routed = all_reduce_small(routed, group)
    dispatched, received, expected = int(sends_WW.sum()), int(recvs_WW.sum()), top_k * int(routed)
    mismatched = (sends_WW != recvs_WW.t()).nonzero().tolist()
    if not mismatched and dispatched == received == expected:
        return []
    return [Violation(
        "gradient_scale.ep_token_counts", float(max(abs(dispatched - expected), abs(received - expected))),
        f"expert dispatch lost or duplicated rows: dispatched {dispatched}, received {received}, "
        f"k x routed = {expected}" + (f"; sender->receiver pairs disagreeing: {mismatched[:4]}" if mismatched else "")
        + ": the expert-parallel split sizes or the combine are wrong (parallelism.expert_dispatch)",
    )]


def check_expert_grad_scale(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], group,
                            rtol: float = 1e-3, *, world: int | None = None) -> list[Violation]:
    """Local expert gradients vs the single-process gradients recomputed for the same experts.

    The ratio of norms (summed over the group) must be 1: an expert gradient
    averaged over the wrong group or divided by a local count shows as a ratio
    like 1/W or W. group: the ranks whose experts are summed (None: each rank
    holds them all, the probe's gathered gradients); world: the data-parallel
    ranks the gradients were reduced over, which the advice names (default:
    the group's size).
    """
    sq = torch.zeros(2, dtype=torch.float64)
    worst, worst_err = "", 0.0
    for name, g in grads.items():
        ref = reference[name].to(g.dtype)
        sq[0] += float(torch.linalg.vector_norm(g.double()) ** 2)
        sq[1] += float(torch.linalg.vector_norm(ref.double()) ** 2)
        err = float(torch.linalg.vector_norm((g - ref).double()) / torch.linalg.vector_norm(ref.double()).clamp(min=1e-30))
        if err > worst_err:
            worst, worst_err = name, err
    flag = torch.tensor([worst_err], dtype=torch.float64)
    sq = all_reduce_small(sq, group)
    flag = all_reduce_small(flag, group, dist.ReduceOp.MAX)
    ratio = float((sq[0] / sq[1].clamp(min=1e-300)).sqrt())
    if float(flag) <= rtol:
        return []
    return [Violation(
        "gradient_scale.expert_grad_scale", ratio,
        f"expert gradients are {ratio:.4g}x the single-process gradients (worst relative error {float(flag):.3g}"
        + (f" in {worst}" if worst_err == float(flag) and worst else "") + "): "
        + _scale_remedy(ratio, world if world is not None else _world(group)),
    )]


def check_probe_reference(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], group,
                          rtol: float = 1e-3) -> list[Violation]:
    """Gradients of one probe batch through the parallel model vs a single-process replica's (full tensors).

    grads: every parameter's gradient after the parallel reduction, gathered
    whole; reference: the same names from an unsharded copy of the model on
    the same batch. Summing over ranks makes them equal; FSDP averaging makes
    them 1/W; an extra or missing reduction shows the same way. The metric is
    the ratio of the whole norms; a violation is any tensor whose relative
    error exceeds rtol. The worst error is agreed over `group` (MAX).
    """
    sq = torch.zeros(2, dtype=torch.float64)
    worst, worst_err, worst_ratio = "", 0.0, 1.0
    for name, ref in reference.items():
        g = grads[name].double()
        ref = ref.double()
        n_g, n_ref = torch.linalg.vector_norm(g), torch.linalg.vector_norm(ref)
        sq += torch.stack([n_g.square(), n_ref.square()])
        err = float(torch.linalg.vector_norm(g - ref) / n_ref.clamp(min=1e-30))
        if err > worst_err:
            worst, worst_err, worst_ratio = name, err, float(n_g / n_ref.clamp(min=1e-30))
    flag = all_reduce_small(torch.tensor([worst_err], dtype=torch.float64), group, dist.ReduceOp.MAX)
    if float(flag) <= rtol:
        return []
    ratio = float((sq[0] / sq[1].clamp(min=1e-300)).sqrt())
    return [Violation(
        "gradient_scale.probe_reference", ratio,
        f"on a probe batch the parallel gradient is {ratio:.4g}x the single-process gradient "
        f"(worst tensor {worst}: {worst_ratio:.4g}x, relative error {worst_err:.3g} > {rtol:g}): "
        + _scale_remedy(ratio, _world(group)),
        {"worst_tensor": worst, "worst_relative_error": worst_err},
    )]
