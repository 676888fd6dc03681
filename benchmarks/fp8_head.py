"""FP8 (e4m3 / e5m2 through torch._scaled_mm) against bf16 for the three products of the fused head + loss.

`kernels.fused_ce` runs, for each chunk of C rows of h [C, D] against the head W [V, D] (k3-mini: D 512,
V 163,840, C 4,096 rows in the pretraining recipe), three products:
  logits   h W^T     [C, D] x [D, V] -> bf16      (forward)
  dH       G W       [C, V] x [V, D] -> float32   (G = softmax - onehot(target), written over the logits)
  dW      += G^T h   [V, C] x [C, D] -> float32   (accumulated over the chunks)
The bf16 rows run them as the kernel does. The FP8 rows cast both operands beforehand (not timed) with a scale
per row of the left operand and per column of the right one, both along the contraction ("rowwise"), or one
scale per tensor ("tensorwise"); cuBLAS's FP8 products read the right operand column-major only, so an FP8 head
would also write G a second time, transposed, and keep W twice (both layouts): the FP8 times are therefore the
products' floor, and the casts come on top. G here is from random h and W, so its rows are near uniform (every
probability ~1/V): the hardest case for a scale per row, whose largest entry is the target's (p - 1).
Errors: relative RMS against the float32 product of the float32 operands.

    python benchmarks/fp8_head.py [--rows 4096]

Prints a table and appends dated rows to benchmarks/results/fp8.md.
"""

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import append_section, env_cells, environment, markdown_table, rel_rms  # noqa: E402

DIM, VOCAB = 512, 163840  # k3-mini's head (titan_k3/models/k3/args.py)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8.md")


def to_fp8(x: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x cast to `dtype`, its float32 dequantisation scale): one scale per slice along `dim` (the amax over `dim`
    maps to the format's largest value), or one for the whole tensor (dim None)."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = amax.float().clamp(min=1e-12) / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype).contiguous(), scale  # row-major whatever x's layout


def scaled_product(a: torch.Tensor, b: torch.Tensor, dtypes: tuple, rowwise: bool, out_dtype: torch.dtype):
    """(a @ b in FP8, a callable that redoes only the product): a [M, K] and b [K, N] cast along K."""
    a8, sa = to_fp8(a, dtypes[0], 1 if rowwise else None)
    bt8, sb = to_fp8(b.t(), dtypes[1], 1 if rowwise else None)  # [N, K] row-major: b column-major
    b8, sb = bt8.t(), sb.t() if rowwise else sb

    def run():
        return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)

    return run(), run


def variants():
    """name -> (operand dtypes (left, right) per product or None for bf16, rowwise scales)."""
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    return {
        "bf16 (as kernels.fused_ce)": (None, False),
        "fp8 e4m3, rowwise": ((e4, e4), True),
        "fp8 e4m3, tensorwise": ((e4, e4), False),
        "fp8 G in e5m2, rowwise": ((e5, e4), True),
    }


def products(rows: int) -> dict:
    """product -> (left [M, K] float32, right [K, N] float32, out dtype, the bf16 call as kernels.fused_ce makes it)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(rows, DIM, generator=gen, device="cuda")
    w = torch.randn(VOCAB, DIM, generator=gen, device="cuda") * DIM**-0.5
    targets = torch.randint(0, VOCAB, (rows,), generator=gen, device="cuda")
    g = torch.softmax(h @ w.t(), dim=-1)
    g[torch.arange(rows, device="cuda"), targets] -= 1
    hb, wb, gb = h.bfloat16(), w.bfloat16(), g.bfloat16()
    acc = torch.zeros(VOCAB, DIM, device="cuda")
    return {
        "logits = h W^T": (h, w.t(), torch.bfloat16, lambda: torch.mm(hb, wb.t())),
        "dH = G W": (g, w, torch.float32, lambda: torch.mm(gb, wb, out_dtype=torch.float32)),
        "dW += G^T h": (g.t(), h, torch.float32,
                        lambda: torch.addmm(acc, gb.t(), hb, out_dtype=torch.float32, out=acc)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="rows in one chunk (kernels.loss_chunk_rows)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_head.py: needs CUDA (torch._scaled_mm)", file=sys.stderr)
        return 2
    env = environment()
    lines = []
    for label, (a, b, out_dtype, bf16_call) in products(args.rows).items():
        ref = a @ b
        m, k = a.shape
        flops = 2 * m * k * b.shape[1]
        bf16_ms = None
        for name, (dtypes, rowwise) in variants().items():
            try:
                if dtypes is None:
                    run = bf16_call
                    got = run().clone()  # dW's accumulator starts at zero: its first call is the product
                else:
                    got, run = scaled_product(a, b, dtypes, rowwise, out_dtype)
            except RuntimeError as e:  # a format pair or scaling cuBLAS does not take: a row that says so
                print(f"  {label}, {name}: not run ({str(e).splitlines()[0]})", flush=True)
                lines.append(f"{env_cells(env)}{label} | [{m}, {k}] x [{k}, {b.shape[1]}] | {name} | not run: "
                             f"{str(e).splitlines()[0][:80]} | | | |")
                continue
            err = rel_rms(got.float(), ref)
            ms = triton.testing.do_bench(run, warmup=25, rep=200)
            bf16_ms = bf16_ms or ms
            print(f"  {label}, {name}: {ms:.3f} ms, error {err:.2e}", flush=True)
            lines.append(f"{env_cells(env)}{label} | [{m}, {k}] x [{k}, {b.shape[1]}] | {name} | {ms:.3f} | "
                         f"{flops / ms / 1e9:.0f} | {bf16_ms / ms:.2f}x | {err:.1e} |")
    table = markdown_table(["product (one chunk)", "shape", "variant", "ms", "TFLOP/s", "vs bf16",
                            "rel. RMS vs float32"], lines)
    append_section(RESULTS, "The fused head's three products, FP8 (torch._scaled_mm) vs bf16 (benchmarks/fp8_head.py)",
                   f"One chunk of {args.rows} rows; FP8 operands cast beforehand (the products' floor).", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
