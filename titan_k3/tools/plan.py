"""`python -m titan_k3.tools.plan`: will this config train on this cluster, how, and how fast.

    python -m titan_k3.tools.plan --job.config_file tomls/pretrain.toml [--section.key value ...]
        [--cluster.nodes 4 --cluster.gpus_per_node 8 --cluster.gpu_memory_gib 139 ...]
        [--json] [--smallest] [--table benchmarks/results/layer_costs.json]

Reads the TOML and overrides exactly as the trainer does, plus `--cluster.*` keys (titan_k3/plan/cluster.py;
H200 defaults). Prints per-rank memory, every collective of an update, the update's time for the layout the
config asks on the whole cluster, then the best layout the search found and why the others lose.
`--smallest` doubles the node count from `--cluster.nodes` until some layout fits, then bisects down to the
fewest nodes that fit. `--json` prints one JSON object instead (`configured_fits`: the layout as configured fits
the usable memory; the control service asks `titan_k3.plan.search.refusal` instead, which refuses only beyond the
15% calibration tolerance). Bad input: one line, exit status 2.
Torch-free.
"""

from __future__ import annotations

import json
import sys

from titan_k3.config import ConfigError, load_job_config, split_overrides
from titan_k3.config.manager import bool_keys
from titan_k3.models.k3.args import count_params, get_flavor
from titan_k3.plan.cluster import cluster_from_overrides
from titan_k3.plan.costs import DEFAULT_TABLE, CostTable
from titan_k3.plan.estimate import Estimate
from titan_k3.plan.search import Verdict, plan, smallest_cluster

FLAGS = ("--json", "--smallest")


def parse(argv: list[str]):
    """-> (JobConfig, Cluster, table path, flags); ConfigError / ValueError on bad input."""
    flags = {f for f in FLAGS if f in argv}
    rest = [a for a in argv if a not in FLAGS]
    table = str(DEFAULT_TABLE)
    if "--table" in rest:
        i = rest.index("--table")
        if i + 1 >= len(rest):
            raise ValueError("option '--table' needs a value")
        table = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
    # NOTE: a true-or-false key alone means true, as the trainer's command line takes it (--compile.enable).
    pairs = split_overrides(rest, form="--section.key value, --cluster.key value, --json, --smallest or --table PATH",
                            flags=bool_keys())
    cluster = cluster_from_overrides([(k, v) for k, v in pairs if k.startswith("cluster.")])
    trainer_argv = [x for k, v in pairs if not k.startswith("cluster.") for x in (f"--{k}", v)]
    # NOTE: a plan reads no data, so a recipe is planned before its dataset is prepared.
    return load_job_config(trainer_argv, needs_data=False), cluster, table, flags


def _gib(x: float) -> str:
    return f"{x:8.2f}"


def format_estimate(title: str, est: Estimate) -> str:
    lay = est.layout
    lines = [f"{title}: {lay.describe()}  ({lay.world} GPUs, {lay.tokens_per_update:,} tokens per update)"]
    lines.append("  memory per rank, GiB")
    for name, gib in est.memory_gib.items():
        if gib > 0:
            lines.append(f"    {name:48s}{_gib(gib)}")
    lines.append("    (activations under activation_checkpoint.mode "
                 + ", ".join(f"{m}: {g:.2f}" for m, g in est.activations_by_ac_gib.items()) + ")")
    lines.append(f"    {'peak (forward / backward)':48s}{_gib(sum(est.memory_gib.values()))}")
    lines.append(f"    {'peak (optimizer step)':48s}{_gib(est.optimizer_peak_gib)}")
    lines.append(f"    {'usable':48s}{_gib(est.budget_gib)}  -> {'fits' if est.fits else 'DOES NOT FIT'}")
    if est.collectives:
        width = max(len(c.name) for c in est.collectives)
        lines.append(f"  {'collectives per update':{width + 3}s}group (size)      calls   GB/rank    ms   overlapped")
        for c in est.collectives:
            where = f"{c.group} ({c.group_size}{', net' if c.across_nodes else ''})"
            lines.append(f"    {c.name:{width}s} {where:17s} {c.calls:5d} {c.bytes_per_rank / 1e9:9.3f} "
                         f"{c.seconds * 1e3:7.1f}   {'yes' if c.overlapped else 'no'}")
    lines.append(f"  time per update: compute {est.compute_s * 1e3:.1f} ms + optimizer {est.optimizer_s * 1e3:.1f} ms"
                 f" + exposed communication {est.exposed_comm_s * 1e3:.1f} ms = {est.step_s * 1e3:.1f} ms"
                 f"  ({est.tokens_per_s:,.0f} tokens/s, {est.tokens_per_s / lay.world:,.0f} per GPU)")
    lines.append("  compute per sublayer kind: " + "; ".join(f"{k}: {v}" for k, v in est.compute_sources.items()))
    lines += [f"  warning: {w}" for w in est.warnings]
    return "\n".join(lines)


