"""Newton-Schulz on k3-mini's Muon blocks: each step's polynomial as one Triton matmul against cuBLAS's baddbmm.

    PYTHONPATH=. python benchmarks/newton_schulz.py --out OUTDIR [--flavor k3-mini --chunk 0 512]

For every block shape of the flavor's Muon matrices (as Per-Head Muon batches them: one call per [r, c] with
all its blocks), `titan_k3.optim.muon.newton_schulz` in bf16 with 5 steps and the Muon update scale, per
polynomial path and chunk (`optimizer.ns_chunk`; 0 = every block at once):
- "triton": `kernels.muon.ns_polynomial` (B' = a I + b A + c A^2 and the first step's normalisation in one
  batched matmul's epilogue, upper tiles only), the default on CUDA;
- "cublas": the reference path (PyTorch's scaling passes around cuBLAS's `torch.baddbmm`; before this kernel the
  step ran the same baddbmm between two Triton scaling passes);
- error: relative RMS against the float64 iteration (`kernels.muon.reference.newton_schulz`) on 16 blocks
  whose singular values span 1 .. 1e-4;
- time: the call captured as a CUDA graph (as the trainer replays it), median of `triton.testing.do_bench`.
A second table times the single products at the largest shape (and the Triton polynomial's tile configs), to
say where the time goes. Appends to OUTDIR/newton_schulz.md. Without CUDA it checks the errors only.

--fused times `benchmarks/ns_one_kernel.py`'s `newton_schulz_blocks` (every step of a block in one persistent
kernel, the block's iterate and Gram matrices kept in L2) against ours in the same run, at every block shape it
takes, per tile and launch config, with its error against float64 (CUDA only: without it, one line says so).

--pad WIDTH... also times `padded_newton_schulz` (ours with each block's long side zero-padded to WIDTH from the
first product on, so that cuBLAS's tiles divide it) against ours in the same run at the two largest block shapes,
and the single products X X^T and B' X at long sides 512, 544, 576 and 640 in both layouts.

--gram also times Gram Newton-Schulz (`gram_newton_schulz`: the same polynomial iterated on the small Gram
matrix R = X X^T and the accumulated left factor Q, with X = Q X0 formed only at restarts and at the end) at the
flavor's two largest block shapes, against ours in the same run, with its error against float64.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, median_ms, rel_rms, write_results  # noqa: E402
from benchmarks.ns_one_kernel import MAX_M, newton_schulz_blocks  # noqa: E402
from kernels.muon import ns_polynomial  # noqa: E402
from kernels.muon.fused import _ns_poly_kernel  # noqa: E402
from kernels.muon.reference import newton_schulz as newton_schulz_f64  # noqa: E402
from titan_k3.models.k3.args import get_flavor  # noqa: E402
from titan_k3.models.k3.impl import reference_impl  # noqa: E402
from titan_k3.models.k3.model import K3Model  # noqa: E402
from titan_k3.optim import ParamSpec  # noqa: E402
from titan_k3.optim import orthogonalise as ns_module  # noqa: E402
from titan_k3.optim.orthogonalise import NS_COEFFS, blocks_of, muon_scale, newton_schulz  # noqa: E402

STEPS = 5


def block_shapes(flavor: str) -> dict[tuple[int, int], int]:
    """{(r, c): blocks} of the flavor's Muon parameters, as Per-Head Muon groups them (model on the meta device)."""
    with torch.device("meta"):
        model = K3Model(get_flavor(flavor), reference_impl())
    hints = model.optim_hints()
    shapes: dict[tuple[int, int], int] = {}
    for name, p in model.named_parameters():
        if hints[name]["use_muon"]:
            blocks = blocks_of(p, ParamSpec(**hints[name]))
            shapes[tuple(blocks.shape[-2:])] = shapes.get(tuple(blocks.shape[-2:]), 0) + blocks.shape[0]
    return dict(sorted(shapes.items(), key=lambda kv: -kv[1] * kv[0][0] * kv[0][1]))


