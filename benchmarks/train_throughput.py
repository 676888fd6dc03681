"""k3-mini training throughput on one GPU: our full recipe, ablations, and both peers in the same run.

    PYTHONPATH=. python benchmarks/train_throughput.py --out OUTDIR \
        [--variants ours-compile-step-graph,peer-compiled,peer,...] [--seq 4096 1024 --batch 8 32] [--isolate] \
        [--rounds N]

Each variant trains k3-mini (vocab 163,840) on the embedded corpus's real
tokens: warm-up steps, then timed steps run back to back as in training
(wall time between two CUDA synchronisations, per step). Reported: steady tokens/s, MFU against the datasheet
peak (989 TFLOP/s) with the FLOP count of `flops_per_token`, peak memory (allocated, and reserved: the footprint
to compare where CUDA graphs keep pools),
seconds from variant start to the end of its first step, the loss of every step (the peers must learn
like ours on the same batches), and two ratios: to the strong peer (the fastest of `peer-compiled`,
benchmarks/peer_compiled.py: public parts, compiled per block, `peer-compiled-graphs`, the same with
`torch.compile`'s CUDA graphs, and `peer-compiled-graphs-bf16-head`, that one with the head's weight gradient added
up in bf16 instead of float32, where they ran in the slot) and to the eager peer (the faster of `peer`,
benchmarks/peer_eager.py: our model run eagerly on public kernels, and `peer-public-eager`, the public-parts model of
benchmarks/peer_compiled.py run eagerly, where they ran in the slot; `peer` needs ~99 GiB, more than an H100 has).
Prints a table last, the host under it, and appends dated rows to OUTDIR/train_throughput.md.
`--isolate` runs each variant in a fresh process: in one process the peers' host-bound steps and every
variant's peak memory depend on what ran before them (the strong peer measured 206 ms first, 242 ms last).
`--rounds N` runs the variant list N times in turn: the strong peer's step moved 173-184 ms between calls on
one warm machine (its step is host-bound), so one pair of runs is a noisy ratio; each round's ratio pairs
runs minutes apart, and a summary gives the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import (RUNS, environment, model_args, peak_gib, peak_reserved_gib, pools_table,  # noqa: E402
                               reserved_by_pool, reset_peak, sync, write_results)
from titan_k3.config import load_job_config  # noqa: E402
from titan_k3.models.k3.args import flops_per_token, get_flavor  # noqa: E402

RECIPE = ["--job.config_file", str(ROOT / "tomls" / "pretrain.toml"), "--data.dataset", "embedded",
          "--checkpoint.enable", "false"]
"""The pretraining recipe as a user runs it, on the embedded corpus with checkpointing off."""

VARIANTS = {
    # name: CLI overrides on top of the k3-mini base (our full recipe: Muon, QB, clipping, QK-Clip)
    "ours": [],
    "ours-fla-kda": ["--kernels.kda", "fla"],
    "ours-grouped_mm": ["--kernels.experts", "grouped_mm"],
    "ours-torch-loss": ["--kernels.loss", "torch"],
    "ours-adamw": ["--optimizer.name", "adamw"],
    "ours-compile": ["--compile.enable", "true"],
    "ours-compile-fla-kda": ["--compile.enable", "true", "--kernels.kda", "fla"],
    "ours-ac-full": ["--activation_checkpoint.mode", "full"],
    # Ablations of the compiled recipe: one part swapped for its reference or another setting.
    "ours-compile-grouped_mm": ["--compile.enable", "true", "--kernels.experts", "grouped_mm"],
    "ours-compile-triton-mix": ["--compile.enable", "true", "--kernels.attn_res", "triton"],
    "ours-compile-torch-mix": ["--compile.enable", "true", "--kernels.attn_res", "torch"],
    # MLA on packed documents through flex_attention's block-sparse document mask instead of a dense-mask SDPA
    "ours-compile-flex": ["--compile.enable", "true", "--kernels.attention", "flex"],
    # Per-Head Muon's Newton-Schulz replayed as CUDA graphs (fewer host launches in a host-bound step)
    "ours-compile-ns-graphs": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true"],
    # ... MLA on packed documents through flash's variable-length kernel (each document its own sequence: what
    # auto picks since bf6501e), and through cuDNN on the dense document mask (auto before)
    "ours-compile-ns-graphs-varlen": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                      "--kernels.attention", "varlen"],
    "ours-compile-ns-graphs-dense-mask": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                          "--kernels.attention", "cudnn"],
    # ... and the update's forward and backward replayed as one CUDA graph (the host no longer issues ~2,500 launches)
    "ours-compile-step-graph": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                "--compile.cuda_graph", "true"],
    "ours-compile-adamw-step-graph": ["--compile.enable", "true", "--optimizer.name", "adamw",
                                      "--compile.cuda_graph", "true"],
    # ... with KDA's short convolutions on inductor's fusion of the torch reference instead of our Triton kernels
    # (what auto picked before 2026-12-02; measured 164.1 against 160.0 ms at B8 T4096)
    "ours-compile-step-graph-torch-conv": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                           "--compile.cuda_graph", "true", "--kernels.conv", "torch"],
    # ... with Muon's momentum buffers stored in bf16 (optimizer.momentum_dtype; predicted ~1.6 GiB less held)
    "ours-compile-step-graph-bf16-momentum": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                              "--compile.cuda_graph", "true", "--optimizer.momentum_dtype", "bfloat16"],
    # ... with Muon's Newton-Schulz graphs (and momentum passes) in the update graph's pool (predicted up to ~4 GiB
    # less reserved)
    "ours-compile-step-graph-shared-pool": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                            "--compile.cuda_graph", "true", "--compile.cuda_graph_share_pool", "true"],
    # ... both memory levers together (predicted ~5 GiB less)
    "ours-compile-step-graph-lean": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                     "--compile.cuda_graph", "true", "--compile.cuda_graph_share_pool", "true",
                                     "--optimizer.momentum_dtype", "bfloat16"],
    # ... with the memory levers measured on 2026-12-02: expandable segments and Newton-Schulz over 512 blocks at a
    # time (and the fused loss 4,096 rows at a time, given back for 8,192 in session 45: the peak stays under the
    # strongest peer's), the two mix levers of session 31, the optimizer's second stream of session 36, and session
    # 46's one-pass loss and expert weight shadows (tomls/pretrain.toml since)
    "ours-compile-step-graph-lean-memory": ["--compile.enable", "true", "--optimizer.ns_cuda_graphs", "true",
                                            "--compile.cuda_graph", "true", "--compile.cuda_graph_share_pool", "true",
                                            "--optimizer.momentum_dtype", "bfloat16", "--training.expandable_segments",
                                            "true", "--kernels.loss_chunk_rows", "0", "--optimizer.ns_chunk", "512",
                                            "--lr_scheduler.warmup_fraction", "0.01",
                                            "--kernels.attn_res_grad_in_place", "true",
                                            "--kernels.attn_res_norm_in_mix", "true", "--optimizer.side_stream", "true",
                                            "--kernels.loss_one_pass", "true", "--kernels.expert_weight_shadows", "true"],
    # The pretraining recipe itself (tomls/pretrain.toml: every optimizer, compile and kernel setting it makes) at the
    # benchmark's shape, on the embedded corpus, checkpointing off: the headline's variant.
    # tests/unit/test_benchmark_scripts.py keeps it equal to ours-compile-step-graph-lean-memory, every flag spelled out.
    "ours-recipe": RECIPE,
    # ... with each Newton-Schulz over 32 / 64 blocks at a time (optimizer.ns_chunk: a chunk's iterates can stay in
    # L2 where the whole batch goes through memory, ~43 GB per update; predicted ~5-8 ms of the 20.5 ms:
    # L2-resident products against ~1,800-3,600 more, shorter launches inside the graph)
    "ours-recipe-ns-chunk32": [*RECIPE, "--optimizer.ns_chunk", "32"],
    "ours-recipe-ns-chunk64": [*RECIPE, "--optimizer.ns_chunk", "64"],
    # ... with the allocator's expandable segments set through the environment (VARIANT_ENV; measured in session 17
    # before training.expandable_segments existed; the recipe now sets them itself, so this is the recipe again)
    "ours-recipe-expandable": RECIPE,
    # Session 17 measured the loss 4,096 rows at a time and Newton-Schulz over 512 blocks as recipe + flag variants
    # (ours-recipe-ce4096, -lean-memory, -lean-memory-ns512; train_throughput.md); both are in the recipe now.
    # The recipe with one of its memory levers turned back off (which one moves speed or the loss curve)
    "ours-recipe-ns-whole": [*RECIPE, "--optimizer.ns_chunk", "0"],
    # The recipe with the routers' top-k as our Triton kernel instead of inductor's fusion of the torch reference
    # (kernels.router; the fused reference took 91 us per MoE layer, the kernel 40; the step 153.7 -> 154.6 ms with
    # it in session 19's one comparison; session 29's two alternating rounds: 140.2 against 140.6 ms, 0.7 ms less
    # kernel time, and auto takes it since: the recipe itself runs it now)
    "ours-recipe-router-triton": [*RECIPE, "--kernels.router", "triton"],
    # The residual stream's gradients summed inside the mixes' backward kernels (kernels.attn_res_grad_in_place) and
    # each sublayer's pre-norm done by the mix that feeds it (kernels.attn_res_norm_in_mix): predicted 0.5-1.1 and
    # 0.6-1.0 ms, measured 0.3 and 0.2 alone, 1.2 ms and 0.7 GiB together (session 31); the recipe sets both since
    # 8fd5b05, so these variants are the recipe again, and `ours-recipe-mixes-plain` is the recipe without them.
    "ours-recipe-grad-in-place": [*RECIPE, "--kernels.attn_res_grad_in_place", "true"],
    "ours-recipe-norm-in-mix": [*RECIPE, "--kernels.attn_res_norm_in_mix", "true"],
    "ours-recipe-norm-in-mix-grad-in-place": [*RECIPE, "--kernels.attn_res_norm_in_mix", "true",
                                              "--kernels.attn_res_grad_in_place", "true"],
    "ours-recipe-mixes-plain": [*RECIPE, "--kernels.attn_res_norm_in_mix", "false",
                                "--kernels.attn_res_grad_in_place", "false"],
    # The expert GEMMs reading the float32 master weights and rounding each tile as they load it
    # (kernels.experts_cast_in_kernel): no 33 cast passes of 24.5M parameters and 1.5 GiB less at the update's peak,
    # for twice the bytes per weight tile; predicted -0.5..+1.2 ms, measured +12.7 ms (session 31). With the loss's
    # logits 8,192 rows at a time the freed memory buys back the ~0.6-1 ms that 4,096 rows cost (session 17). The
    # recipe's weight shadows (another way to skip the casts) go off with it.
    "ours-recipe-experts-cast-in-kernel": [*RECIPE, "--kernels.experts_cast_in_kernel", "true",
                                           "--kernels.expert_weight_shadows", "false"],
    "ours-recipe-experts-cast-in-kernel-ce8192": [*RECIPE, "--kernels.experts_cast_in_kernel", "true",
                                                  "--kernels.expert_weight_shadows", "false",
                                                  "--kernels.loss_chunk_rows", "8192"],
    # The recipe run eagerly (no compile, no CUDA graphs): slower, but every kernel is launched by an op, so its
    # profile names the ops and input shapes the step pays for (which sums, which adds).
    "ours-recipe-eager": [*RECIPE, "--compile.enable", "false", "--compile.cuda_graph", "false",
                          "--compile.cuda_graph_share_pool", "false"],
    # The recipe with AdamW for every matrix in place of Per-Head Muon: the model's own speed, for the headline's
    # "ours with AdamW" column (what Muon's step costs inside the update); Muon's graph settings and the experts'
    # weight shadows (Muon writes them) go with Muon
    "ours-recipe-adamw": [*RECIPE, "--optimizer.name", "adamw", "--optimizer.ns_cuda_graphs", "false",
                          "--compile.cuda_graph_share_pool", "false", "--kernels.expert_weight_shadows", "false"],
    # The fused loss 8,192 rows at a time: -1.1 ms in session 43, -1.0 at both shapes in session 45 for 1.25 GiB,
    # the recipe's setting since (so this variant is the recipe again).
    "ours-recipe-ce-default": [*RECIPE, "--kernels.loss_chunk_rows", "0"],
    # The recipe with the fused loss's row kernel launched as --rows-launch says (kernels/fused_ce/ce_rows.py
    # RowsLaunch). Session 44 measured two per SM with the second pass backwards (so that it reads from L2 what the
    # first read last; predicted up to one of the kernel's three passes over each chunk, ~2.7 ms of its 8.1 per
    # update on an H200): -0.8 to -1.0 ms at both shapes on an H100; session 45 one per SM of 32 warps, 32,768
    # logits per step: -0.7 to -1.0 ms more, the kernel's default since. `--rows-launch 4096,8,0,0,0,0` runs one
    # program per row, `16384,16,2,1,1,1` session 44's launch.
    "ours-recipe-rows-launch": RECIPE,
    # ... and 8,192 rows at a time with it (the launch of a session's probe beside the recipe's loss chunks).
    "ours-recipe-ce-default-rows-launch": [*RECIPE, "--kernels.loss_chunk_rows", "0"],
    # The recipe with the loss's one-pass row kernel (kernels.loss_one_pass, kernels/fused_ce/ce_one_pass.py: one
    # read of each chunk's logits instead of two). Predicted from the two-pass kernel's 1.17 ms per 4,096 rows on an
    # H100 (3.44 TB/s counting three passes) against ~0.89 ms for one read and one write at ~3 TB/s: ~-0.25 ms per
    # 4,096 rows, ~-2 ms per update, less the two [C, D] row scalings it adds (~0.1 ms). With -rows-launch, its
    # launch as `benchmarks/fused_ce.py --one-pass` prints the fastest. Measured in session 46 at its fastest launch:
    # -1.2 ms on an H100; the recipe's since (so with the kernel's default launch this variant is the recipe again).
    "ours-recipe-loss-one-pass": [*RECIPE, "--kernels.loss_one_pass", "true"],
    "ours-recipe-loss-one-pass-rows-launch": [*RECIPE, "--kernels.loss_one_pass", "true"],
    # The recipe with the experts reading bf16 shadows of their float32 masters that Per-Head Muon's update pass
    # writes (kernels.expert_weight_shadows, titan_k3/models/k3/expert_shadows.py) in place of 33 cast passes of
    # 24.5M parameters per update (~1.5 ms of an H100 profile: 147 MB each), for 2 more bytes written per expert
    # parameter in the update pass (~0.5 ms, on the side stream): predicted ~-1 ms, the same peak. Measured in
    # session 46: -1.1 ms on an H100; the recipe's since (so this variant is the recipe again).
    "ours-recipe-expert-shadows": [*RECIPE, "--kernels.expert_weight_shadows", "true"],
    # ... with the fused loss 2,048 rows at a time (the recipe: 4,096). Predicted: ~0.6 GiB less peak allocated
    # (4,096 rows took 30.1 -> 28.9 GiB against the default in session 17, at the cost of noise), where the recipe
    # is 0.2 GiB above the strongest peer's 27.8 (session 24); twice the loss's launches, ~0.3 ms. Measured (session 25,
    # two alternating rounds at each shape): 27.4-27.5 GiB, +1.3 to +1.5 ms; the recipe keeps 4,096.
    "ours-recipe-ce2048": [*RECIPE, "--kernels.loss_chunk_rows", "2048"],
    "ours-recipe-fixed-segments": [*RECIPE, "--training.expandable_segments", "false"],
    # The recipe with the fused loss's two gradient products in FP8 (kernels.loss_grad_fp8): dH and dW ran 2.0x and
    # 1.8x their bf16 rate at a 4,096-row chunk (fp8.md, session 26); predicted ~-6 ms per update (8 chunks of
    # ~-0.9 ms, less the W and h casts), +1.3 GiB (two e5m2 copies of a chunk's gradient); with 2,048-row chunks,
    # memory as the recipe's for ~1.5 ms of it back. Measured (session 26, B32 T1024): -1.3 / -1.9 ms with one pass
    # writing both layouts of G, 136.7 ms (~-5, across calls) with the transposed copy as a pass of its own, 29.5 GiB;
    # 2,048-row chunks +4 ms over its own 4,096.
    # (the recipe's one-pass loss, another way to write the gradient, goes off with it)
    "ours-recipe-loss-fp8": [*RECIPE, "--kernels.loss_grad_fp8", "true", "--kernels.loss_one_pass", "false"],
    "ours-recipe-loss-fp8-ce2048": [*RECIPE, "--kernels.loss_grad_fp8", "true", "--kernels.loss_one_pass", "false",
                                    "--kernels.loss_chunk_rows", "2048"],
    # FP8 on every block linear of k3-mini (the default min_dim 8192 converts none: none paid, fp8.md)
    "ours-compile-fp8": ["--compile.enable", "true", "--float8.enable", "true", "--float8.min_dim", "256"],
    "ours-compile-torch-loss": ["--compile.enable", "true", "--kernels.loss", "torch"],
    "ours-compile-adamw": ["--compile.enable", "true", "--optimizer.name", "adamw"],
    "ours-compile-ac-selective": ["--compile.enable", "true", "--activation_checkpoint.mode", "selective"],
    "ours-compile-ac-full": ["--compile.enable", "true", "--activation_checkpoint.mode", "full"],
}


def base_args(flavor: str, seq: int, batch: int, name: str) -> list[str]:
    return [*model_args(flavor), "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch), "--training.compute_dtype", "bfloat16",
            "--training.steps", "1000", "--metrics.log_freq", "1000", "--invariants.enable", "false",
            "--job.dump_folder", str(RUNS), "--job.name", name,
            # NOTE: a scratch run: a second benchmark on the same machine reuses the name and starts it over.
            "--job.overwrite", "true"]


def time_steps(step_fn, warmup: int, steps: int) -> tuple[float, float, list[float], list]:
    """(first step s, timed steps' total s, per-step host times s, what each step returned).

    The timed steps run back to back as in training, synchronised only
    before and after (a sync per step would stop the host from queueing the
    next step while the GPU finishes the last one's optimizer).
    """
    t0 = time.perf_counter()
    results = [step_fn()]
    sync()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        results.append(step_fn())
    sync()
    times = []
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        results.append(step_fn())
        times.append(time.perf_counter() - t)
    sync()
    return first, time.perf_counter() - start, times, results


def _loss(result) -> float:
    """A step's mean loss: our StepResult reads it back; the peers return a device scalar."""
    return float(result.loss if hasattr(result, "loss") else result)


VARIANT_ENV = {
    # The CUDA caching allocator's expandable segments (one growing mapping per stream instead of fixed-size
    # segments): predicted to bring the reserved peak nearer the allocated one (36.3 against 30.1 GiB for the
    # recipe at B8 T4096). Set before CUDA starts, so only in a process of its own (--isolate).
    "ours-recipe-expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
"""Environment a variant's process needs: run_isolated sets it for the child; a run in this process refuses the
variant unless it is already set."""


PEERS = ("peer", "peer-compiled", "peer-compiled-graphs", "peer-compiled-graphs-bf16-head", "peer-public-eager")
STRONG_PEERS = ("peer-compiled", "peer-compiled-graphs", "peer-compiled-graphs-bf16-head")
"""A row's strong-peer ratio is to the fastest of these in its slot: the strongest baseline a user could pick."""
EAGER_PEERS = ("peer", "peer-public-eager")
"""A row's eager-peer ratio is to the fastest of these in its slot (the faster eager model a user could pick)."""


def rows_launch(spec: str):
    """--rows-launch's 'block,warps,programs_per_sm,reverse,prefetch,l2_hints' as a RowsLaunch."""
    from kernels.fused_ce.ce_rows import RowsLaunch

    fields = [int(f) for f in spec.split(",")]
    if len(fields) != len(RowsLaunch._fields):
        raise SystemExit(f"--rows-launch {spec!r}: {len(RowsLaunch._fields)} comma-separated integers "
                         f"({','.join(RowsLaunch._fields)})")
    return RowsLaunch(*(bool(f) if isinstance(d, bool) else f for f, d in zip(fields, RowsLaunch._field_defaults.values())))


ROWS_LAUNCH_MODULES = {"ours-recipe-loss-one-pass-rows-launch": "kernels.fused_ce.ce_one_pass"}
"""The module whose LAUNCH a *-rows-launch variant sets, where it is not the two-pass row kernel's
(kernels.fused_ce.ce_rows)."""


@contextlib.contextmanager
def variant_rows_launch(name: str, spec: str):
    """The row kernel's launch for a *-rows-launch variant while it runs (ROWS_LAUNCH_MODULES names the kernel);
    the module's default before and after."""
    import importlib

    if not name.endswith("-rows-launch"):
        yield
        return
    if not spec:
        raise SystemExit(f"variant {name}: needs --rows-launch")
    module = importlib.import_module(ROWS_LAUNCH_MODULES.get(name, "kernels.fused_ce.ce_rows"))
    saved, module.LAUNCH = module.LAUNCH, rows_launch(spec)
    try:
        yield
    finally:
        module.LAUNCH = saved


def run_variant(name: str, flavor: str, seq: int, batch: int, warmup: int, steps: int, out: Path, profile: bool,
                memory_peak: bool = False, rows_launch_spec: str = "") -> dict:
    with variant_rows_launch(name, rows_launch_spec):
        row = _run_variant(name, flavor, seq, batch, warmup, steps, out, profile, memory_peak)
    if name.endswith("-rows-launch"):
        row["rows_launch"] = rows_launch_spec
    return row


def _run_variant(name: str, flavor: str, seq: int, batch: int, warmup: int, steps: int, out: Path, profile: bool,
                 memory_peak: bool) -> dict:
    reset_peak()
    traced = memory_peak and torch.cuda.is_available()
    if memory_peak and not traced:
        print(f"--memory-peak {name}: the allocator's trace needs CUDA; no report without a GPU", flush=True)
    if traced:
        from titan_k3.metrics.memory_peak import start_recording

        baseline = start_recording()
    from torch._dynamo.utils import counters

    counters.clear()  # graph-break counts per variant, not accumulated over the run
    start = time.perf_counter()
    if name in PEERS:
        from titan_k3.data.loader import build_dataloader
        from titan_k3.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer("embedded")
        if name == "peer":
            from benchmarks.peer_eager import PeerTrainer

            peer = PeerTrainer()
        else:
            from benchmarks.peer_compiled import PeerCompiledTrainer, PeerConfig

            # NOTE: the debug flavor runs the peer's plain-PyTorch parts on a CPU (a smoke check, not a measurement).
            cpu = flavor == "debug"
            peer = PeerCompiledTrainer(PeerConfig(
                flavor=flavor, vocab_size=tokenizer.vocab_size if cpu else 163840, parts="torch" if cpu else "fla",
                compile=name in STRONG_PEERS and not cpu,
                compile_mode="reduce-overhead" if name.startswith("peer-compiled-graphs") else None,
                head_grad_fp32=name != "peer-compiled-graphs-bf16-head"))
        loader = build_dataloader("embedded", tokenizer, seq, batch, 0, 1, 0)
        step_fn = lambda: peer.train_step(next(loader))  # noqa: E731
        holder = peer
    else:
        from titan_k3.train import Trainer

        trainer = Trainer(load_job_config(base_args(flavor, seq, batch, f"{name}-{seq}") + VARIANTS[name]))
        step_fn = trainer.train_step
        holder = trainer
    build_s = time.perf_counter() - start
    first, total, times, results = time_steps(step_fn, warmup, steps)
    per_step = total / steps
    tokens = seq * batch
    tok_s = tokens / per_step
    args = get_flavor(flavor, 163840 if flavor != "debug" else 0)
    fpt = flops_per_token(args, seq)
    result = {
        "variant": name, "seq": seq, "batch": batch, "ms_per_step": 1e3 * per_step, "host_median_ms": 1e3 * statistics.median(times),
        "tokens_per_s": tok_s, "mfu": tok_s * fpt / 989e12, "peak_gib": peak_gib(), "peak_reserved_gib": peak_reserved_gib(),
        "start_to_first_step_s": build_s + first, "steps_timed": steps, "step_host_ms": [round(1e3 * t, 1) for t in times],
        "losses": [round(_loss(r), 4) for r in results],
        "pid": os.getpid(),  # under --isolate, each variant's own process
    }
    if traced:
        from titan_k3.metrics.memory_peak import peak_report, stop_recording

        # NOTE: the trace costs host time on every allocation: this row's times are not the variant's speed.
        result["memory_traced"] = True
        result["memory_peak"] = f"profiles/memory-peak-{name}-{seq}.md"
        (out / "profiles").mkdir(exist_ok=True)
        (out / result["memory_peak"]).write_text(peak_report(
            torch.cuda.memory._snapshot(), baseline, f"{name}, B{batch} T{seq}, {warmup} warm-up and {steps} timed updates"))
        stop_recording()
    watch = getattr(holder, "compile_watch", None)
    if watch is not None:
        # NOTE: train_step alone never reports compile events; the benchmark asks once the steps have run.
        watch.check(warmup + steps)
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["graphs"] = counters["stats"]["unique_graphs"]
        from torch._dynamo.utils import compile_times

        # Where the first step's start-up goes (dynamo tracing, AOT autograd, inductor codegen), per phase.
        (out / "profiles").mkdir(exist_ok=True)
        (out / "profiles" / f"compile-times-{name}-{seq}.txt").write_text(str(compile_times(repr="str", aggregate=True)) + "\n")
    if torch.cuda.is_available():
        # Where the reserved memory sits after the timed steps (which graph pool, how much of it free): the
        # footprint to compare with CUDA graphs is the reserved one, and this splits it.
        result["reserved_by_pool"] = reserved_by_pool(torch.cuda.memory_snapshot())
        (out / "profiles").mkdir(exist_ok=True)
        (out / "profiles" / f"memory-{name}-{seq}.md").write_text(
            f"{name}, B{batch} T{seq}: reserved memory per pool after the timed steps\n\n"
            + pools_table(result["reserved_by_pool"]) + "\n")
    if profile:
        from torch.profiler import profile as prof

        from titan_k3.metrics.profile import profile_activities, profile_report

        sync()
        # NOTE: with input shapes: an eager variant's report then says which calls of an op cost (the compiled
        # step replays graphs, whose kernels have no launching op).
        with prof(activities=profile_activities(), record_shapes=True) as p:
            t0 = time.perf_counter()
            step_fn()
            sync()
            wall = time.perf_counter() - t0
        result["profile"] = f"profiles/profile-{name}-{seq}.txt"
        (out / "profiles").mkdir(exist_ok=True)
        (out / result["profile"]).write_text(profile_report(p, wall, f"{name}, seq {seq}, one step"))
    if hasattr(holder, "close"):
        holder.close()
    del holder, step_fn
    gc.collect()
    return result


def _peer_tokens_per_s(row: dict, rows: list[dict], peers: tuple[str, ...]) -> float | None:
    """The fastest tokens/s of the named peers at row's shape and round in this run (None: none of them ran)."""
    ref = [r["tokens_per_s"] for r in rows if r["variant"] in peers and _same_slot(r, row) and "tokens_per_s" in r]
    return max(ref) if ref else None


def _ratio(row: dict, rows: list[dict], peers: tuple[str, ...]) -> str:
    """row's tokens/s over the fastest named peer's at the same shape and round ("—" when none was run)."""
    ref = _peer_tokens_per_s(row, rows, peers)
    return f"{row['tokens_per_s'] / ref:.2f}x" if ref else "—"


def _same_slot(a: dict, b: dict) -> bool:
    return (a["seq"], a["batch"], a.get("round", 1)) == (b["seq"], b["batch"], b.get("round", 1))


def rounds_summary(rows: list[dict]) -> str:
    """Per variant and shape over the rounds: median, fastest and slowest ms per step, and the median of each round's
    ratio to the strong peer (each ratio from runs minutes apart, so drift of the machine between rounds cancels)."""
    lines = ["| variant | shape | rounds | median ms | fastest ms | slowest ms | median of per-round ratios vs strong peer |",
             "|---|---|---|---|---|---|---|"]
    slots = sorted({(r["variant"], r["seq"], r["batch"]) for r in rows}, key=lambda k: (k[1], k[2]))
    for variant, seq, batch in slots:
        done = [r for r in rows if (r["variant"], r["seq"], r["batch"]) == (variant, seq, batch) and "ms_per_step" in r]
        if not done:
            continue
        ms = sorted(r["ms_per_step"] for r in done)
        ratios = [r["tokens_per_s"] / ref for r in done if (ref := _peer_tokens_per_s(r, rows, STRONG_PEERS))]
        ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "—"
        lines.append(f"| {variant} | B{batch} T{seq} | {len(done)} | {statistics.median(ms):.1f} | {ms[0]:.1f} | {ms[-1]:.1f} "
                     f"| {ratio} |")
    return "\n".join(lines)


def _note(row: dict, rounds: int) -> str:
    parts = [f"round {row['round']} of {rounds}"] if rounds > 1 else []
    if "graphs" in row:
        parts.append(f"{row['graphs']} graphs, {row['graph_breaks']} graph breaks")
    if row.get("rows_launch"):
        parts.append(f"row kernel launch {row['rows_launch']}")
    if row.get("memory_traced"):
        parts.append(f"allocator traced (times not its speed): {row['memory_peak']}")
    stall = _stall(row)
    if stall:
        parts.append(stall)
    return "; ".join(parts)


STALL_FACTOR = 2.0  # a timed step whose host time passes this many medians is a stall worth naming


def _stall(row: dict) -> str:
    """A note naming the timed steps that stalled (a re-recorded CUDA graph, a recompile, a host hiccup), or ''.

    NOTE: ms/step is the timed window's total over its steps, as training pays it; one step that stalls moves it by
    its whole excess, so the row says so, with what the other steps took.
    """
    host = row.get("step_host_ms") or []
    if not host:
        return ""
    median = statistics.median(host)
    slow = [t for t in host if t > STALL_FACTOR * median]
    if not slow:
        return ""
    return (f"{len(slow)} of {len(host)} timed steps stalled ({', '.join(f'{t:.0f}' for t in slow)} ms host time against "
            f"a median of {median:.1f}): ms/step carries their excess")


def run_isolated(name: str, seq: int, batch: int, args, time_left_s: float, profile: str) -> dict:
    """One variant in a child process of this script (a crash, an out-of-memory or a hang loses that variant alone).

    The child is killed once `time_left_s` (what is left of --deadline-s) has passed: a hung variant must not
    take the rows of the others with it when the whole run has a wall-clock limit.
    """
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        row_json = Path(tmp) / "rows.json"
        cmd = [sys.executable, __file__, "--variants", name, "--flavor", args.flavor, "--seq", str(seq),
               "--batch", str(batch), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--profile", profile, "--memory-peak", args.memory_peak, "--out", str(args.out),
               *(["--rows-launch", args.rows_launch] if args.rows_launch else []), "--row-json", str(row_json)]
        try:
            done = subprocess.run(cmd, timeout=time_left_s, env={**os.environ, **VARIANT_ENV.get(name, {})})
        except subprocess.TimeoutExpired:
            return {"variant": name, "seq": seq, "batch": batch, "error": f"killed after {time_left_s:.0f} s: deadline"}
        if not row_json.is_file():
            return {"variant": name, "seq": seq, "batch": batch, "error": f"child process exited {done.returncode}"}
        return json.loads(row_json.read_text())[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="ours,peer")
    p.add_argument("--flavor", default="k3-mini", help="debug runs the script on CPU as a smoke test (no peer)")
    p.add_argument("--seq", type=int, nargs="+", default=[4096])
    p.add_argument("--batch", type=int, nargs="+", default=[8])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--deadline-s", type=float, default=1e9,
                   help="skip variants that start after this many seconds (with --isolate, also kill one still running)")
    p.add_argument("--profile", default="ours", help="variants to profile (one step, torch.profiler); 'all' profiles every one")
    p.add_argument("--memory-peak", default="none",
                   help="variants whose run records the allocator's trace and writes what is allocated at the peak "
                        "(profiles/memory-peak-VARIANT-SEQ.md; titan_k3/metrics/memory_peak.py); their times are not "
                        "their speed (the trace slows every allocation); 'all' for every one")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--isolate", action="store_true",
                   help="run each variant in a fresh process: none inherits another's memory, caches or host state")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the variant list this many times in turn (A B A B ...); each row's ratio is to the peer "
                        "of its own round, and a summary gives medians over the rounds")
    p.add_argument("--rows-launch", default="",
                   help="the fused loss's row-kernel launch for the variants named *-rows-launch, as "
                        "block,warps,programs_per_sm,reverse,prefetch,l2_hints (kernels/fused_ce/ce_rows.py RowsLaunch; "
                        "benchmarks/fused_ce.py --rows-launch prints its fastest in this form)")
    p.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)  # an --isolate child: its rows go here, no table
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env, t0, rows = environment(), time.perf_counter(), []
    if args.rounds < 1:
        raise SystemExit(f"--rounds {args.rounds}: must be >= 1")
    # NOTE: the rounds alternate the variants (A B A B), so a machine that drifts during the call moves them alike.
    runs = [(seq, batch, round_, name) for seq, batch in zip(args.seq, args.batch)
            for round_ in range(1, args.rounds + 1) for name in args.variants.split(",")]
    for seq, batch, round_, name in runs:
        if time.perf_counter() - t0 > args.deadline_s:
            row = {"variant": name, "seq": seq, "batch": batch, "error": "skipped: deadline"}
        elif not args.isolate and (unset := sorted(k for k, v in VARIANT_ENV.get(name, {}).items()
                                                   if os.environ.get(k) != v)):
            row = {"variant": name, "seq": seq, "batch": batch,
                   "error": f"needs --isolate: sets {', '.join(unset)} before CUDA starts"}
        elif args.isolate:
            row = run_isolated(name, seq, batch, args, args.deadline_s - (time.perf_counter() - t0),
                               args.profile if round_ == 1 else "none")  # one profile per variant and shape
        else:
            try:
                row = run_variant(name, args.flavor, seq, batch, args.warmup, args.steps, args.out,
                                  round_ == 1 and (args.profile == "all" or name in args.profile.split(",")),
                                  args.memory_peak == "all" or name in args.memory_peak.split(","), args.rows_launch)
            except Exception as e:  # one failing variant must not lose the others' numbers
                row = {"variant": name, "seq": seq, "batch": batch, "error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
        rows.append({**row, "round": round_})
        print(json.dumps(rows[-1]), flush=True)
    if args.row_json:
        args.row_json.write_text(json.dumps(rows))
        return 0
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | "
                         f"{r['variant']} | B{r['batch']} T{r['seq']} | — | — | — | — | — | — | — | — | {r['error'][:120]} |")
            continue
        strong, weak = _ratio(r, rows, STRONG_PEERS), _ratio(r, rows, EAGER_PEERS)
        losses = f"loss {r['losses'][0]:.2f} → {r['losses'][-1]:.2f}"
        lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {r['variant']} | "
                     f"B{r['batch']} T{r['seq']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
                     f"{r['peak_gib']:.1f} / {r.get('peak_reserved_gib', float('nan')):.1f} | {r['start_to_first_step_s']:.1f} | {strong} | {weak} | {losses} | {_note(r, args.rounds)} |")
    header = ("| date | commit | GPU | torch | triton | variant | shape | ms/step (timed steps back to back) | tokens/s | MFU (989) | "
              "peak GiB allocated / reserved | start→first step s | vs strong peer | vs eager peer | losses | note |\n|" + "---|" * 16)
    table = header + "\n" + "\n".join(lines) + f"\n\nHost: {env['host']}."
    if args.rounds > 1:
        table += "\n\n" + rounds_summary(rows)
    write_results(args.out, "train_throughput", table, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