def format_verdict(header: str, v: Verdict) -> str:
    out = [header, ""]
    if v.configured is not None:
        out.append(format_estimate("As configured", v.configured))
    else:
        out.append(f"As configured: not possible on this cluster: {v.configured_error}")
    out.append("")
    if v.best is None:
        out.append(f"Verdict: DOES NOT FIT: none of {v.searched} layouts (HSDP x FSDP x EP degrees, EP dispatch, "
                   "micro-batch, activation checkpointing, FSDP reshard / deferred reduce) fits; the closest:")
    else:
        out.append(f"Verdict: FITS. Best of {v.searched} layouts searched: {v.best.layout.describe()}: "
                   f"{v.best.step_s * 1e3:.1f} ms per update, {v.best.tokens_per_s:,.0f} tokens/s, "
                   f"peak {v.best.peak_gib:.1f} GiB")
        if v.configured is None or v.best.layout != v.configured.layout:
            out.append(format_estimate("Best found", v.best))
        out.append("Others:")
    for est, why in v.ranked:
        out.append(f"  {est.layout.describe()}: {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return 0
    try:
        cfg, cluster, table_path, flags = parse(argv)
        table = CostTable.load(table_path)
        args = get_flavor(cfg.model.flavor, cfg.model.vocab_size)
        if "--smallest" in flags:
            found = smallest_cluster(args, cfg, cluster, table)
            if found is None:
                raise ValueError(f"no layout of flavor '{cfg.model.flavor}' fits on up to 4096 nodes of this cluster")
            cluster = cluster.replace(nodes=found[0])
            verdict = found[1]
        else:
            verdict = plan(args, cfg, cluster, table)
    except (ConfigError, ValueError) as e:
        print(f"plan: {e}", file=sys.stderr)
        return 2
    pc = count_params(args)
    if "--json" in flags:
        out = {"flavor": cfg.model.flavor, "params_total": pc.total, "params_active": pc.active,
               "cluster": cluster.__dict__ | {"world": cluster.world, "budget_gib": cluster.budget_gib},
               "cost_table": table.origin,
               "configured_fits": verdict.configured is not None and verdict.configured.fits}
        out.update(verdict.as_dict())
        print(json.dumps(out, indent=1, default=str))
        return 0
    header = (f"titan_k3 plan: flavor {cfg.model.flavor} ({pc.total / 1e9:.3f}B total / {pc.active / 1e9:.3f}B active), "
              f"seq_len {cfg.training.seq_len}; cluster {cluster.nodes} x {cluster.gpus_per_node} GPUs, "
              f"{cluster.gpu_memory_gib:g} GiB each ({cluster.budget_gib:g} usable), NVLink {cluster.intra_node_gbps:g} GB/s, "
              f"network {cluster.inter_node_gbps:g} GB/s per GPU; costs: {table.origin}")
    print(format_verdict(header, verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
