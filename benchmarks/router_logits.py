"""Benchmark: the MoE router's scores W_router x under the trainer's bf16 autocast, float32 against bf16.

docs/k3.md §2.3 asks for the router's scores in float32; autocast would run the product in bf16.
Side by side, in one run, at k3-mini's router shape (T tokens of one update, D 512, E 176):
  bf16        autocast's own product, as the router ran before (no longer the recipe)
  recipe      titan_k3.models.k3.moe.router_logits: the float32 product in an op of its own for the value
              and autocast's bf16 product for the gradient
  float32     the float32 product alone (the recipe's extra cost in the forward)
  split3      a float32 product on the tensor cores: each operand split into bf16 high and low halves, three
              bf16 products with float32 outputs (hi hi + hi lo + lo hi), a candidate (rejected in session 38)
  pieces      cuBLAS's bf16 product of x with the float32 weight's three exact bf16 pieces side by side (one
              product of 3E columns with float32 outputs), the three column blocks summed: what a user could
              build from torch alone for the same numbers as `kernel`
  kernel      kernels.router.router_scores: the same three pieces cut in registers by one Triton kernel, summed
              in its float32 accumulators (the trainer's routers on a GPU), its gradient autocast's product;
              for float32 x the op takes torch's float32 product
Each is timed forward and, where it carries a gradient, forward + backward, for bf16 and float32 inputs (the
router reads the pre-norm's output), and checked against the float64 product (largest absolute error).

    PYTHONPATH=. python benchmarks/router_logits.py [--tokens 32768] [--sweep] [--out OUTDIR]

--sweep (CUDA) adds the kernel's forward under other launch settings (rows `kernel BTxBExBD wW sS`), bf16 x.

Prints a table last and appends it to OUTDIR/router_logits.md (OUTDIR/router_logits.json: the rows).
Without CUDA it runs the same math on the CPU (a smoke run: the times mean nothing; split3 is skipped there,
as CPU products take no float32 output dtype for bf16 operands).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import env_cells, environment, markdown_table, median_ms, write_results  # noqa: E402
from kernels.router import router_scores  # noqa: E402
from kernels.router import scores as scores_kernel  # noqa: E402
from kernels.router.reference import weight_pieces  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402
from titan_k3.models.k3.moe import router_logits  # noqa: E402


def split3(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w^T to ~float32 accuracy from three bf16 products with float32 outputs (the lo lo term is dropped)."""
    x32, w32 = x_TD.float(), w_ED.float()
    xh, wh = x32.bfloat16(), w32.bfloat16()
    xl, wl = (x32 - xh.float()).bfloat16(), (w32 - wh.float()).bfloat16()
    out = torch.mm(xh, wh.t(), out_dtype=torch.float32)
    out += torch.mm(xh, wl.t(), out_dtype=torch.float32)
    out += torch.mm(xl, wh.t(), out_dtype=torch.float32)
    return out


SWEEP = [dict(block_t=t, block_e=e, block_d=d, num_warps=nw, num_stages=ns) for t, e, d, nw, ns in (
    (128, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 64, 64, 4, 3), (128, 32, 64, 4, 3), (256, 64, 64, 8, 3),
    (128, 64, 32, 4, 3), (128, 64, 32, 8, 4), (128, 64, 128, 8, 2))]


def pieces(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """x @ w^T from cuBLAS: bf16 x times w's three bf16 pieces (w = w0 + w1 + w2 exactly), one product, summed."""
    out = torch.mm(x_TD.bfloat16(), torch.cat(weight_pieces(w_ED)).t(), out_dtype=torch.float32)
    return out.view(x_TD.shape[0], 3, w_ED.shape[0]).sum(1)


def variants(x: torch.Tensor, w: torch.Tensor, sweep: bool = False) -> dict:
    """name -> (forward fn, carries a gradient); `sweep` adds the kernel's forward under SWEEP's launches (CUDA, bf16)."""
    device = x.device.type

    def autocast():
        return torch.autocast(device, dtype=torch.bfloat16)

    def bf16():
        with autocast():
            return (x @ w.t()).float()

    def recipe():
        with autocast():
            return router_logits(x, w)

    found = {"bf16": (bf16, True), "recipe": (recipe, True),
             "float32": (lambda: x.detach().float() @ w.detach().t(), False)}
    if device == "cuda":
        found["split3"] = (lambda: split3(x.detach(), w.detach()), False)
        if x.dtype == torch.bfloat16:
            found["pieces"] = (lambda: pieces(x.detach(), w.detach()), False)
        found["kernel"] = (lambda: router_scores(x, w), True)
        for launch in SWEEP if sweep and x.dtype == torch.bfloat16 else ():
            name = "kernel {block_t}x{block_e}x{block_d} w{num_warps} s{num_stages}".format(**launch)
            found[name] = (lambda launch=launch: scores_kernel.scores_forward(x.detach(), w.detach(), launch), False)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="tokens of one update (k3-mini's recipe: 32,768)")
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--sweep", action="store_true", help="also time the kernel's forward under other launch settings")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    margs = FLAVORS[args.flavor]
    dim, experts = margs.dim, margs.n_experts
    tokens = args.tokens if device == "cuda" else min(args.tokens, 1024)
    env, rows, lines = environment(), [], []
    gen = torch.Generator(device=device).manual_seed(0)
    for x_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(tokens, dim, device=device, generator=gen).to(x_dtype).requires_grad_(True)
        w = (0.02 * torch.randn(experts, dim, device=device, generator=gen)).requires_grad_(True)
        truth = x.detach().double() @ w.detach().double().t()
        for name, (fn, has_grad) in variants(x, w, args.sweep).items():
            with torch.no_grad():
                err = float((fn().double() - truth).abs().max())
            fwd = median_ms(fn)
            bwd = median_ms(lambda: fn().sum().backward(), grad_to_none=[x, w]) if has_grad else None
            row = dict(variant=name, x_dtype=str(x_dtype).removeprefix("torch."), tokens=tokens, dim=dim,
                       experts=experts, fwd_ms=fwd, fwd_bwd_ms=bwd, max_abs_err=err)
            rows.append(row)
            lines.append(env_cells(env) + f"{name} | {row['x_dtype']} | T{tokens} D{dim} E{experts} | {fwd:.3f} | "
                         + (f"{bwd:.3f}" if bwd is not None else "—") + f" | {err:.2e} |")
            print(row, flush=True)
    table = markdown_table(["variant", "x dtype", "shape", "forward ms", "forward + backward ms",
                            "max abs error vs float64"], lines)
    write_results(args.out, "router_logits", table, env, rows)


if __name__ == "__main__":
    main()
