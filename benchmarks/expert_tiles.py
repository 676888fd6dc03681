"""Benchmark: every launch setting of the routed experts' Triton kernels at one shape, against the one the trainer uses.

The experts' six GEMM uses and one pointwise pass per MoE layer (kernels/grouped_gemm), each with its own inputs at
the shape (k3-mini: T 32768 tokens, top-6 of E 176 experts, L 256, F 544, bf16, random routing):
  glu_up       h, g, u = SiTU-GLU(x[token] @ w1, x[token] @ w3)         glu_up_kernel           (forward)
  w2           h @ w2                                                  grouped_mm_kernel       (forward)
  dh           dy[token] @ w2^T                                        grouped_mm_kernel       (backward)
  dx           dg @ w1^T + du @ w3^T                                   grouped_mm_dual_kernel  (backward)
  dw2          hp^T @ dy[token]                                        grouped_wgrad_kernel    (backward)
  dw1_dw3      x[token]^T @ dg, x[token]^T @ du                        grouped_wgrad_dual_kernel (backward)
  glu_bwd      the SiTU-GLU backward and the routing weights' gradient glu_bwd_pointwise_kernel (backward)
Each candidate setting runs through the trainer's own launcher (kernels/grouped_gemm/ops.py) with the kernel pinned
to that setting; its outputs are checked against the trainer's setting (relative RMS) before it is timed
(triton.testing.do_bench, median), twice: the kernel alone, and the whole layer (`moe_experts` forward and
backward, float32 master weights as the trainer passes them) with that kernel pinned (in every use of it: w2
and dh share one kernel). The trainer's setting is what
the autotune (and kernels/grouped_gemm/tuned.py) picks today; the table gives each candidate's times against it.
NOTE: do_bench flushes L2 before each run: alone, a kernel reads cold inputs that in the layer the kernel before it
has just written. Settings that ranked faster alone (2026-12-03) made the k3-mini step 1.1 ms slower; the layer
column is the one to rank by, and a setting goes into kernels/grouped_gemm/tuned.py only after
`benchmarks/ab_commits.py` confirms it in the training step.

    PYTHONPATH=. python benchmarks/expert_tiles.py [--uses glu_up,w2] [--out OUTDIR]
    python benchmarks/expert_tiles.py --smoke --out OUTDIR   # CPU interpreter: a tiny shape, outputs checked, no times
    ncu -k regex:"glu_up|_grouped_mm|_grouped_wgrad|glu_bwd" python benchmarks/expert_tiles.py --run-once   # profile each use

Prints a table last and appends it to OUTDIR/expert_tiles.md (OUTDIR/expert_tiles.json: the rows).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402

from benchmarks.common import environment, rel_rms, write_results  # noqa: E402
from kernels.grouped_gemm.triton_gemm import _cfg  # noqa: E402

SHAPES = {"k3-mini": (32768, 6, 176, 256, 544), "smoke": (48, 2, 4, 32, 48)}  # T, k, E, L, F


def _wg(k, n, r, warps, stages):
    return _cfg(k, n, r, warps, stages, ("BLOCK_K", "BLOCK_N", "BLOCK_R"))


# Candidates beyond the autotune's own lists (kernels/grouped_gemm/triton_gemm.py), which are always included:
# deeper pipelines, a whole-K step where L = 256, narrower and wider tiles.
EXTRA = {
    "mm": [_cfg(128, 128, 64, 8, 4), _cfg(128, 128, 32, 4, 4), _cfg(64, 64, 64, 4, 4), _cfg(128, 64, 32, 4, 5),
           _cfg(64, 128, 32, 4, 5), _cfg(128, 128, 128, 8, 3), _cfg(64, 256, 64, 8, 3), _cfg(256, 128, 64, 8, 3),
           _cfg(128, 256, 32, 8, 4), _cfg(64, 128, 128, 4, 3), _cfg(128, 128, 64, 4, 3)],
    "dual": [_cfg(64, 64, 64, 4, 4), _cfg(64, 64, 128, 4, 3), _cfg(64, 64, 32, 4, 5), _cfg(128, 64, 64, 8, 4),
             _cfg(128, 64, 128, 8, 3), _cfg(64, 128, 64, 4, 3), _cfg(64, 32, 64, 4, 4), _cfg(128, 32, 64, 4, 4),
             _cfg(128, 64, 32, 8, 5), _cfg(64, 64, 256, 4, 2), _cfg(128, 64, 64, 4, 3)],
    "wgrad": [_wg(128, 128, 32, 8, 4), _wg(128, 128, 128, 8, 3), _wg(64, 64, 64, 4, 4), _wg(128, 128, 64, 4, 4),
              _wg(256, 128, 64, 8, 3), _wg(64, 256, 64, 8, 3), _wg(128, 128, 64, 8, 4), _wg(64, 128, 128, 4, 3)],
    "wgrad_dual": [_wg(64, 64, 128, 4, 3), _wg(128, 64, 32, 8, 4), _wg(64, 64, 32, 4, 5), _wg(128, 128, 64, 8, 3),
                   _wg(64, 128, 32, 4, 4), _wg(128, 64, 128, 8, 3)],
}
GLU_BWD = [(s, f, w) for s in (16, 32, 64) for f in (32, 64, 128) for w in (4, 8)]  # rows, cols, warps

# use -> (kernel attribute in kernels.grouped_gemm.ops, the autotuner's candidate family, FLOPs per slot row / (L F))
USES = {
    "glu_up": ("glu_up_kernel", "dual", 4),
    "w2": ("grouped_mm_kernel", "mm", 2),
    "dh": ("grouped_mm_kernel", "mm", 2),
    "dx": ("grouped_mm_dual_kernel", "dual", 4),
    "dw2": ("grouped_wgrad_kernel", "wgrad", 2),
    "dw1_dw3": ("grouped_wgrad_dual_kernel", "wgrad_dual", 4),
    "glu_bwd": (None, None, 0),
}


class _Pinned:
    """Stands in for an autotuned kernel: launches its jitted body with one fixed setting."""

    def __init__(self, autotuned, config: triton.Config):
        self.fn = autotuned.fn
        self.kwargs = {k: v for k, v in config.all_kwargs().items() if v is not None}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn[grid](*args, **kwargs, **self.kwargs)


@contextmanager
def pinned(kernel_name: str | None, config):
    """The trainer's launchers with `kernel_name` pinned to `config` (None: as the trainer runs them)."""
    from kernels.grouped_gemm import ops, triton_moe

    if config is None:
        yield
        return
    if kernel_name is None:  # the pointwise pass: (rows, cols, warps)
        saved = dict(triton_moe.GLU_BWD_LAUNCH)
        triton_moe.GLU_BWD_LAUNCH.update(rows=config[0], cols=config[1], num_warps=config[2])
        try:
            yield
        finally:
            triton_moe.GLU_BWD_LAUNCH.update(saved)
        return
    original = getattr(ops, kernel_name)
    setattr(ops, kernel_name, _Pinned(original, config))
    try:
        yield
    finally:
        setattr(ops, kernel_name, original)


