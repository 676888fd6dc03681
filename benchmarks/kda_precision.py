"""KDA gradients against the float64 recurrence, per path, dtype and shape: where the Triton kernels go wrong.

    PYTHONPATH=. python benchmarks/kda_precision.py [--out OUTDIR] [--launch "dchunk.num_stages=1;..."]

Each case runs the safe gate (random raw gate, lower bound -5, the A_log / dt_bias initialisation of docs/k3.md §2.1)
forward and backward through `kernels.kda.chunk_kda` under one launch path ("exact": the default unfused
backward; "bounded-fused": bounded products, fused backward) and through `recurrent_kda` in float64, and
reports the relative RMS error of the output and of every gradient. `--launch` overrides ops.LAUNCH entries
(e.g. "dchunk.BK=32") to check a launch setting's precision before it is timed.
A correctness tool, not a timing: appends a table to OUTDIR/kda_precision.md. Without a GPU, `--smoke`
runs one small float32 case on Triton's CPU interpreter (a check of the script, not of the GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, rel_rms, write_results  # noqa: E402
from benchmarks.kda import launch_settings, parse_candidate  # noqa: E402
from kernels.kda import chunk_kda, l2norm, ops, recurrent_kda  # noqa: E402

PATHS = {"exact": dict(diag_dot=0, fuse_bwd=0), "bounded-fused": dict(diag_dot=1, fuse_bwd=1)}
NAMES = ("o", "q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")
# (path, B, T, H, K, dtype): the session-7 failure and the neighbours that isolate it.
CASES = [
    ("exact", 2, 300, 2, 128, torch.float32), ("bounded-fused", 2, 300, 2, 128, torch.float32),
    ("exact", 2, 300, 2, 128, torch.bfloat16), ("exact", 2, 300, 2, 64, torch.float32),
    ("exact", 1, 16, 1, 128, torch.float32), ("exact", 2, 300, 8, 128, torch.float32),
]
SMOKE = [("exact", 1, 20, 1, 16, torch.float32)]


def grads_of(fn, leaves_in: list[torch.Tensor], do: torch.Tensor, dS: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves_in]
    q, k, v, g, beta, h0, A_log, dt_bias = leaves
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias,
              gate_lower_bound=-5.0)
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    return [o.detach()] + [x.grad for x in leaves]


def case(path: str, B: int, T: int, H: int, K: int, dtype: torch.dtype, device: str, seed: int = 10) -> list[float]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = dict(device=device, dtype=torch.float64)
    q = torch.randn(B, T, H, K, generator=gen, **dev)
    k = l2norm(torch.randn(B, T, H, K, generator=gen, **dev))
    v = torch.randn(B, T, H, K, generator=gen, **dev)
    g = torch.randn(B, T, H, K, generator=gen, **dev) * 3  # the raw gate
    beta = torch.rand(B, T, H, generator=gen, **dev)
    h0 = torch.randn(B, H, K, K, generator=gen, **dev) * 0.1
    A_log = torch.randn(H, generator=gen, **dev) * 0.3
    dt = torch.exp(torch.empty(H, K, **dev).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    do = torch.randn(B, T, H, K, generator=gen, **dev)
    dS = torch.randn(h0.shape, generator=gen, **dev)
    want = grads_of(recurrent_kda, [q, k, v, g, beta, h0, A_log, dt_bias], do, dS)
    with launch_settings({"safe": PATHS[path]}):
        low = [x.to(dtype) for x in (q, k, v, g, beta)] + [h0.float(), A_log.float(), dt_bias.float()]
        got = grads_of(chunk_kda, low, do, dS)
    return [rel_rms(a, b) for a, b in zip(got, want)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--launch", default="", help='ops.LAUNCH overrides, "kernel.setting=value;..."')
    p.add_argument("--smoke", action="store_true", help="one small float32 case (runs on CPU too)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("kda_precision: needs CUDA (the defect it measures is a GPU one); --smoke checks the script on CPU")
        return 2
    env, rows = environment(), []
    with launch_settings(parse_candidate(args.launch)):
        for path, B, T, H, K, dtype in SMOKE if args.smoke else CASES:
            errs = case(path, B, T, H, K, dtype, device)
            rows.append(dict(env, path=path, shape=f"B{B} T{T} H{H} K=V={K}", dtype=str(dtype).split(".")[-1],
                             launch=args.launch or "default", **dict(zip(NAMES, errs))))
            print(rows[-1], flush=True)
    lines = ["\n### KDA gradients vs the float64 recurrence (relative RMS error)",
             "| date | commit | GPU | torch | triton | launch | path | shape | dtype | " + " | ".join(NAMES) + " |",
             "|" + "---|" * (9 + len(NAMES))]
    for r in rows:
        lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['triton']} | {r['launch']} | "
                     f"{r['path']} | {r['shape']} | {r['dtype']} | " + " | ".join(f"{r[n]:.1e}" for n in NAMES) + " |")
    write_results(args.out, "kda_precision", "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
