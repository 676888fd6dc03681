"""Benchmark: Quantile Balancing's two histograms of one MoE layer, today's index_add vs the privatised Triton kernels.

At the flavor's router shape (k3-mini: T 32768 tokens, E 176 experts, k 6; QB_BINS 1024 bins), on realistic
inputs (s = sigmoid of normal scores, a small normal bias, alpha = the (k+1)-th largest of s + bias, ids = the
k largest), each op as the trainer would call it, under torch.compile:
  today       the reference (the formulas of titan_k3.models.k3.moe): the margins and their histogram, as float64
              [E, NB]; the expert counts, int64 [E]; each an index_add of ones (one global int32 atomic per element)
  triton      kernels.router.expert_margin_histogram (then float64) and expert_counts: each program counts
              privately and adds once; the margins also at the other launch settings of SWEEP
  R replicas  the reference adding into R copies of the histogram (copy t % R of token t), summed after; R 4, 16
Each variant's counts are checked against the eager reference before it is timed: the Triton kernels' must be
equal; compiled ones may differ where inductor's approximate float32 division (Triton's `/`) moves a margin
across a bin edge, and the table counts the bins that differ. Times: triton.testing.do_bench, median.

    PYTHONPATH=. python benchmarks/qb_histogram.py [--flavor k3-mini --tokens 32768] [--out OUTDIR]
    python benchmarks/qb_histogram.py --smoke --out OUTDIR   # CPU: a tiny shape on Triton's interpreter, no times

Prints a table last and appends it to OUTDIR/qb_histogram.md (OUTDIR/qb_histogram.json: the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv or not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import environment, median_ms, write_results  # noqa: E402
from kernels.router import expert_counts, expert_counts_reference, expert_margin_histogram, histogram  # noqa: E402
from kernels.router import expert_margin_histogram_reference as margin_reference  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402
from titan_k3.models.k3.moe import QB_BINS  # noqa: E402

REPLICAS = (4, 16)
# Launch settings of the margins kernel timed after the default (kernels/router/histogram.py's LAUNCH): more
# tokens per program (fewer atomics), several experts per program (fewer sector reads), one program per expert.
SWEEP = [dict(group_e=1, tokens_per_program=8192, block_t=1024, num_warps=8),
         dict(group_e=1, tokens_per_program=2048, block_t=512, num_warps=4),
         dict(group_e=4, tokens_per_program=4096, block_t=1024, num_warps=4),
         dict(group_e=1, tokens_per_program=1 << 30, block_t=1024, num_warps=8)]


def router_inputs(n_tokens: int, n_experts: int, k: int, device: str):
    """s [T, E], bias [E], alpha [T] (a column of the top-(k+1) values), half_range (0-dim), ids [T, k]."""
    gen = torch.Generator(device=device).manual_seed(0)
    s = torch.sigmoid(torch.randn(n_tokens, n_experts, generator=gen, device=device))
    bias = 0.02 * torch.randn(n_experts, generator=gen, device=device)
    top = torch.topk(s + bias, k + 1, dim=-1)
    half_range = 1.0 + (bias.max() - bias.min()).float()
    return s, bias, top.values[:, k], half_range, top.indices[:, :k]


def margin_histogram_replicated(s_TE, bias_E, alpha_T, half_range, n_bins: int, replicas: int) -> torch.Tensor:
    """The reference's float64 [E, n_bins] margin histogram, counted into `replicas` copies (token t into copy
    t % replicas) and summed: each hot bin takes 1 / replicas of the atomics."""
    T, E = s_TE.shape
    margins_TE = s_TE + bias_E - alpha_T[:, None]
    lo, width = -half_range, 2 * half_range / n_bins
    bins_TE = ((margins_TE - lo) / width).floor().clamp_(0, n_bins - 1).long()
    copy_T1 = (torch.arange(T, device=s_TE.device) % replicas)[:, None]
    flat = (copy_T1 * (E * n_bins) + torch.arange(E, device=s_TE.device) * n_bins + bins_TE).flatten()
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(replicas * E * n_bins, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones)
    return counts.view(replicas, E, n_bins).sum(0).to(torch.float64)


def counts_replicated(ids_TK: torch.Tensor, n: int, replicas: int) -> torch.Tensor:
    """The reference's int64 [n] id counts, counted into `replicas` copies (token t into copy t % replicas)."""
    copy_T1 = (torch.arange(ids_TK.shape[0], device=ids_TK.device) % replicas)[:, None]
    flat = (copy_T1 * n + ids_TK).flatten()
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(replicas * n, dtype=torch.int32, device=flat.device).index_add_(0, flat, ones)
    return counts.view(replicas, n).sum(0).to(torch.int64)


