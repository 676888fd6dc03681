"""From a config and a cluster to a verdict: the configured layout, the best one found, and why others lose.

The search keeps the recipe's global batch (sequences per update = local batch x accumulation x data-parallel
ranks as configured) and varies what the trainer lets a user choose without changing the math: HSDP
replicas x FSDP shard degree, the EP degree (dividing the shard degree and the experts) and its dispatch,
the micro-batch (with the accumulation that keeps the global batch), activation checkpointing, and FSDP's
two memory-for-traffic switches (reshard after forward, deferred gradient reduction).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_k3.config.validate import resolve_degrees
from titan_k3.models.k3.args import K3Args, get_flavor
from titan_k3.plan.cluster import Cluster
from titan_k3.plan.costs import DEFAULT_TABLE, CostTable
from titan_k3.plan.estimate import Estimate, Layout, estimate

AC_MODES = ("none", "selective", "full")


MAX_MICROBATCH = 4096
"""The search tries micro-batches up to this many sequences (a submitted batch may be huge)."""


def divisors(n: int, at_most: int | None = None) -> list[int]:
    """Ascending divisors of n >= 1 (those <= at_most when given)."""
    return [d for d in range(1, min(n, at_most or n) + 1) if n % d == 0]


def resolve_layout(cfg, world: int, n_experts: int) -> Layout:
    """The config's layout on `world` GPUs; a degree that does not fit is the trainer's one-line ConfigError (a
    ValueError), from the trainer's function."""
    p, t = cfg.parallelism, cfg.training
    rep, shard, ep = resolve_degrees(p, world, n_experts)
    return Layout(rep, shard, ep, t.local_batch_size, t.grad_accum, t.seq_len, cfg.activation_checkpoint.mode,
                  reshard_after_forward=p.fsdp_reshard_after_forward, defer_grad_reduce=p.fsdp_defer_grad_reduce,
                  expert_dispatch=p.expert_dispatch, optimizer=cfg.optimizer.name,
                  ns_cuda_graphs=cfg.optimizer.ns_cuda_graphs, compiled=cfg.compile.enable,
                  momentum_dtype=cfg.optimizer.momentum_dtype)


def candidates(a: K3Args, base: Layout, world: int, global_seqs: int) -> list[Layout]:
    """Every layout on `world` GPUs that keeps `global_seqs` sequences per update."""
    if global_seqs % world:
        return []
    per_rank = global_seqs // world
    out = []
    for rep in divisors(world):
        shard = world // rep
        for ep in (d for d in divisors(shard) if a.n_experts % d == 0):
            dispatches = ("all_gather", "all_to_all") if ep > 1 else (base.expert_dispatch,)
            for dispatch in dispatches:
                for batch in divisors(per_rank, MAX_MICROBATCH):
                    accum = per_rank // batch
                    for ac in AC_MODES:
                        for reshard in (True, False):
                            for defer in ((True, False) if accum > 1 else (base.defer_grad_reduce,)):
                                out.append(replace(base, dp_replicate=rep, dp_shard=shard, ep=ep, local_batch=batch,
                                                   grad_accum=accum, ac=ac, expert_dispatch=dispatch,
                                                   reshard_after_forward=reshard, defer_grad_reduce=defer))
    return out


@dataclass
class Verdict:
    configured: Estimate | None
    """The config's own layout on the whole cluster (None when its degrees do not fit the world size)."""
    configured_error: str
    best: Estimate | None
    """The fastest layout that fits, or None."""
    ranked: list[tuple[Estimate, str]]
    """Other layouts, each with why it loses to the best (the fastest few that fit, the closest that do not)."""
    searched: int

    @property
    def fits(self) -> bool:
        return self.best is not None

    def as_dict(self) -> dict:
        return {
            "fits": self.fits,
            "configured": self.configured.as_dict() if self.configured else None,
            "configured_error": self.configured_error,
            "best": self.best.as_dict() if self.best else None,
            "others": [{"layout": e.layout.describe(), "peak_gib": e.peak_gib, "fits": e.fits,
                        "tokens_per_s": e.tokens_per_s, "why": why} for e, why in self.ranked],
            "searched": self.searched,
        }


def why_loses(est: Estimate, best: Estimate) -> str:
    if not est.fits:
        top = max(est.memory_gib.items(), key=lambda kv: kv[1])
        return (f"does not fit: peak {est.peak_gib:.1f} GiB > {est.budget_gib:.1f} GiB usable "
                f"(largest part: {top[0]} {top[1]:.1f} GiB)")
    deltas = {"compute (incl. recompute)": est.compute_s - best.compute_s, "optimizer": est.optimizer_s - best.optimizer_s,
              "exposed communication": est.exposed_comm_s - best.exposed_comm_s}
    part, delta = max(deltas.items(), key=lambda kv: kv[1])
    slower = best.tokens_per_s / est.tokens_per_s - 1
    return f"{100 * slower:.1f}% slower: {part} +{delta * 1e3:.1f} ms per update"


