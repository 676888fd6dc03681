"""One layout's estimate: per-rank memory, every collective of an update, and the update's time.

A layout is the trainer's parallel degrees (HSDP replicas x FSDP shard, EP folded over the shard ranks),
micro-batch, gradient accumulation, sequence length and activation checkpointing, with the switches of
the config that move memory or traffic. Ranks are laid out as the trainer's mesh: EP innermost, then the
rest of the shard group, then the replicas; a group that spans more GPUs than a node runs at the network
rate. Collectives use ring costs: all-gather / reduce-scatter move (g-1)/g of the full buffer per rank,
all-reduce twice that. Units: bytes, seconds; GiB = 2**30 bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from titan_k3.models.k3.args import K3Args
from titan_k3.plan import constants as C
from titan_k3.plan.cluster import Cluster
from titan_k3.plan.costs import CostTable
from titan_k3.plan.shapes import (BF16, FP32, activation_bytes_per_token, largest_block_params,
                                  largest_layer_saved, layer_expert_params, layer_kinds, newton_schulz_flops, param_groups,
                                  residual_saved)

GIB = 2**30
QB_BINS = 1024
"""Quantile Balancing histogram bins per expert (titan_k3/models/k3/moe.py; a test keeps the two equal)."""


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    ep: int
    local_batch: int
    grad_accum: int
    seq_len: int
    ac: str = "none"
    reshard_after_forward: bool = True
    defer_grad_reduce: bool = True
    expert_dispatch: str = "all_gather"
    optimizer: str = "muon"
    ns_cuda_graphs: bool = False
    compiled: bool = False
    momentum_dtype: str = "float32"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.ep

    @property
    def tokens_per_microbatch(self) -> int:
        return self.local_batch * self.seq_len

    @property
    def tokens_per_update(self) -> int:
        return self.tokens_per_microbatch * self.grad_accum * self.world

    def describe(self) -> str:
        parts = [f"FSDP {self.dp_shard}" if self.world > 1 else "1 GPU"]
        if self.dp_replicate > 1:
            parts.insert(0, f"HSDP {self.dp_replicate}x")
        if self.ep > 1:
            parts.append(f"EP {self.ep} ({self.expert_dispatch})")
        text = " ".join(parts) + f", B{self.local_batch} x T{self.seq_len} x accum {self.grad_accum}, AC {self.ac}"
        if self.world > 1:
            text += f", reshard {'on' if self.reshard_after_forward else 'off'}"
            if self.grad_accum > 1:
                text += f", deferred reduce {'on' if self.defer_grad_reduce else 'off'}"
        return text


@dataclass
class Collective:
    name: str
    group: str
    group_size: int
    across_nodes: bool
    calls: int
    bytes_per_rank: float
    """Bytes each rank sends (= receives) over the update, all calls together."""
    seconds: float
    overlapped: bool
    """True where FSDP2 overlaps it with compute (prefetched gathers, per-block reductions)."""


@dataclass
class Estimate:
    layout: Layout
    memory_gib: dict[str, float]
    optimizer_peak_gib: float
    peak_gib: float
    budget_gib: float
    collectives: list[Collective]
    compute_s: float
    optimizer_s: float
    exposed_comm_s: float
    step_s: float
    compute_sources: dict[str, str]
    activations_by_ac_gib: dict[str, float]
    """One micro-batch's activations under each activation_checkpoint.mode (the layout's own is in memory_gib)."""
    warnings: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_gib <= self.budget_gib

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_update / self.step_s

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(fits=self.fits, tokens_per_s=self.tokens_per_s,
                 tokens_per_s_per_gpu=self.tokens_per_s / self.layout.world, layout_text=self.layout.describe())
        return d


def _link(cluster: Cluster, span: int) -> tuple[float, float, bool]:
    """(bytes/s, latency s, crosses nodes) for a group whose ranks span `span` consecutive GPUs."""
    if span <= cluster.gpus_per_node:
        return cluster.intra_node_gbps * 1e9, C.COLLECTIVE_LATENCY_S, False
    return cluster.inter_node_gbps * 1e9, C.INTER_NODE_LATENCY_S, True


def _collective(cluster: Cluster, name: str, group: str, size: int, span: int, op: str, buffer_bytes: float,
                calls: int, overlapped: bool) -> Collective:
    """op: all_gather / reduce_scatter / all_reduce / all_to_all of `buffer_bytes` (the full buffer) per call."""
    rate, latency, across = _link(cluster, span)
    frac = (size - 1) / size
    if op == "all_gather":
        wire, t = buffer_bytes * frac, buffer_bytes * frac / (rate * C.ALL_GATHER_EFFICIENCY)
    elif op == "reduce_scatter" or op == "all_to_all":
        wire, t = buffer_bytes * frac, buffer_bytes * frac / (rate * C.REDUCE_SCATTER_EFFICIENCY)
    else:
        wire = 2 * buffer_bytes * frac
        t = buffer_bytes * frac * (1 / (rate * C.REDUCE_SCATTER_EFFICIENCY) + 1 / (rate * C.ALL_GATHER_EFFICIENCY))
    return Collective(name, group, size, across, calls, wire * calls, (t + latency) * calls, overlapped)


def estimate(a: K3Args, lay: Layout, cluster: Cluster, table: CostTable) -> Estimate:
    g = param_groups(a)
    kinds = layer_kinds(a)
    W, S, R, e, efsdp, A = lay.world, lay.dp_shard, lay.dp_replicate, lay.ep, lay.efsdp, lay.grad_accum
    N, T = lay.tokens_per_microbatch, lay.seq_len
    single = W == 1
    experts_local = a.n_experts // e
    all_gather = lay.expert_dispatch == "all_gather"
    defer = lay.defer_grad_reduce and A > 1 and not single
    muon = lay.optimizer == "muon"
    warnings: list[str] = []

    # ---- parameters and optimizer state per rank (float32 master weights, sharded; routers whole)
    dense_local = g.sharded / S
    experts_here = g.muon_experts / S                         # split over ep, sharded over efsdp
    params_local = dense_local + experts_here + g.routers
    muon_local = (g.muon_dense / S + experts_here) if muon else 0.0
    adam_local = params_local - muon_local
    momentum_bytes = BF16 if lay.momentum_dtype == "bfloat16" else FP32
    momentum_key = f"optimizer: Muon momentum ({'bf16' if momentum_bytes == BF16 else 'fp32'})"
    mem: dict[str, float] = {
        "parameters (fp32)": FP32 * params_local,
        "gradients (fp32)": FP32 * params_local if (A > 1 or not single) else 0.0,
        momentum_key: momentum_bytes * muon_local,
        "optimizer: AdamW moments (2 x fp32)": 2 * FP32 * adam_local,
        "Newton-Schulz CUDA graphs (bf16)": 2 * BF16 * muon_local if (muon and lay.ns_cuda_graphs) else 0.0,
    }
    # NOTE: one process: no FSDP, the grads appear as the backward frees activations (zero_grad sets them to
    # None), so an update of one micro-batch peaks with none of them; accumulation keeps the first ones.

    # ---- bf16 compute copies of the parameters
    # NOTE: experts outside FSDP (one rank in their mesh) are cast to bf16 in each forward and the casts are
    # saved for the grouped GEMMs' backward: every MoE layer's, until its backward. Inside FSDP they are
    # gathered in bf16 like the dense blocks.
    keep_all = not lay.reshard_after_forward or defer
    experts_in_fsdp = efsdp > 1 or R > 1
    if single:
        copies = BF16 * (g.total - g.embedding - g.routers)  # autocast's weight cache + the explicit casts
    else:
        # NOTE: resharding after forward, the gathered blocks are the one running and the one prefetched; the root
        # (embedding, head) stays gathered from the start of forward to the end of backward.
        copies = BF16 * (g.sharded if keep_all else 2 * largest_block_params(a) + g.root)
        copies += BF16 * (g.muon_experts / e if keep_all or not experts_in_fsdp else 2 * layer_expert_params(a) / e)
    mem["bf16 parameter copies (gathered / cast)"] = copies
    mem["deferred unsharded gradients (fp32)"] = FP32 * (g.sharded + (g.muon_experts / e if efsdp > 1 else 0)) if defer else 0.0

    # ---- activations of one micro-batch, and the fused loss
    per_token = activation_bytes_per_token(a, e, all_gather)
    checkpointed = a.n_layers * residual_saved(a) + largest_layer_saved(a, e, all_gather)
    saved_by_ac = {"none": per_token, "selective": (per_token + checkpointed) / 2, "full": checkpointed}
    acts_by_ac = {mode: C.ACTIVATION_FACTOR * b * N / GIB for mode, b in saved_by_ac.items()}
    mem["activations (one micro-batch)"] = C.ACTIVATION_FACTOR * saved_by_ac[lay.ac] * N
    chunk_rows = min(N, max(1, 3 * GIB // (a.vocab_size * BF16)))
    mem["fused loss (logit chunk, fp32 dH and dW)"] = BF16 * chunk_rows * a.vocab_size + FP32 * N * a.dim + FP32 * a.vocab_size * a.dim
    # One layer's gradients on their way: the routed experts' bf16 gradients and their float32 cast before they
    # are added (or reduce-scattered), and under FSDP the next block's prefetched bf16 parameters and one
    # block's unsharded float32 gradients before its reduce-scatter.
    transient = (BF16 + FP32) * layer_expert_params(a) / e
    if not single:
        transient += (BF16 + FP32) * largest_block_params(a)
    mem["gradient and communication buffers (one layer)"] = transient
    fb_peak = sum(mem.values())

    # ---- optimizer step: activations gone, Newton-Schulz working set (its stacked blocks, two iterates)
    ns_dense, ns_experts = newton_schulz_flops(a)
    largest_group = max(g.muon_dense / S, experts_here / 1.5 if experts_here else 0.0)   # w1 and w3 share a shape
    ns_work = 0.0 if (not muon or lay.ns_cuda_graphs) else 3 * BF16 * largest_group
    static = ["parameters (fp32)", momentum_key, "optimizer: AdamW moments (2 x fp32)",
              "Newton-Schulz CUDA graphs (bf16)"]
    opt_peak = sum(mem[k] for k in static) + FP32 * params_local + ns_work
    peak = max(fb_peak, opt_peak)

    # ---- compute
    rate = cluster.matmul_tflops * 1e12 * C.COMPUTE_EFFICIENCY
    sources: dict[str, str] = {}
    per_mb = 0.0
    for kind, n in list(kinds.items()) + [("head", 1)]:
        if n == 0:
            continue
        cost = table.cost(a, kind, N, T, experts_local, lay.compiled, rate)
        sources[kind] = cost.source
        per_mb += n * cost.seconds
    recompute = {"none": 0.0, "selective": 0.5, "full": 1.0}[lay.ac] * (per_mb / 3)
    per_mb += C.MICROBATCH_OVERHEAD_S_PER_LAYER * a.n_layers
    ep_glu = 0.0
    if e > 1 and all_gather:
        slots = (e - 1) * N * a.top_k
        ep_glu = kinds["moe"] * slots * C.GLU_BYTES_PER_SLOT_PER_F * a.expert_hidden / (cluster.hbm_tbps * 1e12)
    compute = A * (per_mb + recompute + ep_glu)

    ns_flops = (ns_dense + ns_experts) / S if muon else 0.0
    # NOTE: the momentum pass reads and writes the buffer: a bf16 buffer saves two of its float32 streams.
    muon_bytes = C.OPTIMIZER_BYTES_PER_PARAM["muon"] - 2 * (FP32 - momentum_bytes)
    opt_bytes = (muon_bytes * muon_local + C.OPTIMIZER_BYTES_PER_PARAM["adamw"] * adam_local
                 + C.OPTIMIZER_BYTES_PER_PARAM["norm"] * params_local)
    optimizer = ns_flops / (cluster.matmul_tflops * 1e12 * C.NEWTON_SCHULZ_EFFICIENCY) + opt_bytes / (cluster.hbm_tbps * 1e12)

    # ---- collectives of one update
    colls: list[Collective] = []
    n_blocks = a.n_layers + 1
    if not single:
        reduces = 1 if defer else A
        gathers = 1 if defer else A * (1 if not lay.reshard_after_forward else 2)
        if S > 1:
            # NOTE: the root (embedding, head) is gathered once per micro-batch even when the blocks are gathered
            # twice (titan_k3/parallel/parallelize.py): its second gather is taken off the buffer's average.
            root_share = g.root * (gathers - (1 if defer else A)) / gathers
            colls.append(_collective(cluster, "FSDP all-gather (bf16 parameters)", "shard", S, S, "all_gather",
                                     BF16 * (g.sharded - root_share), gathers, True))
            colls.append(_collective(cluster, "FSDP reduce-scatter (fp32 gradients)", "shard", S, S, "reduce_scatter",
                                     FP32 * g.sharded, reduces, True))
        if efsdp > 1:
            colls.append(_collective(cluster, "FSDP all-gather (bf16 experts)", "efsdp", efsdp, S, "all_gather",
                                     BF16 * g.muon_experts / e, gathers, True))
            colls.append(_collective(cluster, "FSDP reduce-scatter (fp32 expert gradients)", "efsdp", efsdp, S,
                                     "reduce_scatter", FP32 * g.muon_experts / e, reduces, True))
        if R > 1:
            colls.append(_collective(cluster, "HSDP all-reduce (fp32 gradient shards)", "replicate", R, W, "all_reduce",
                                     FP32 * (dense_local + experts_here), reduces, True))
        if e > 1:
            passes = A * (3 if lay.ac != "none" else 2)       # forward, backward, and the recompute's forward
            L, k = a.latent_dim, a.top_k
            if all_gather:
                buf = e * N * BF16 * (L + 3 * k) + e * N * BF16 * L     # rows + routing in, outputs home
                colls.append(_collective(cluster, "EP all-gather + reduce-scatter (dispatch, combine)", "ep", e, e,
                                         "all_gather", buf, passes * kinds["moe"], False))
            else:
                buf = 2 * N * k * BF16 * L
                colls.append(_collective(cluster, "EP all-to-all (dispatch, combine)", "ep", e, e, "all_to_all", buf,
                                         passes * kinds["moe"], False))
                warnings.append("EP all_to_all dispatch: the host waits for each MoE layer's counts (not modelled)")
        colls.append(_collective(cluster, "router gradients all-reduce (fp32)", "dp", W, W, "all_reduce",
                                 FP32 * g.routers, 1, False))
        colls.append(_collective(cluster, "Quantile Balancing histograms all-reduce (fp64)", "dp", W, W, "all_reduce",
                                 8 * kinds["moe"] * a.n_experts * QB_BINS, A, False))
        colls.append(_collective(cluster, "loss, token count, grad-norm all-reduces", "dp", W, W, "all_reduce",
                                 16, 3, False))
        if muon and S > 1:
            # NOTE: FSDP2 shards dim 0, so each rank holds whole experts (orthogonalised where they are); only
            # the dense matrices, whose head blocks straddle shards, travel to an owner rank and back.
            # Each rank sends its shards to the matrices' owners and gets its own matrices' updates back.
            colls.append(_collective(cluster, "Muon owner gather + scatter (bf16)", "shard", S, S, "all_gather",
                                     2 * BF16 * g.muon_dense / S, 1, False))
    overlapped = sum(c.seconds for c in colls if c.overlapped)
    exposed = max(0.0, overlapped - compute) + overlapped / n_blocks + sum(c.seconds for c in colls if not c.overlapped)
    step = compute + optimizer + exposed

    if not single and N < C.HOST_BOUND_TOKENS:
        warnings.append(f"{N} tokens per micro-batch and GPU: sharded H200 ranks measured host-bound below "
                        f"{C.HOST_BOUND_TOKENS} (the planner models GPU time only)")
    gib = {k: v / GIB for k, v in mem.items()}
    return Estimate(lay, gib, opt_peak / GIB, peak / GIB, cluster.budget_gib, colls, compute, optimizer, exposed,
                    step, sources, acts_by_ac, warnings)
