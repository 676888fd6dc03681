"""Benchmark: the pseudo-query mix of Block Attention Residuals, forward and forward + backward.

Side by side, in one run, at the training shape (B8 T4096, D of the flavor, bf16) for each
source count N:
  eager      kernels.attn_res.pseudo_query_mix_reference (stack, float32 upcast, rms_norm, softmax, sum)
  compiled   the same under torch.compile (inductor)
  ours       kernels.attn_res.pseudo_query_mix (Triton: each source read once forward)
Every variant is checked against the float64 reference (relative RMS error) before it is timed.
`--sweep` also times alternative tiles and warps of our two kernels at the largest N.
`--stream` instead times the flavor's whole stream of mixes (every layer's two and the final one, the model's
`ResidualBlocks` and `PseudoQueryMix`, each sublayer a scaling) forward + backward with our mix, with and
without gradient sinks (kernels.attn_res_grad_in_place: each completed block's gradient summed in place by the
mixes' backward), and with each sublayer's RMSNorm either in the sublayer (compiled, as the model's sublayers are)
or in the mix that feeds it (kernels.attn_res_norm_in_mix), each checked against the float64 reference first.

    PYTHONPATH=. python benchmarks/attn_res.py [--flavor k3-mini --batch 8 --seq 4096 --sources 2,3,5] [--out OUTDIR]
    PYTHONPATH=. python benchmarks/attn_res.py --stream [--flavor k3-mini --batch 32 --seq 1024] [--out OUTDIR]
    PYTHONPATH=. python benchmarks/attn_res.py --stream --sweep [--batch 32 --seq 1024]

`--stream --sweep` times only the recipe's stream (norms in the mixes, gradient sinks), once per backward launch
of STREAM_SWEEP (tile elements, warps, row tiles per program, most sources held), the forward's launch as it
is: the backward kernel's settings where the step runs it, over the N, norm and in-place variants the model
calls. It prints its lines and writes no table.

Prints a table last and appends it to OUTDIR/attn_res.md (OUTDIR/attn_res.json: the rows; attn_res_stream.json
for --stream).
Without a GPU it runs on Triton's CPU interpreter in float32 (a smoke run; the times mean nothing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import environment, env_cells, markdown_table, median_ms, rel_rms, write_results  # noqa: E402
from kernels.attn_res import mix, pseudo_query_mix, pseudo_query_mix_reference  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402
from titan_k3.models.k3.attn_res import PseudoQueryMix, ResidualBlocks, residual_layer  # noqa: E402
from titan_k3.models.k3.layers import RMSNorm, rms_norm  # noqa: E402

EPS = 1e-5
SWEEP = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
# (tile, warps, tiles per program, most sources held) of the backward kernel for `--stream --sweep`; the second is
# the default launch, the first the same without held tiles.
STREAM_SWEEP = [(2048, 4, 8, 0), (2048, 4, 8, 4), (1024, 4, 8, 4), (4096, 8, 8, 4), (2048, 8, 8, 4), (2048, 4, 4, 4)]


def make_inputs(n_sources: int, shape: tuple[int, ...], dtype: torch.dtype, device: str):
    """Leaf sources of different scales (as block sums are), a query of RMS 0.3 (weights far from uniform), dout."""
    gen = torch.Generator(device=device).manual_seed(n_sources)
    sources = [(torch.randn(*shape, device=device, generator=gen) * (0.5 + n)).to(dtype).requires_grad_(True)
               for n in range(n_sources)]
    query = (torch.randn(shape[-1], device=device, generator=gen) * 0.3).requires_grad_(True)
    dout = torch.randn(*shape, device=device, generator=gen).to(dtype)
    return sources, query, dout


def outputs_and_grads(fn, sources, query, dout) -> list[torch.Tensor]:
    for x in (*sources, query):
        x.grad = None
    out = fn(sources, query, EPS)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in (*sources, query)]


def measure(name: str, fn, sources, query, dout) -> dict:
    leaves = [*sources, query]
    fwd = median_ms(lambda: fn(sources, query, EPS), leaves)
    fwd_bwd = median_ms(lambda: fn(sources, query, EPS).backward(dout), leaves)
    return {"variant": name, "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}


def sweep_tiles(sources, query, dout) -> None:
    """Ours at each (tile, warps) of SWEEP, forward and backward kernels set alike; LAUNCH restored after."""
    saved = {k: dict(v) for k, v in mix.LAUNCH.items()}  # the backward's row tiles per program stay as they are
    try:
        for tile, warps in SWEEP:
            for kernel in ("fwd", "bwd"):
                mix.LAUNCH[kernel].update(tile=tile, num_warps=warps)
            r = measure("ours", pseudo_query_mix, sources, query, dout)
            print(f"sweep tile {tile} warps {warps}: fwd {r['fwd_ms']:.3f} ms, "
                  f"bwd {r['fwd_bwd_ms'] - r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms", flush=True)
    finally:
        mix.LAUNCH.clear()
        mix.LAUNCH.update(saved)


def _scaled_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    return scale * rms_norm(x, weight, eps)


class MixStream(torch.nn.Module):
    """The residual stream of a flavor's mixes: per layer an attention and an FFN mix, then the final mix, over the
    model's block sums (`ResidualBlocks`, `residual_layer`); a sublayer is a scaling of its mix's output (0.5 and
    0.25), so the time is the mixes', the residual adds' and the sums of the blocks' gradients.

    norms: "none"; "sublayer" (each mix's output goes through an RMSNorm and the scaling in one compiled function,
    as the model's compiled sublayers start); "mix" (the mixes apply those norms: kernels.attn_res_norm_in_mix).
    """

    def __init__(self, flavor: str, mix_fn, grad_sinks: bool, norms: str = "none"):
        super().__init__()
        args = FLAVORS[flavor]
        self.n_layers, self.block_size, self.grad_sinks = args.n_layers, args.attn_res_block_size, grad_sinks
        self.mixes = torch.nn.ModuleList(PseudoQueryMix(args.dim, mix_fn, EPS) for _ in range(2 * args.n_layers + 1))
        self.where = norms
        self.norms = torch.nn.ModuleList(RMSNorm(args.dim, EPS) for _ in self.mixes) if norms != "none" else None
        self.scaled_norm = torch.compile(_scaled_norm) if mix_fn is pseudo_query_mix else _scaled_norm

    def sublayer(self, i: int, scale: float):
        """Sublayer i (its mix's output -> its input to the residual sum) and the norm its mix applies (or None)."""
        if self.where == "sublayer":
            norm = self.norms[i]
            return (lambda x: self.scaled_norm(x, norm.weight, norm.eps, scale)), None
        return (lambda x: scale * x), (self.norms[i] if self.where == "mix" else None)

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        stream = ResidualBlocks(embedding, self.block_size, self.grad_sinks)
        for i in range(self.n_layers):
            (attn, attn_norm), (ffn, ffn_norm) = self.sublayer(2 * i, 0.5), self.sublayer(2 * i + 1, 0.25)
            stream.partial = residual_layer(stream.completed, stream.partial, stream.sinks, self.mixes[2 * i], attn,
                                            self.mixes[2 * i + 1], ffn, attn_norm, ffn_norm)
            stream.end_layer(i)
        final, norm = self.sublayer(len(self.mixes) - 1, 1.0)
        return final(self.mixes[-1](stream.sources(), stream.sinks, norm=norm))


def sweep_stream_backward(module: MixStream, embedding: torch.Tensor, dout: torch.Tensor) -> None:
    """The stream's forward + backward at each backward launch of STREAM_SWEEP, and (on CUDA) the backward kernel's
    own GPU time per pass from the profiler: the eager stream's host launches can hide a kernel's change in the
    wall time. LAUNCH restored after."""
    saved = dict(mix.LAUNCH["bwd"])
    leaves = [embedding, *module.parameters()]

    def run():
        for x in leaves:
            x.grad = None
        module(embedding).backward(dout)

    first = None
    try:
        for tile, warps, tiles, hold in STREAM_SWEEP:
            mix.LAUNCH["bwd"].update(tile=tile, num_warps=warps, tiles=tiles, hold=hold)
            run()  # compiles this launch's kernels outside the timing
            # Rows are independent of the launch: every launch must give the first one's embedding gradient.
            first = embedding.grad.clone() if first is None else first
            err = rel_rms(embedding.grad, first)
            if err >= 1e-3:
                raise SystemExit(f"error: stream sweep bwd tile {tile} warps {warps} tiles {tiles} hold {hold}: the "
                                 f"embedding's gradient is {err:.2e} (relative RMS) from the first launch's")
            ms = median_ms(run, leaves)
            kernel = ""
            if torch.cuda.is_available():
                passes = 5
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(passes):
                        run()
                    torch.cuda.synchronize()
                # NOTE: a missing kernel row would read as 0 ms, a silent win: the row must be there.
                found = [e.device_time_total for e in prof.key_averages() if e.key == "_mix_bwd_kernel"]
                if not found:
                    raise SystemExit(f"error: stream sweep bwd tile {tile} warps {warps} tiles {tiles} hold {hold}: "
                                     "the profile holds no _mix_bwd_kernel row (the launch never ran the kernel)")
                kernel = f", _mix_bwd_kernel {sum(found) / passes / 1e3:.3f} ms per pass"
            print(f"stream sweep bwd tile {tile} warps {warps} tiles {tiles} hold {hold}: fwd+bwd {ms:.3f} ms{kernel}",
                  flush=True)
    finally:
        mix.LAUNCH["bwd"].clear()
        mix.LAUNCH["bwd"].update(saved)


def stream_benchmark(args) -> int:
    """--stream: the flavor's stream of mixes forward + backward, ours without and with gradient sinks."""
    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)
    dim = FLAVORS[args.flavor].dim
    gen = torch.Generator(device=device).manual_seed(0)
    embedding = torch.randn(args.batch, args.seq, dim, device=device, generator=gen).to(dtype).requires_grad_(True)
    dout = torch.randn(args.batch, args.seq, dim, device=device, generator=gen).to(dtype)
    # Each variant is timed against the one without either lever that has its norms: the plain stream, or the norms
    # compiled beside the mixes (as the model's sublayers had them).
    base, norms_beside = "autograd sums", "norms in sublayers (compiled), autograd sums"
    streams = {base: MixStream(args.flavor, pseudo_query_mix, False),
               "sinks": MixStream(args.flavor, pseudo_query_mix, True),
               norms_beside: MixStream(args.flavor, pseudo_query_mix, False, "sublayer"),
               "norms in mixes, autograd sums": MixStream(args.flavor, pseudo_query_mix, False, "mix"),
               "norms in sublayers (compiled), sinks": MixStream(args.flavor, pseudo_query_mix, True, "sublayer"),
               "norms in mixes, sinks": MixStream(args.flavor, pseudo_query_mix, True, "mix")}
    if args.sweep:  # the recipe's stream alone (checked like the others), then its backward launches; no table
        streams = {"norms in mixes, sinks": streams["norms in mixes, sinks"]}
    references = {norms: MixStream(args.flavor, pseudo_query_mix_reference, False, norms).to(device, torch.float64)
                  for norms in (("sublayer",) if args.sweep else ("none", "sublayer"))}
    for module in (*streams.values(), *references.values()):
        with torch.no_grad():  # the same queries and norm weights everywhere, off their init
            for i, m in enumerate(module.mixes):
                m.query.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(i)) * 0.3)
            for i, norm in enumerate(module.norms or []):
                norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=torch.Generator().manual_seed(100 + i)))
    streams = {name: m.to(device) for name, m in streams.items()}

    def embedding_grad(module, x, g):
        x = x.detach().requires_grad_(True)
        module(x).backward(g)
        return x.grad

    # NOTE: the check is the embedding's gradient: every block's gradient, however summed, reaches it. The queries'
    # gradients are no check here: with sublayers that only scale, the sources nearly agree and those gradients
    # cancel to ~1e-6 of the embedding's, where float32 rounding alone moves them by tens of percent.
    truths = {norms: embedding_grad(ref, embedding.double(), dout.double()) for norms, ref in references.items()}
    env, rows = environment(), []
    for name, module in streams.items():
        err = rel_rms(embedding_grad(module, embedding, dout), truths["none" if module.where == "none" else "sublayer"])
        print(f"stream check {name}: embedding gradient rel rms {err:.1e}", flush=True)
        assert err < 2e-2, (name, err)
        leaves = [embedding, *module.parameters()]
        rows.append({"variant": name, "fwd_bwd_ms": median_ms(lambda m=module: m(embedding).backward(dout), leaves),
                     "rel_rms": err, "baseline": base if module.where == "none" else norms_beside})
    del truths
    if args.sweep:
        sweep_stream_backward(streams["norms in mixes, sinks"], embedding, dout)
        return 0
    ms = {r["variant"]: r["fwd_bwd_ms"] for r in rows}
    shape = f"B{args.batch} T{args.seq} D{dim} {str(dtype).removeprefix('torch.')}"
    lines = [env_cells(env) + f"{args.flavor} | {shape} | {2 * FLAVORS[args.flavor].n_layers + 1} | {r['variant']} "
             f"| {r['fwd_bwd_ms']:.3f} | {ms[r['baseline']] - r['fwd_bwd_ms']:+.3f} ({r['baseline']}) "
             f"| {r['rel_rms']:.1e} |" for r in rows]
    table = markdown_table(["flavor", "shape", "mixes", "variant", "stream fwd+bwd ms", "saved ms vs (baseline)",
                            "embedding gradient rel RMS vs float64"], lines)
    write_results(args.out, "attn_res_stream", table, env, rows)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--sources", default="2,3,5", help="comma-separated source counts N")
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled reference")
    p.add_argument("--sweep", action="store_true",
                   help="also time alternative tiles / warps of ours at the largest N (with --stream: only the "
                        "backward's launches over the recipe's stream)")
    p.add_argument("--stream", action="store_true",
                   help="time the flavor's whole stream of mixes with and without gradient sinks instead")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if args.stream:
        return stream_benchmark(args)
    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)  # the interpreter has no bf16
    dim = FLAVORS[args.flavor].dim
    shape = (args.batch, args.seq, dim)
    compiled = torch.compile(pseudo_query_mix_reference, backend=args.backend)
    variants = {"eager": pseudo_query_mix_reference, "compiled": compiled, "ours": pseudo_query_mix}
    env, rows = environment(), []
    for n_sources in [int(n) for n in args.sources.split(",")]:
        sources, query, dout = make_inputs(n_sources, shape, dtype, device)
        truth = outputs_and_grads(
            pseudo_query_mix_reference, [v.detach().double().requires_grad_(True) for v in sources],
            query.detach().double().requires_grad_(True), dout.double(),
        )
        for name, fn in variants.items():
            got = outputs_and_grads(fn, sources, query, dout)
            out_err, grad_err = rel_rms(got[0], truth[0]), max(rel_rms(g, t) for g, t in zip(got[1:], truth[1:]))
            print(f"N={n_sources} check {name}: out rel rms {out_err:.1e}, worst grad rel rms {grad_err:.1e}", flush=True)
            assert out_err < 5e-3 and grad_err < 2e-2, (name, n_sources, out_err, grad_err)
        del truth
        timed = {name: measure(name, fn, sources, query, dout) for name, fn in variants.items()}
        for r in timed.values():
            print(f"N={n_sources} {r['variant']}: fwd {r['fwd_ms']:.3f} ms, fwd+bwd {r['fwd_bwd_ms']:.3f} ms", flush=True)
        # Bytes a fused pass cannot avoid: forward N reads + 1 write; backward dout + N reads + N writes.
        elem = sources[0].element_size() * sources[0].numel()
        ours = timed["ours"]
        rows.append({
            "n_sources": n_sources, "shape": f"B{args.batch} T{args.seq} D{dim} {str(dtype).removeprefix('torch.')}",
            **{f"{name}_{k}": r[k] for name, r in timed.items() for k in ("fwd_ms", "fwd_bwd_ms")},
            "ours_fwd_bwd_gbps": (3 * n_sources + 2) * elem / ours["fwd_bwd_ms"] / 1e6,
        })
        if args.sweep and n_sources == max(int(n) for n in args.sources.split(",")):
            sweep_tiles(sources, query, dout)
    header = (
        "| date | commit | GPU | torch | triton | shape | N | eager fwd ms | compiled fwd ms | ours fwd ms "
        "| eager fwd+bwd ms | compiled fwd+bwd ms | ours fwd+bwd ms | ours vs eager (fwd+bwd) "
        "| ours vs compiled (fwd+bwd) | ours fwd+bwd GB/s (minimal bytes) |\n|" + "---|" * 16
    )
    lines = [
        f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {r['shape']} "
        f"| {r['n_sources']} | {r['eager_fwd_ms']:.3f} | {r['compiled_fwd_ms']:.3f} | {r['ours_fwd_ms']:.3f} "
        f"| {r['eager_fwd_bwd_ms']:.3f} | {r['compiled_fwd_bwd_ms']:.3f} | {r['ours_fwd_bwd_ms']:.3f} "
        f"| {r['eager_fwd_bwd_ms'] / r['ours_fwd_bwd_ms']:.1f}x | {r['compiled_fwd_bwd_ms'] / r['ours_fwd_bwd_ms']:.2f}x "
        f"| {r['ours_fwd_bwd_gbps']:.0f} |"
        for r in rows
    ]
    write_results(args.out, "attn_res", header + "\n" + "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
