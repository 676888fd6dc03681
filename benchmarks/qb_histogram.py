"""Benchmark: Quantile Balancing's two counts of one MoE layer, by how many copies their atomics spread over.

At the flavor's router shape (k3-mini: T 32768 tokens, E 176 experts, k 6; QB_BINS 1024 bins), on realistic
inputs (s = sigmoid of normal scores, a small normal bias, alpha = the (k+1)-th largest of s + bias, ids = the
k largest), each under torch.compile as the trainer runs it:
  margins     titan_k3.models.k3.moe.margin_histogram of the margins s + bias - alpha: float64 [E, NB]
  counts      titan_k3.models.k3.moe.count_ids of the chosen ids: int64 [E]
each with its int32 index_add of ones into R copies of the count (token t into copy t % R, summed after), for R in
REPLICAS; R = 1 is one global atomic per element on the count itself, which contends on the busy bins. Each
variant's counts are checked against the eager one-copy counts first: the copies change no integer (a compiled
margin histogram may differ from eager where inductor's approximate float32 division moves a margin across a
bin edge, the same for every R; the table counts those bins). Times: triton.testing.do_bench, median.

    PYTHONPATH=. python benchmarks/qb_histogram.py [--flavor k3-mini --tokens 32768] [--out OUTDIR]
    python benchmarks/qb_histogram.py --smoke --out OUTDIR   # CPU: a tiny shape, counts checked, no times

Prints a table last and appends it to OUTDIR/qb_histogram.md (OUTDIR/qb_histogram.json: the rows).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import environment, median_ms, write_results  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402
from titan_k3.models.k3.moe import COUNT_REPLICAS, QB_BINS, count_ids, margin_histogram  # noqa: E402

REPLICAS = (1, 4, 16, 64)


def router_inputs(n_tokens: int, n_experts: int, k: int, device: str):
    """s [T, E], bias [E], alpha [T] (a column of the top-(k+1) values), half_range (0-dim), ids [T, k]."""
    gen = torch.Generator(device=device).manual_seed(0)
    s = torch.sigmoid(torch.randn(n_tokens, n_experts, generator=gen, device=device))
    bias = 0.02 * torch.randn(n_experts, generator=gen, device=device)
    top = torch.topk(s + bias, k + 1, dim=-1)
    half_range = 1.0 + (bias.max() - bias.min()).float()
    return s, bias, top.values[:, k], half_range, top.indices[:, :k]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="k3-mini", help="its n_experts and top_k")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (k3-mini: B8 x T4096)")
    p.add_argument("--smoke", action="store_true", help="64 tokens of 8 experts on the CPU, no times")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("qb_histogram: times GPU work and needs CUDA; --smoke checks the script on CPU", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    flavor = FLAVORS[args.flavor]
    T, E, k = (64, 8, 2) if args.smoke else (args.tokens, flavor.n_experts, flavor.top_k)
    s, bias, alpha, half_range, ids = router_inputs(T, E, k, device)
    backend = "inductor" if device == "cuda" else "aot_eager"  # the CPU smoke checks the wiring, not inductor

    def compiled(fn):
        return torch.compile(fn, backend=backend, fullgraph=True)

    variants = {
        "margins": {r: compiled(lambda r=r: margin_histogram(s + bias - alpha[:, None], half_range, r))
                    for r in REPLICAS},
        "counts": {r: compiled(lambda r=r: count_ids(ids, E, r)) for r in REPLICAS},
    }
    truth = {"margins": margin_histogram(s + bias - alpha[:, None], half_range, 1), "counts": count_ids(ids, E, 1)}
    env, rows = environment(), []
    for op, by_replicas in variants.items():
        for replicas, fn in by_replicas.items():
            got = fn()
            bins_off = int((got != truth[op]).sum())
            print(f"{op}, {replicas} copies: {bins_off} bins off the eager one-copy counts", flush=True)
            rows.append({"op": op, "replicas": replicas, "bins_off": bins_off,
                         "ms": None if args.smoke else median_ms(fn)})
    for row in rows:
        one = next(r["ms"] for r in rows if r["op"] == row["op"] and r["replicas"] == 1)
        row["vs_one"] = row["ms"] / one if row["ms"] is not None else None
    shape = f"T{T} E{E} k{k} NB{QB_BINS}"
    header = ("| date | commit | GPU | torch | triton | shape | op | copies | ms | ms / one copy's | bins off eager |\n|"
              + "---|" * 11)
    lines = [f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {shape} "
             f"| {r['op']} | {r['replicas']}{' (trainer)' if r['replicas'] == COUNT_REPLICAS else ''} "
             f"| {_num(r['ms'], '.4f')} | {_num(r['vs_one'], '.2f')} | {r['bins_off']} |" for r in rows]
    note = ("\n\nSmoke run on the CPU: counts checked, nothing timed." if args.smoke else
            "\n\nmargins: the float64 [E, NB] histogram of s + bias - alpha; counts: int64 [E] of the ids [T, k]. "
            "bins off eager: bins whose compiled count differs from eager's one-copy count.")
    write_results(args.out, "qb_histogram", header + "\n" + "\n".join(lines) + note + "\n", env,
                  [{**r, "shape": shape} for r in rows])
    return 0


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


if __name__ == "__main__":
    raise SystemExit(main())