PATHS = {"triton": functools.partial(ns_polynomial, triton_=None),
         "cublas": functools.partial(ns_polynomial, triton_=False)}


def ns_flop(k: int, r: int, c: int, steps: int = STEPS) -> float:
    """FLOP (2 per multiply-add) of `newton_schulz` on k blocks [r, c]: per step X X^T, A^2 and B' X."""
    m, n = min(r, c), max(r, c)
    return 2.0 * k * steps * (2 * m * m * n + m ** 3)


def decaying(k: int, r: int, c: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """k float64 matrices [r, c] with singular values log-spaced from 1 to 1e-4 (times 1e-3, a momentum's scale)."""
    gen = torch.Generator().manual_seed(seed)
    m = min(r, c)
    U, _ = torch.linalg.qr(torch.randn(k, r, m, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(k, c, m, dtype=torch.float64, generator=gen))
    s = torch.logspace(0, -4, m, dtype=torch.float64)
    return ((U * s) @ V.mT * 1e-3).to(device)


def graph_ms(fn) -> float:
    """Median ms of fn() replayed as a CUDA graph (after one eager warm-up)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


GRAM = {  # name: (restart before these steps, NS dtype)
    "gram bf16, restart at step 3": ((2,), torch.bfloat16),
    "gram bf16, restart at step 4": ((3,), torch.bfloat16),
    "gram bf16, no restart": ((), torch.bfloat16),
    "gram fp16, restart at step 3": ((2,), torch.float16),
}


def gram_newton_schulz(G: torch.Tensor, steps: int, restarts: tuple[int, ...], dtype: torch.dtype,
                       scale: float = 1.0, eps: float = 1e-7) -> torch.Tensor:
    """`newton_schulz`'s polynomial on G [k, r, c], iterated on R = X X^T [k, m, m] and Q (X_t = Q_t X_0):
    B'_t = a I + b R_t + c R_t^2, Q_{t+1} = B'_t Q_t, R_{t+1} = B'_t R_t B'_t; before each step in `restarts`,
    X = Q X and R = X X^T are formed again (half precision drifts otherwise). Equal to `newton_schulz` in exact
    arithmetic; measured here as an alternative, never used by the trainer."""
    transposed = G.shape[-2] > G.shape[-1]
    X = G.mT if transposed else G
    sumsq = None
    if dtype == torch.float16:  # float16's range: normalise before the cast, not on the first Gram matrix
        X = X.float() / (X.float().square().sum((-2, -1), keepdim=True).sqrt() + eps)
    X = X.to(dtype).contiguous()
    R = X @ X.mT
    if dtype != torch.float16:
        sumsq = R.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.float32)
    Q = None
    for t in range(steps):
        if t in restarts and Q is not None:
            X, Q = torch.bmm(Q, X), None
            R = X @ X.mT
        # NOTE: the CPU polynomial scales its input in place; R is read again below.
        B = ns_polynomial(R if R.is_cuda else R.clone(), NS_COEFFS, scale=scale if t == steps - 1 else 1.0,
                          sumsq=sumsq if t == 0 else None, eps=eps)
        Q = B if Q is None else torch.bmm(B, Q)
        if t < steps - 1 and t + 1 not in restarts:
            R = torch.bmm(B, torch.bmm(R, B))
    return torch.bmm(X.mT, Q) if transposed else torch.bmm(Q, X)


def padded_newton_schulz(G: torch.Tensor, steps: int, width: int, scale: float = 1.0, eps: float = 1e-7,
                         chunk: int = 0) -> torch.Tensor:
    """`newton_schulz` of G [k, r, c] (bf16) with the long side n = max(r, c) zero-padded to `width` from the first
    product on. Zero columns of X give the same X X^T and stay zero through B' X, so the math is ours; only the
    products' shapes change (n = 544 is 4.25 tiles of 128). The first step reads G as it is and writes B' G into
    the padded buffer's first n columns; the last writes the caller's orientation from the padded iterate's view.
    chunk > 0: `chunk` blocks at a time (as `optimizer.ns_chunk`)."""
    if 0 < chunk < G.shape[0]:
        return torch.cat([padded_newton_schulz(g, steps, width, scale, eps) for g in G.split(chunk)])
    transposed = G.shape[-2] > G.shape[-1]
    X3 = G.mT if transposed else G
    k, m, n = X3.shape
    P = torch.empty(k, m, width, dtype=G.dtype, device=G.device)
    P[..., n:].zero_()
    for step in range(steps):
        src = X3 if step == 0 else P
        A = src @ src.mT
        sumsq = (A.diagonal(dim1=-2, dim2=-1).sum(-1, dtype=torch.promote_types(A.dtype, torch.float32))
                 if step == 0 else None)
        B = ns_polynomial(A, NS_COEFFS, scale=scale if step == steps - 1 else 1.0, sumsq=sumsq, eps=eps)
        if step == 0:
            torch.bmm(B, X3, out=P[..., :n])
        elif step < steps - 1:
            P = torch.bmm(B, P)
    return torch.bmm(P[..., :n].mT, B) if transposed else torch.bmm(B, P[..., :n])


def padded_rows(shapes: dict, device: torch.device, env: dict, widths: list[int]) -> tuple[list[dict], list[str]]:
    """Ours and `padded_newton_schulz` per width at the two largest block shapes (error against float64, rel diff
    against ours, ms), and the single products at long sides 512-640 (table lines)."""
    rows, lines = [], []
    for (r, c), k in list(shapes.items())[:2]:
        s = muon_scale(r, c)
        G64 = decaying(min(k, 16), r, c, device)
        ref = newton_schulz_f64(G64, STEPS, dtype=torch.float64, scale=s)
        G = torch.randn(k, r, c, device=device, dtype=torch.bfloat16) * 1e-3
        ours = newton_schulz(G, STEPS, dtype=torch.bfloat16, scale=s)
        variants = {}
        for chunk in (0, 512):
            variants[f"ours, chunk {chunk}"] = functools.partial(newton_schulz, steps=STEPS, dtype=torch.bfloat16,
                                                                 scale=s, chunk=chunk)
            for w in widths:
                if w >= max(r, c):
                    variants[f"padded to {w}, chunk {chunk}"] = functools.partial(
                        padded_newton_schulz, steps=STEPS, width=w, scale=s, chunk=chunk)
        for name, fn in variants.items():
            err = rel_rms(fn(G64.bfloat16()), ref)
            diff = rel_rms(fn(G), ours.double())
            ms = graph_ms(lambda fn=fn: fn(G)) if device.type == "cuda" else float("nan")
            rows.append(dict(env, shape=f"{k}x{r}x{c}", variant=name, rel_err=err, vs_ours=diff, ms=ms))
            print(rows[-1], flush=True)
    if device.type != "cuda":
        return rows, lines
    (r, c), k = next(iter(shapes.items()))
    m = min(r, c)
    lines += ["", f"Single products at {k} blocks, m = {m}, by long side n (cuBLAS bmm; row-major X [k, m, n], "
              "or its transpose as Per-Head Muon sees the tall blocks):", "| product | n | ms | TFLOP/s |",
              "|---|---|---|---|"]
    for n in (512, 544, 576, 640):
        X = torch.randn(k, m, n, device=device, dtype=torch.bfloat16)
        XT = torch.randn(k, n, m, device=device, dtype=torch.bfloat16).mT
        B = torch.randn(k, m, m, device=device, dtype=torch.bfloat16)
        flop = 2.0 * k * m * m * n
        P = torch.zeros(k, m, 640, device=device, dtype=torch.bfloat16)
        cases = [("X X^T", lambda: X @ X.mT), ("X X^T, X transposed", lambda: XT @ XT.mT),
                 ("B' X", lambda: torch.bmm(B, X)), ("B' X, X transposed", lambda: torch.bmm(B, XT)),
                 ("B' X into a 640-wide buffer's view (out=)", lambda: torch.bmm(B, X, out=P[..., :n])),
                 ("B' X from a 640-wide buffer's view", lambda: torch.bmm(B, P[..., :n]))]
        for name, fn in cases:
            ms = median_ms(fn)
            lines.append(f"| {name} | {n} | {ms:.3f} | {flop / ms / 1e9:.0f} |")
    return rows, lines


def gram_rows(shapes: dict, device: torch.device, env: dict) -> list[dict]:
    """Ours and each GRAM variant at the two largest block shapes: error against float64, ms (CUDA only)."""
    rows = []
    for (r, c), k in list(shapes.items())[:2]:
        G64 = decaying(min(k, 16), r, c, device)
        ref = newton_schulz_f64(G64, STEPS, dtype=torch.float64, scale=muon_scale(r, c))
        G = torch.randn(k, r, c, device=device, dtype=torch.bfloat16) * 1e-3
        variants = {"ours (standard, bf16)": lambda g: newton_schulz(g, STEPS, dtype=torch.bfloat16,
                                                                      scale=muon_scale(r, c))}
        for name, (restarts, dtype) in GRAM.items():
            variants[name] = functools.partial(gram_newton_schulz, steps=STEPS, restarts=restarts, dtype=dtype,
                                               scale=muon_scale(r, c))
        for name, fn in variants.items():
            err = rel_rms(fn(G64.float()), ref)
            ms = graph_ms(lambda fn=fn: fn(G)) if device.type == "cuda" else float("nan")
            rows.append(dict(env, shape=f"{k}x{r}x{c}", variant=name, rel_err=err, ms=ms))
            print(rows[-1], flush=True)
    return rows


FUSED_CONFIGS = {  # name: (programs per SM, config)
    "2/SM, N64 K64 w8 s2": (2, dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=2)),
    "1/SM, N64 K64 w8 s3": (1, dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=3)),
    "2/SM, N32 K64 w8 s2": (2, dict(BLOCK_N=32, BLOCK_K=64, num_warps=8, num_stages=2)),
    "2/SM, N64 K32 w8 s3": (2, dict(BLOCK_N=64, BLOCK_K=32, num_warps=8, num_stages=3)),
    "3/SM, N64 K64 w4 s2": (3, dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=2)),
    "2/SM, N128 K64 w8 s2": (2, dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=2)),
    "1/SM, N128 K64 w16 s3": (1, dict(BLOCK_N=128, BLOCK_K=64, num_warps=16, num_stages=3)),
    "1/SM, N128 K64 w8 s3": (1, dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    "1/SM, N64 K64 w16 s3": (1, dict(BLOCK_N=64, BLOCK_K=64, num_warps=16, num_stages=3)),
}


def fused_rows(shapes: dict, device: torch.device, env: dict, configs: list[str], largest: int) -> list[dict]:
    """Ours and `newton_schulz_blocks` per config at each of the `largest` block shapes that it takes: error
    against float64, ms."""
    rows = []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for (r, c), k in list(shapes.items())[:largest]:
        if min(r, c) > MAX_M:
            continue
        s = muon_scale(r, c)
        G64 = decaying(min(k, 16), r, c, device)
        ref = newton_schulz_f64(G64, STEPS, dtype=torch.float64, scale=s)
        G = torch.randn(k, r, c, device=device, dtype=torch.bfloat16) * 1e-3
        ours = newton_schulz(G, STEPS, dtype=torch.bfloat16, scale=s)
        variants = {"ours (step by step)": lambda g: newton_schulz(g, STEPS, dtype=torch.bfloat16, scale=s)}
        for name in configs:
            per_sm, cfg = FUSED_CONFIGS[name]
            variants[f"fused {name}"] = functools.partial(newton_schulz_blocks, steps=STEPS, coeffs=NS_COEFFS, scale=s,
                                                          programs=per_sm * sms, config=cfg)
        for name, fn in variants.items():
            try:
                err = rel_rms(fn(G64.bfloat16()), ref)
                diff = rel_rms(fn(G), ours.double())
                ms = graph_ms(lambda fn=fn: fn(G))
            except Exception as e:  # a config that does not compile is a row, not the end of the run
                rows.append(dict(env, shape=f"{k}x{r}x{c}", variant=name, rel_err=float("nan"), vs_ours=float("nan"),
                                 ms=float("nan"), note=f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
                print(rows[-1], flush=True)
                continue
            flop = ns_flop(k, r, c)
            rows.append(dict(env, shape=f"{k}x{r}x{c}", variant=name, rel_err=err, vs_ours=diff, ms=ms,
                             tflops=flop / ms / 1e9, note=""))
            print(rows[-1], flush=True)
    return rows


def product_times(k: int, m: int, n: int, device: torch.device) -> list[tuple[str, float, float]]:
    """(product, ms, FLOP) of each single product of a step at k blocks [m, n] (m <= n), and of the Triton
    polynomial per tile config (block, BLOCK_K, warps, stages)."""
    X = torch.randn(k, m, n, device=device, dtype=torch.bfloat16)
    A = X @ X.mT / n
    a, b, c = NS_COEFFS
    sq, rect = 2.0 * k * m ** 3, 2.0 * k * m * m * n
    cases = [
        ("X X^T (cuBLAS bmm)", lambda: X @ X.mT, rect),
        ("A^2 (cuBLAS bmm, no epilogue)", lambda: torch.bmm(A, A), sq),
        ("a I + b A + c A^2 (cuBLAS baddbmm, diagonal add)", lambda: PATHS["cublas"](A, NS_COEFFS), sq),
        ("a I + b A + c A^2 (Triton ns_polynomial)", lambda: PATHS["triton"](A, NS_COEFFS), sq),
        ("B' X (cuBLAS bmm)", lambda: torch.bmm(A, X), rect),
    ]
    out = torch.empty_like(A)
    for block, block_k, warps, stages in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 8, 4), (128, 128, 8, 2),
                                          (64, 64, 4, 3), (64, 64, 4, 4)):
        n_tiles = -(-m // block)

        def launch(block=block, block_k=block_k, warps=warps, stages=stages, n_tiles=n_tiles):
            _ns_poly_kernel[(n_tiles * (n_tiles + 1) // 2, k)](
                A, out, A, 0, m, n_tiles, a, b, c, 1.0, 1e-7, HAS_SUMSQ=False, IEEE=False, BLOCK_M=block,
                BLOCK_K=block_k, num_warps=warps, num_stages=stages)

        cases.append((f"Triton polynomial, tile {block} BLOCK_K {block_k} warps {warps} stages {stages}", launch, sq))
    return [(name, median_ms(fn), flop) for name, fn, flop in cases]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--chunk", type=int, nargs="+", default=[0, 512], help="optimizer.ns_chunk values to time")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--seq", type=int, default=0, help="unused (the benchmark scripts' common flags)")
    p.add_argument("--batch", type=int, default=0, help="unused (the benchmark scripts' common flags)")
    p.add_argument("--gram", action="store_true", help="also time Gram Newton-Schulz against ours")
    p.add_argument("--fused", nargs="*", default=None, choices=sorted(FUSED_CONFIGS), metavar="CONFIG",
                   help="also time the one-kernel iteration (newton_schulz_blocks) against ours; no names: all configs")
    p.add_argument("--fused-shapes", type=int, default=1000, help="with --fused: only the N largest block shapes")
    p.add_argument("--pad", type=int, nargs="+", default=None, metavar="WIDTH",
                   help="also time padded_newton_schulz (long side zero-padded to WIDTH) against ours")
    p.add_argument("--fused-only", action="store_true", help="skip the polynomial-path tables (with --fused or --pad)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    env, rows = environment(), []
    shapes = block_shapes(args.flavor)
    for (r, c), k in ({} if args.fused_only else shapes).items():
        G64 = decaying(min(k, 16), r, c, device)
        ref = newton_schulz_f64(G64, STEPS, dtype=torch.float64, scale=muon_scale(r, c))
        G = torch.randn(k, r, c, device=device, dtype=torch.bfloat16) * 1e-3
        for path, poly in PATHS.items():
            ns_module.ns_polynomial = poly
            try:
                err = rel_rms(newton_schulz(G64.bfloat16(), STEPS, dtype=torch.bfloat16, scale=muon_scale(r, c)), ref)
                for chunk in args.chunk if cuda else [0]:
                    ms = graph_ms(lambda: newton_schulz(G, STEPS, dtype=torch.bfloat16, scale=muon_scale(r, c),
                                                        chunk=chunk)) if cuda else float("nan")
                    flop = ns_flop(k, r, c)
                    rows.append(dict(env, shape=f"{k}x{r}x{c}", path=path, chunk=chunk, rel_err=err, ms=ms,
                                     gflop=flop / 1e9, tflops=flop / ms / 1e9 if cuda else float("nan")))
                    print(rows[-1], flush=True)
            finally:
                ns_module.ns_polynomial = ns_polynomial
    lines = [f"\n### Newton-Schulz, {args.flavor}'s Muon blocks, 5 steps, bf16 ({device.type}; CUDA-graph replays)",
             "| date | commit | GPU | torch | triton | blocks | polynomial | chunk | rel err vs float64 | ms | GFLOP | "
             "TFLOP/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['triton']} | {r['shape']} | "
                     f"{r['path']} | {r['chunk']} | {r['rel_err']:.2e} | {r['ms']:.3f} | {r['gflop']:.0f} | "
                     f"{r['tflops']:.0f} |")
    totals: dict = {}
    for r in rows:
        totals[(r["path"], r["chunk"])] = totals.get((r["path"], r["chunk"]), 0.0) + r["ms"]
    lines += ["", "| polynomial | chunk | all shapes, ms |", "|---|---|---|"]
    lines += [f"| {path} | {ch} | {ms:.2f} |" for (path, ch), ms in totals.items()]
    if cuda and not args.fused_only:
        (r, c), k = next(iter(shapes.items()))
        m, n = min(r, c), max(r, c)
        lines += ["", f"Single products at {k} blocks, m = {m}, n = {n}:", "| product | ms | TFLOP/s |",
                  "|---|---|---|"]
        for name, ms, flop in product_times(k, m, n, device):
            lines.append(f"| {name} | {ms:.3f} | {flop / ms / 1e9:.0f} |")
    if args.pad:
        padded, product_lines = padded_rows(shapes, device, env, args.pad)
        lines += ["", "Zero-padded long side against ours (same run; rel diff = relative RMS against ours on the same "
                  "bf16 input):", "| blocks | variant | rel err vs float64 | rel diff vs ours | ms |", "|---|---|---|---|---|"]
        lines += [f"| {g['shape']} | {g['variant']} | {g['rel_err']:.2e} | {g['vs_ours']:.2e} | {g['ms']:.3f} |"
                  for g in padded]
        lines += product_lines
        rows += padded
    if args.gram:
        gram = gram_rows(shapes, device, env)
        lines += ["", "Gram Newton-Schulz against ours (same run):", "| blocks | variant | rel err vs float64 | ms |",
                  "|---|---|---|---|"]
        lines += [f"| {g['shape']} | {g['variant']} | {g['rel_err']:.2e} | {g['ms']:.3f} |" for g in gram]
        rows += gram
    if args.fused is not None and not cuda:
        print("--fused: the one-kernel iteration is timed on CUDA only; no rows without a GPU", flush=True)
    elif args.fused is not None:
        fused = fused_rows(shapes, device, env, args.fused or list(FUSED_CONFIGS), args.fused_shapes)
        lines += ["", "The whole iteration in one kernel (`newton_schulz_blocks`) against ours (same run; rel diff = "
                  "relative RMS against ours on the same bf16 input):",
                  "| blocks | variant | rel err vs float64 | rel diff vs ours | ms | TFLOP/s | note |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {f['shape']} | {f['variant']} | {f['rel_err']:.2e} | {f['vs_ours']:.2e} | {f['ms']:.3f} | "
                  f"{f.get('tflops', float('nan')):.0f} | {f['note']} |" for f in fused]
        rows += fused
    write_results(args.out, "newton_schulz", "\n".join(lines), env, rows)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
