"""Start-up cost of `torch.compile` on the K3 model: the first forward + backward, by model depth.

    PYTHONPATH=. python benchmarks/compile_startup.py [--flavor debug --layers 4 8] [--device cpu] [--out OUTDIR]

Each depth runs in a fresh process with an empty inductor cache (a fresh
machine), compiles the model as training does (`apply_compile`, inductor) and
times its first forward + backward on a small batch. Reported: seconds, the
graphs dynamo compiled, and how many of them inductor had to build (AOT
autograd cache misses) versus reuse. The cost of a model whose compiled units
repeat should not grow with depth. Prints a table and appends it to
OUTDIR/compile_startup.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, write_results  # noqa: E402


def measure(flavor: str, layers: int, device: str, batch: int, seq: int) -> dict:
    """In this process: compile the model, time its first forward + backward; counters from dynamo."""
    import dataclasses
    import time

    import torch
    from torch._dynamo.utils import counters

    from titan_k3.config import load_job_config
    from titan_k3.models.k3.args import get_flavor
    from titan_k3.models.k3.impl import resolve_impl
    from titan_k3.models.k3.model import K3Model
    from titan_k3.parallel.parallelize import apply_compile

    dev = torch.device(device)
    args = dataclasses.replace(get_flavor(flavor, 512), n_layers=layers)
    model = K3Model(args, resolve_impl(load_job_config([]).kernels, dev)).to(dev)
    model.init_weights(seed=0)
    apply_compile(model, "inductor")
    ids = torch.randint(0, 512, (batch, seq), device=dev)
    t0 = time.perf_counter()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        loss = model(ids, ids).loss_sum
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    aot = counters["aot_autograd"]
    return {"layers": layers, "first_step_s": time.perf_counter() - t0, "graphs": counters["stats"]["unique_graphs"],
            "built": aot["autograd_cache_miss"], "reused": aot["autograd_cache_hit"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    p.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one depth in this process
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.flavor, args.one, args.device, args.batch, args.seq)))
        return 0
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    env, rows = environment(), []
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as cache:
            cmd = [sys.executable, __file__, "--flavor", args.flavor, "--device", device, "--batch", str(args.batch),
                   "--seq", str(args.seq), "--one", str(layers)]
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                 env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": cache})
        if run.returncode != 0:
            rows.append({"layers": layers, "error": (run.stderr.strip().splitlines() or ["?"])[-1][:200]})
        else:
            rows.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    header = ("| date | commit | device | torch | flavor | layers | batch | first fwd+bwd s (empty cache) | graphs | "
              "built by inductor | reused |\n|" + "---|" * 11)
    lines = []
    for r in rows:
        lead = f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {args.flavor} |"
        if "error" in r:
            lines.append(f"{lead} {r['layers']} | B{args.batch} T{args.seq} | failed: {r['error']} | — | — | — |")
        else:
            lines.append(f"{lead} {r['layers']} | B{args.batch} T{args.seq} | {r['first_step_s']:.1f} | {r['graphs']} | "
                         f"{r['built']} | {r['reused']} |")
    write_results(args.out, "compile_startup", header + "\n" + "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