def make_inputs(shape, device: str, dtype: torch.dtype) -> dict:
    """Every tensor the seven uses read, at shape (T, k, E, L, F), with random routing."""
    from kernels.grouped_gemm import route_permutation

    n_tokens, top_k, n_experts, latent, hidden = shape
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=gen, device=device) * scale).to(dtype)

    scores = torch.rand(n_tokens, n_experts, generator=gen, device=device)
    top, idx = scores.topk(top_k, dim=1)
    order, offsets = route_permutation(idx, n_experts)
    n_slots = n_tokens * top_k
    weight_TK = (top / top.sum(1, keepdim=True)).to(dtype)
    # float32 masters (what the trainer passes the layer), and their casts for the single kernels
    masters = dict(w1m=torch.randn(n_experts, latent, hidden, generator=gen, device=device) * latent**-0.5,
                   w3m=torch.randn(n_experts, latent, hidden, generator=gen, device=device) * 8 * latent**-0.5,
                   w2m=torch.randn(n_experts, hidden, latent, generator=gen, device=device) * hidden**-0.5)
    x = rand(n_tokens, latent)
    return dict(
        idx=idx, weight_TK=weight_TK.requires_grad_(), x=x, x_leaf=x.clone().requires_grad_(), dy=rand(n_tokens, latent),
        **{name: w.to(dtype) for name, w in zip(("w1", "w3", "w2"), masters.values())},
        **{name: w.requires_grad_() for name, w in masters.items()},
        h=rand(n_slots, hidden), g=rand(n_slots, hidden), u=rand(n_slots, hidden, scale=8.0),
        dg=rand(n_slots, hidden), du=rand(n_slots, hidden),
        weight=weight_TK.detach().reshape(-1), order=order, token=(order // top_k).to(torch.int32),
        offsets=offsets,
    )


def run_use(use: str, t: dict) -> list[torch.Tensor]:
    """One use through the trainer's launcher: its outputs (fresh tensors each call)."""
    from kernels.grouped_gemm import ops

    n_slots, hidden = t["h"].shape
    latent = t["x"].shape[1]
    rows = dict(device=t["x"].device, dtype=t["x"].dtype)
    if use == "glu_up":
        h, g, u = (torch.empty(n_slots, hidden, **rows) for _ in range(3))
        ops._launch_glu_up(t["x"], t["w1"], t["w3"], t["offsets"], t["token"], h, g, u)
        return [h, g, u]
    if use == "w2":
        return [ops._launch_mm(t["h"], t["w2"], t["offsets"], torch.empty(n_slots, latent, **rows))]
    if use == "dh":
        return [ops._launch_mm(t["dy"], t["w2"].transpose(1, 2), t["offsets"], torch.empty(n_slots, hidden, **rows),
                               gather=t["token"])]
    if use == "dx":
        return [ops._launch_mm(t["dg"], t["w1"].transpose(1, 2), t["offsets"], torch.empty(n_slots, latent, **rows),
                               a2=t["du"], b2=t["w3"].transpose(1, 2))]
    if use == "dw2":
        dw2 = torch.empty(t["w2"].shape, device=rows["device"], dtype=torch.float32)
        ops._launch_wgrad(t["h"], t["dy"], t["offsets"], dw2, gather_b=t["token"])
        return [dw2]
    if use == "dw1_dw3":
        dw1, dw3 = (torch.empty(t["w1"].shape, device=rows["device"], dtype=torch.float32) for _ in range(2))
        ops._launch_wgrad(t["x"], t["dg"], t["offsets"], dw1, gather=t["token"], b2=t["du"], out2=dw3)
        return [dw1, dw3]
    assert use == "glu_bwd", use
    dg, du, hp = t["dg"].clone(), torch.empty_like(t["dg"]), torch.empty_like(t["dg"])
    dweight = torch.zeros(n_slots, device=rows["device"], dtype=torch.float32)
    ops._launch_glu_bwd_pointwise(dg, t["g"], t["u"], du, hp, t["weight"], t["order"], dweight, t["offsets"])
    return [dg, du, hp, dweight]


LEAVES = ("x_leaf", "w1m", "w3m", "w2m", "weight_TK")


def run_layer(t: dict) -> list[torch.Tensor]:
    """The whole routed-expert layer as the trainer runs it (forward and backward): y and the leaves' gradients."""
    from kernels.grouped_gemm import moe_experts

    for name in LEAVES:
        t[name].grad = None
    y = moe_experts(t["x_leaf"], t["w1m"], t["w3m"], t["w2m"], t["idx"], t["weight_TK"])
    y.backward(t["dy"])
    return [y.detach(), *(t[name].grad for name in LEAVES)]


def candidates(use: str) -> list:
    """[None (the trainer's setting)] + every setting to try for this use."""
    from kernels.grouped_gemm import triton_gemm

    kernel_name, family, _ = USES[use]
    if family is None:
        return [None, *GLU_BWD]
    own = {"mm": triton_gemm.mm_configs, "dual": triton_gemm.epilogue_configs,
           "wgrad": lambda: triton_gemm.wgrad_configs(dual=False),
           "wgrad_dual": lambda: triton_gemm.wgrad_configs(dual=True)}[family]()
    return [None, *own, *EXTRA[family]]


def describe(config) -> str:
    if config is None:
        return "trainer's"
    if isinstance(config, tuple):
        return f"rows {config[0]} cols {config[1]} w{config[2]}"
    # NOTE: each block named (M, N, K: the row GEMMs' tile; K, N, R: the weight gradients' [K, N] tile, R rows a step)
    tile = " ".join(f"{name.removeprefix('BLOCK_')}{value}" for name, value in config.kwargs.items())
    return f"{tile} w{config.num_warps} s{config.num_stages}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="k3-mini", choices=sorted(SHAPES))
    p.add_argument("--uses", default=",".join(USES), help="comma-separated: " + ", ".join(USES))
    p.add_argument("--smoke", action="store_true", help="the smoke shape, two settings a use, on the CPU (interpreter), no times")
    p.add_argument("--run-once", action="store_true",
                   help="run each named use twice at the trainer's setting and nothing else: no checks, no timing, no "
                        "results (the workload for an outside profiler, e.g. ncu)")
    p.add_argument("--deadline-s", type=float, default=1e9, help="stop trying settings after this long")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("expert_tiles: on the CPU the kernels need TRITON_INTERPRET=1 set before triton is imported")
    shape = SHAPES["smoke" if args.smoke else args.shape]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 is broken
    t = make_inputs(shape, device, dtype)
    if args.run_once:
        for use in args.uses.split(","):
            for _ in range(2):
                run_use(use, t)
        if device == "cuda":
            torch.cuda.synchronize()
        return 0
    n_slots, latent, hidden = shape[0] * shape[1], shape[3], shape[4]
    env, rows, t0 = environment(), [], time.perf_counter()
    want_layer = [o.float() for o in run_layer(t)]
    for use in args.uses.split(","):
        kernel_name, _, flop_factor = USES[use]
        settings = candidates(use)
        if args.smoke:  # the trainer's and the smallest of the others (the interpreter's own list is the first)
            others = settings[1:] if USES[use][1] is None else settings[2:]
            settings = [None, min(others, key=lambda c: c if isinstance(c, tuple) else tuple(c.kwargs.values()))]
        want = [o.float() for o in run_use(use, t)]
        base_ms = base_layer_ms = None
        for config in settings:
            if time.perf_counter() - t0 > args.deadline_s:
                break
            row = dict(use=use, setting=describe(config))
            try:
                with pinned(kernel_name, config):
                    got = run_use(use, t)
                    row["rel_rms"] = max(rel_rms(g.float(), w) for g, w in zip(got, want))
                    row["layer_rel_rms"] = max(rel_rms(g.float(), w) for g, w in zip(run_layer(t), want_layer))
                    if max(row["rel_rms"], row["layer_rel_rms"]) > 1e-2:
                        row["error"] = (f"outputs differ from the trainer's setting: rel RMS {row['rel_rms']:.1e} "
                                        f"(the kernel), {row['layer_rel_rms']:.1e} (the layer)")
                    elif device == "cuda":
                        row["ms"] = triton.testing.do_bench(lambda: run_use(use, t), return_mode="median")
                        row["layer_ms"] = triton.testing.do_bench(lambda: run_layer(t), return_mode="median")
            except Exception as e:  # a setting the compiler or the GPU refuses is a row, not the end of the run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            if "ms" in row:
                base_ms = base_ms or row["ms"]
                row["vs_trainer"] = base_ms / row["ms"]
                base_layer_ms = base_layer_ms or row["layer_ms"]
                row["layer_vs_trainer"] = base_layer_ms / row["layer_ms"]
                if flop_factor:
                    row["tflops"] = flop_factor * n_slots * latent * hidden / row["ms"] / 1e9
            rows.append(row)
            print(row, flush=True)
    header = (f"\n## {env['date']}, commit {env['commit']}, {env['gpu']}, torch {env['torch']}, triton {env['triton']}; "
              f"shape T {shape[0]} k {shape[1]} E {shape[2]} L {latent} F {hidden}, {str(dtype).split('.')[1]}\n\n"
              "| use | setting | ms alone | TFLOP/s alone | speed alone vs the trainer's setting (x) | layer fwd+bwd ms | "
              "layer speed vs the trainer's setting (x) | rel RMS vs the trainer's | note |\n"
              "|---|---|---|---|---|---|---|---|---|\n")

    def cell(r, key, fmt):
        return format(r[key], fmt) if key in r else "—"

    lines = [f"| {r['use']} | {r['setting']} | {cell(r, 'ms', '.4f')} | {cell(r, 'tflops', '.0f')} | "
             f"{cell(r, 'vs_trainer', '.2f')} | {cell(r, 'layer_ms', '.3f')} | {cell(r, 'layer_vs_trainer', '.3f')} | "
             f"{cell(r, 'rel_rms', '.1e')} | {r.get('error', '')} |" for r in rows]
    write_results(args.out, "expert_tiles", header + "\n".join(lines) + "\n", env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