def plan(a: K3Args, cfg, cluster: Cluster, table: CostTable, keep: int = 6) -> Verdict:
    configured, error = None, ""
    try:
        base = resolve_layout(cfg, cluster.world, a.n_experts)
        configured = estimate(a, base, cluster, table)
    except ValueError as e:
        error = str(e)
        p = cfg.parallelism
        base = Layout(1, cluster.world, 1, cfg.training.local_batch_size, cfg.training.grad_accum, cfg.training.seq_len,
                      cfg.activation_checkpoint.mode, p.fsdp_reshard_after_forward, p.fsdp_defer_grad_reduce,
                      p.expert_dispatch, cfg.optimizer.name, cfg.optimizer.ns_cuda_graphs, cfg.compile.enable,
                      cfg.optimizer.momentum_dtype)
    # NOTE: the global batch is the recipe's: what the config asks per rank, times the ranks it would get here.
    global_seqs = base.local_batch * base.grad_accum * cluster.world
    ests = [estimate(a, lay, cluster, table) for lay in candidates(a, base, cluster.world, global_seqs)]
    fitting = sorted((e for e in ests if e.fits), key=lambda e: (-e.tokens_per_s, e.peak_gib))
    best = fitting[0] if fitting else None
    ranked: list[tuple[Estimate, str]] = []
    if best is not None:
        ranked += [(e, why_loses(e, best)) for e in fitting[1:keep]]
        closest = sorted((e for e in ests if not e.fits), key=lambda e: e.peak_gib)[:2]
        ranked += [(e, why_loses(e, best)) for e in closest]
    else:
        closest = sorted(ests, key=lambda e: e.peak_gib)[:keep]
        ranked += [(e, why_loses(e, e)) for e in closest]
    return Verdict(configured, error, best, ranked, len(ests))


def smallest_cluster(a: K3Args, cfg, cluster: Cluster, table: CostTable, max_nodes: int = 4096) -> tuple[int, Verdict] | None:
    """The fewest nodes (from cluster.nodes up) on which some layout fits; None up to max_nodes.

    Doubles until a layout fits, then bisects between the last two counts: it assumes that more nodes never
    need more memory per rank for the same per-rank batch (true of the sharded parts; a node count whose
    GPUs share fewer divisors with the experts can break it, and then a smaller count may be missed).
    """
    lo, hi = cluster.nodes, cluster.nodes
    verdict = plan(a, cfg, cluster, table)
    while not verdict.fits:
        lo, hi = hi, hi * 2
        if hi > max_nodes:
            return None
        verdict = plan(a, cfg, cluster.replace(nodes=hi), table)
    if hi == lo:
        return hi, verdict
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = plan(a, cfg, cluster.replace(nodes=mid), table)
        if trial.fits:
            hi, verdict = mid, trial
        else:
            lo = mid
    return hi, verdict


def refusal(cfg, n_gpus: int, cluster: Cluster | None = None, table: CostTable | None = None) -> str | None:
    """One line saying why `cfg` cannot train on `n_gpus` GPUs of one node (one process each), or None.

    The control service asks this before it accepts a run. It refuses only what cannot fit even if the
    planner over-counts memory by its calibration tolerance (15% on the measured k3-mini runs), and it names
    a layout of the same batch that fits when the search finds one.
    """
    from titan_k3.plan.calibration import TOLERANCE

    if n_gpus < 1:
        return None
    a = get_flavor(cfg.model.flavor, cfg.model.vocab_size)
    cluster = (cluster or Cluster()).replace(gpus_per_node=n_gpus, nodes=1)
    if table is None:
        # NOTE: memory, which decides a refusal, needs no layer costs; where the table is not installed
        # (a service without the benchmarks folder) the suggested layout is ranked on analytic costs.
        table = CostTable.load() if DEFAULT_TABLE.is_file() else CostTable([], "none (no layer cost table installed)")
    try:
        est = estimate(a, resolve_layout(cfg, n_gpus, a.n_experts), cluster, table)
    except ValueError as e:
        return f"the planner says this run cannot start on its {n_gpus} GPU(s): {e}"
    if est.peak_gib * (1 - TOLERANCE) <= cluster.budget_gib:
        return None
    part, gib = max(est.memory_gib.items(), key=lambda kv: kv[1])
    best = plan(a, cfg, cluster, table).best
    hint = (f"; this batch fits as {best.layout.describe()} (peak {best.peak_gib:.1f} GiB)" if best else
            "; no layout of this batch fits them (python -m titan_k3.tools.plan --smallest finds the nodes it needs)")
    return (f"the planner says this run does not fit its {n_gpus} GPU(s): peak {est.peak_gib:.1f} GiB per GPU "
            f"as configured ({est.layout.describe()}; largest part: {part} {gib:.1f} GiB) against "
            f"{cluster.budget_gib:.1f} GiB usable on an H200, beyond its {100 * TOLERANCE:.0f}% calibration "
            f"tolerance{hint}")