@contextlib.contextmanager
def margins_launch(setting: dict):
    """The margins kernel at `setting` (histogram.LAUNCH["margins"]), restored after."""
    saved = histogram.LAUNCH["margins"]
    histogram.LAUNCH["margins"] = setting
    try:
        yield
    finally:
        histogram.LAUNCH["margins"] = saved


def launch_label(setting: dict) -> str:
    tokens = "all" if setting["tokens_per_program"] >= 1 << 30 else setting["tokens_per_program"]
    return (f"triton: {setting['group_e']} experts x {tokens} tokens a program, block {setting['block_t']}, "
            f"{setting['num_warps']} warps")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="k3-mini", help="its n_experts and top_k")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (k3-mini: B8 x T4096)")
    p.add_argument("--smoke", action="store_true", help="64 tokens of 8 experts on Triton's CPU interpreter, no times")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    if device == "cpu" and not args.smoke:
        print("qb_histogram: times GPU kernels and needs CUDA; --smoke checks the script on CPU", file=sys.stderr)
        return 2
    flavor = FLAVORS[args.flavor]
    T, E, k = (64, 8, 2) if args.smoke else (args.tokens, flavor.n_experts, flavor.top_k)
    NB = QB_BINS
    s, bias, alpha, half_range, ids = router_inputs(T, E, k, device)
    backend = "inductor" if device == "cuda" else "aot_eager"  # the CPU smoke checks the wiring, not inductor

    def compiled(fn):
        return torch.compile(fn, backend=backend, fullgraph=True)

    margins = {
        "today": compiled(lambda: margin_reference(s, bias, alpha, half_range, NB).to(torch.float64)),
        "triton": compiled(lambda: expert_margin_histogram(s, bias, alpha, half_range, NB).to(torch.float64)),
        **{f"{r} replicas": compiled(lambda r=r: margin_histogram_replicated(s, bias, alpha, half_range, NB, r))
           for r in REPLICAS},
    }
    counts = {
        "today": compiled(lambda: expert_counts_reference(ids, E)),
        "triton": compiled(lambda: expert_counts(ids, E)),
        **{f"{r} replicas": compiled(lambda r=r: counts_replicated(ids, E, r)) for r in REPLICAS},
    }
    truth = {"margins": margin_reference(s, bias, alpha, half_range, NB).to(torch.float64),
             "counts": expert_counts_reference(ids, E)}
    env, rows = environment(), []
    for op, variants in (("margins", margins), ("counts", counts)):
        for name, fn in variants.items():
            rows.append(measure(op, name, fn, truth[op], timed=not args.smoke))
        if op == "margins":
            for setting in SWEEP:
                with margins_launch(setting):
                    rows.append(measure(op, launch_label(setting), variants["triton"], truth[op], not args.smoke))
    for row in rows:
        today = next(r["ms"] for r in rows if r["op"] == row["op"] and r["variant"] == "today")
        row["vs_today"] = row["ms"] / today if row["ms"] is not None else None
    shape = f"T{T} E{E} k{k} NB{NB}"
    header = ("| date | commit | GPU | torch | triton | shape | op | variant | ms | ms / today's | bins off eager |\n|"
              + "---|" * 11)
    lines = [f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {shape} "
             f"| {r['op']} | {r['variant']} | {_num(r['ms'], '.4f')} | {_num(r['vs_today'], '.2f')} | {r['bins_off']} |"
             for r in rows]
    note = ("\n\nSmoke run on Triton's CPU interpreter: counts checked, nothing timed." if args.smoke else
            "\n\nmargins: the float64 [E, NB] histogram from s, bias and alpha; counts: int64 [E] of the ids [T, k]. "
            "bins off eager: bins whose count differs from the eager reference's (0 for the Triton kernels).")
    write_results(args.out, "qb_histogram", header + "\n" + "\n".join(lines) + note + "\n", env,
                  [{**r, "shape": shape} for r in rows])
    return 0


def measure(op: str, variant: str, fn, truth: torch.Tensor, timed: bool) -> dict:
    """fn()'s counts against the eager reference (the Triton kernels' must be equal), then its median ms."""
    got = fn()
    bins_off = int((got != truth).sum())
    print(f"{op} {variant}: {bins_off} bins off the eager reference", flush=True)
    if variant.startswith("triton"):
        assert bins_off == 0, (op, variant, bins_off)
    return {"op": op, "variant": variant, "bins_off": bins_off, "ms": median_ms(fn) if timed else None}


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


if __name__ == "__main__":
    raise SystemExit(main())
