"""FP8 grouped GEMMs (torchao's rowwise recipe) against bf16 for k3-mini's routed experts, forward + backward.

Each routed-expert product of k3-mini at 32,768 tokens (top-6: 196,608 routed rows over 176 experts) alone:
  latent -> hidden   [rows, 256] x [E, 256, 544]  (the gate and the up projection are one each)
  hidden -> latent   [rows, 544] x [E, 544, 256]
timed forward + backward (the rows' and the weights' gradients) as
  bf16 _grouped_mm   torch._grouped_mm (cuBLAS), the weights column-major (its fast layout)
  bf16 ours          kernels.grouped_gemm.grouped_mm (Triton)
  fp8 rowwise        torchao's `_to_fp8_rowwise_then_scaled_grouped_mm`: e4m3 with a scale per row of the
                     rows and per column of each expert's weight, through torch._scaled_grouped_mm
Every group holds a multiple of 16 rows, which torchao's FP8 path needs (a router would have to pad to it), so
the FP8 column is its best case. Each output and gradient is checked against a float32 product first.
Two times per variant: wall time (`triton.testing.do_bench`, the calls issued from Python) and kernel time (the
sum of its kernels' durations under torch.profiler: what the training step's CUDA graph replays). At these sizes
a path of many launches from Python (ours' custom ops, torchao's casts) is host-bound in wall time
(benchmarks/results/fp8.md, session 25): the kernel time is the one to weigh for the step.

    python benchmarks/fp8_experts.py [--tokens 32768]

Prints a table and appends dated rows to benchmarks/results/fp8.md.
"""

import argparse
import os
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import (append_section, env_cells, environment, kernel_ms,  # noqa: E402
                               markdown_table, rel_rms)
from benchmarks.moe import column_major  # noqa: E402  (the layout torchao's FP8 path reads too)

TOP_K, EXPERTS, LATENT, HIDDEN = 6, 176, 256, 544  # k3-mini (titan_k3/models/k3/args.py)
PRODUCTS = {"latent -> hidden (gate, up)": (LATENT, HIDDEN), "hidden -> latent (down)": (HIDDEN, LATENT)}
ALIGN = 16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8.md")
# NOTE: bf16 rounding alone reads ~4e-3 against float32; e4m3's 3 mantissa bits ~3e-2.
TOLERANCE = {"bf16": 2e-2, "fp8": 1e-1}


def group_ends(rows: int, experts: int, device) -> torch.Tensor:
    """int32 [E] cumulative row ends: near-equal groups, each a multiple of ALIGN rows, summing to `rows`."""
    if rows % ALIGN:
        raise ValueError(f"rows={rows} must be a multiple of {ALIGN}")
    units = rows // ALIGN
    sizes = torch.full((experts,), units // experts, dtype=torch.int64)
    sizes[: units % experts] += 1
    return (sizes * ALIGN).cumsum(0).to(torch.int32).to(device)


def reference(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, dy: torch.Tensor):
    """(y, dx, dw) in float32: autograd through `kernels.grouped_gemm.reference.grouped_mm`'s per-expert loop."""
    from kernels.grouped_gemm import reference as grouped_reference

    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = grouped_reference.grouped_mm(x, w, ends)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y.detach(), dx, dw


def variants():
    """name -> (precision, f(x, w, ends) -> y, the weight layout it takes)."""
    from kernels.grouped_gemm import grouped_mm
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    def fp8(x, w, ends):
        return _to_fp8_rowwise_then_scaled_grouped_mm(x, w, ends, pad_token_groups_for_grouped_mm=False)

    return {
        "bf16 _grouped_mm": ("bf16", lambda x, w, ends: torch._grouped_mm(x, w, offs=ends), column_major),
        "bf16 ours": ("bf16", grouped_mm, lambda w: w.contiguous()),
        "fp8 rowwise (torchao)": ("fp8", fp8, column_major),
    }


def bench_product(rows: int, k: int, m: int) -> dict:
    """{variant: (wall ms, kernel ms, worst relative RMS error of y, dx, dw)}, forward + backward, for one product
    shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x32 = torch.randn(rows, k, generator=gen, device="cuda")
    w32 = torch.randn(EXPERTS, k, m, generator=gen, device="cuda") / k**0.5
    dy32 = torch.randn(rows, m, generator=gen, device="cuda")
    ends = group_ends(rows, EXPERTS, "cuda")
    refs = reference(x32, w32, ends, dy32)
    dy = dy32.bfloat16()
    out = {}
    for name, (precision, fn, layout) in variants().items():
        x = x32.bfloat16().requires_grad_()
        w = layout(w32.bfloat16()).requires_grad_()

        def step():
            y = fn(x, w, ends)
            y.backward(dy)
            return y

        y = step()
        err = max(rel_rms(got, ref) for got, ref in zip((y, x.grad, w.grad), refs))
        if not err < TOLERANCE[precision]:
            raise AssertionError(f"{name} [{rows}, {k}] x [{EXPERTS}, {k}, {m}]: relative RMS error {err:.3g} "
                                 f"against float32 (allowed {TOLERANCE[precision]})")
        wall = triton.testing.do_bench(step, grad_to_none=[x, w], warmup=25, rep=200)
        out[name] = (wall, kernel_ms(step, grad_to_none=[x, w]), err)
        print(f"  {name:>24}: {wall:.3f} ms wall, {out[name][1]:.3f} ms of kernels, error {err:.2e}", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("fp8_experts.py: needs CUDA (torch._scaled_grouped_mm and Triton kernels)", file=sys.stderr)
        return 2
    rows = args.tokens * TOP_K
    env = environment()
    lines = []
    for label, (k, m) in PRODUCTS.items():
        print(f"{label}: [{rows}, {k}] x [{EXPERTS}, {k}, {m}]", flush=True)
        times = bench_product(rows, k, m)
        best_bf16 = min(kernel for name, (_, kernel, _) in times.items() if name.startswith("bf16"))
        flops = 6 * rows * k * m
        for name, (wall, kernel, err) in times.items():
            lines.append(f"{env_cells(env)}{label} | [{rows}, {k}] x [{EXPERTS}, {k}, {m}] | {name} | {wall:.3f} | "
                         f"{kernel:.3f} | {flops / kernel / 1e9:.0f} | {best_bf16 / kernel:.2f}x | {err:.1e} |")
    table = markdown_table(["product (k3-mini experts)", "shape", "variant", "fwd+bwd wall ms", "fwd+bwd kernel ms",
                            "TFLOP/s (kernel)", "vs the faster bf16 (kernel)", "worst rel. RMS vs float32 (y, dx, dw)"],
                           lines)
    append_section(RESULTS, "Routed-expert grouped GEMMs, FP8 rowwise (torchao) vs bf16 (benchmarks/fp8_experts.py)",
                   f"Groups of near-equal size, each a multiple of {ALIGN} rows (FP8's best case).", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
