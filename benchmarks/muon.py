"""Per-Head Muon's step on every Muon matrix of k3-mini: GPU time, host time, and the fused passes vs PyTorch's.

    PYTHONPATH=. python benchmarks/muon.py --out OUTDIR [--flavor k3-mini --steps 10]

The optimizer the trainer builds (`build_optimizers` over the model's hints:
per-head and per-expert blocks, float32 parameters and momenta, bf16
Newton–Schulz on CUDA), fed random gradients. Per variant, after two warm-up
steps: GPU time per step (CUDA events around back-to-back steps) and host time
per step (the Python call alone: when it exceeds the GPU time the step is
launch-bound). Variants: "fused" (kernels.muon's passes, the default: one
launch per block shape for the momentum and for the update, and each
Newton–Schulz step's a I + b A + c A^2 as one Triton matmul), "torch passes"
(the same step with the PyTorch reference passes: one or more kernels per
parameter, cuBLAS's baddbmm for the polynomial) and, on CUDA, "fused + NS graphs" (`optimizer.ns_cuda_graphs`:
each block shape's Newton–Schulz replayed as a CUDA graph; its two warm-up
steps are the eager warm-up and the capture). `--ns-chunk N ...` adds "fused + NS graphs, chunks of N"
(`optimizer.ns_chunk`: each Newton–Schulz over N blocks at a time, so that a chunk's iterates stay in L2; on
CPU the chunked "fused" step). Appends a table to OUTDIR/muon.md. `--flavor debug` runs on CPU
(host time only) as a smoke test.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, sync, write_results  # noqa: E402
from kernels.muon import decay_add_multi_, nesterov_momentum_multi_, ns_polynomial  # noqa: E402
from titan_k3.models.k3.args import get_flavor  # noqa: E402
from titan_k3.models.k3.impl import reference_impl  # noqa: E402
from titan_k3.models.k3.model import K3Model  # noqa: E402
from titan_k3.optim import ParamSpec, build_optimizers  # noqa: E402
from titan_k3.optim import muon  # noqa: E402
from titan_k3.optim import orthogonalise as ns_module  # noqa: E402

# what "torch passes" swaps for PyTorch's, in the module that calls each
FUSED_PASSES = ((muon, nesterov_momentum_multi_), (muon, decay_add_multi_), (ns_module, ns_polynomial))


def muon_optimizer(flavor: str, device: torch.device):
    """(PerHeadMuon over the flavor's Muon matrices with random gradients, their element count)."""
    model = K3Model(get_flavor(flavor), reference_impl()).to(device)
    hints = model.optim_hints()
    muon_params = [(n, p) for n, p in model.named_parameters() if hints[n]["use_muon"]]
    gen = torch.Generator(device=device).manual_seed(0)
    for _, p in muon_params:
        p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    opts = build_optimizers(muon_params, lambda name, _p: ParamSpec(**hints[name]), lr=3e-3)
    return opts.muon, sum(p.numel() for _, p in muon_params)


def time_steps(opt, steps: int, on_gpu: bool) -> tuple[float, float]:
    """(GPU ms per step or nan, host ms per step), after two warm-up steps."""
    for _ in range(2):
        opt.step()
    sync()
    host = 0.0
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2)) if on_gpu else (None, None)
    if on_gpu:
        start.record()
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        host += time.perf_counter() - t
    if on_gpu:
        end.record()
    sync()
    gpu = start.elapsed_time(end) / steps if on_gpu else float("nan")
    return gpu, 1e3 * host / steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=0, help="unused (the benchmark scripts' common flags)")
    p.add_argument("--batch", type=int, default=0, help="unused (the benchmark scripts' common flags)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--ns-chunk", type=int, nargs="*", default=[],
                   help="also time the step with the Newton-Schulz over this many blocks at a time (optimizer.ns_chunk)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    opt, numel = muon_optimizer(args.flavor, device)
    env, rows = environment(), []
    graphs = device.type == "cuda"
    # (name, Newton-Schulz graphs, ns_chunk); the chunked variants on the fastest unchunked one
    variants = [("fused", False, 0), ("torch passes", False, 0)] + [("fused + NS graphs", True, 0)] * graphs
    variants += [(f"{'fused + NS graphs' if graphs else 'fused'}, chunks of {n}", graphs, n) for n in args.ns_chunk]
    for variant, with_graphs, chunk in variants:
        opt.ns_chunk = chunk
        if variant == "torch passes":
            for module, fn in FUSED_PASSES:
                setattr(module, fn.__name__, functools.partial(fn, triton_=False))
        opt.ns_graphs = muon.NewtonSchulzGraphs() if with_graphs else None
        try:
            gpu_ms, host_ms = time_steps(opt, args.steps, device.type == "cuda")
        finally:
            for module, fn in FUSED_PASSES:
                setattr(module, fn.__name__, fn)
            opt.ns_graphs, opt.ns_chunk = None, 0
        rows.append(dict(env, variant=variant, flavor=args.flavor, numel=numel, gpu_ms=gpu_ms, host_ms=host_ms))
        print(rows[-1], flush=True)
    lines = [f"\n### Per-Head Muon step, {args.flavor} ({numel / 1e6:.1f}M Muon parameters), {device.type}",
             "| date | commit | GPU | torch | triton | variant | GPU ms/step | host ms/step | bound by |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = "—" if math.isnan(r["gpu_ms"]) else "host" if r["host_ms"] > r["gpu_ms"] else "GPU"
        lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['triton']} | {r['variant']} | "
                     f"{r['gpu_ms']:.2f} | {r['host_ms']:.2f} | {bound} |")
    write_results(args.out, "muon", "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
