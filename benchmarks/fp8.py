"""torchao FP8 training vs bf16 for the k3-mini block linears, forward + backward, compiled, on one GPU.

Per linear shape (in -> out) at 32,768 tokens: bf16 nn.Linear, torchao
Float8LinearConfig "tensorwise" and "rowwise", each under torch.compile.
The FP8 outputs are checked against bf16 (relative RMS error) before timing.
This table decides the default `float8.min_dim`.

    python benchmarks/fp8.py [--tokens 32768]

Prints a table and appends dated rows to benchmarks/results/fp8.md.
"""

import argparse
import copy
import os
import sys

import torch
import triton
import triton.testing
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, rel_rms  # noqa: E402

SHAPES = {  # k3-mini linears (docs/k3.md §3) and, for contrast, a large FFN pair
    "kda q/k/v/g/o": (512, 512),
    "kda f1 (low rank)": (512, 128),
    "mla wq_b": (128, 768),
    "mla wkv_b": (128, 1024),
    "moe w_down": (512, 256),
    "moe w_up": (256, 512),
    "dense w1/w3": (512, 2560),
    "dense w2": (2560, 512),
    "ffn 1024->4096": (1024, 4096),
    "ffn 4096->1024": (4096, 1024),
    "square 4096": (4096, 4096),
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fp8.md")


def fwd_bwd(module, x, dy):
    def run():
        module.zero_grad(set_to_none=True)
        y = module(x)
        y.backward(dy)
        return y

    return run


def main():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    n = parser.parse_args().tokens
    env = environment()
    rows = []
    for name, (d_in, d_out) in SHAPES.items():
        torch.manual_seed(0)
        base = nn.Linear(d_in, d_out, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(n, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(n, d_out, device="cuda", dtype=torch.bfloat16)
        ref = base(x).detach()
        times = {}
        for variant in ("bf16", "tensorwise", "rowwise"):
            module = copy.deepcopy(base)
            if variant != "bf16":
                module = convert_to_float8_training(
                    nn.Sequential(module), config=Float8LinearConfig.from_recipe_name(variant)
                )
            compiled = torch.compile(module)
            run = fwd_bwd(compiled, x, dy)
            err = rel_rms(run().detach(), ref)
            assert err < 0.1, f"{name} {variant}: relative RMS error {err:.3g} vs bf16"
            times[variant] = triton.testing.do_bench(run, warmup=25, rep=100)
        flops = 6 * n * d_in * d_out
        for variant in ("tensorwise", "rowwise"):
            rows.append((name, d_in, d_out, variant, times[variant], times["bf16"], times["bf16"] / times[variant],
                         flops / times[variant] / 1e9))
        print(f"{name:>20} {d_in}x{d_out}: bf16 {times['bf16']:.3f} ms | tensorwise {times['tensorwise']:.3f} ms "
              f"({times['bf16'] / times['tensorwise']:.2f}x) | rowwise {times['rowwise']:.3f} ms "
              f"({times['bf16'] / times['rowwise']:.2f}x)", flush=True)
    header = not os.path.exists(RESULTS)
    with open(RESULTS, "a") as f:
        if header:
            f.write("# FP8 (torchao) vs bf16 linears, fwd+bwd, torch.compile\n\n"
                    "| date | commit | GPU | torch | triton | layer | in x out | tokens | recipe | fp8 ms | bf16 ms (same run) | speedup | fp8 TFLOP/s |\n"
                    "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
        for name, d_in, d_out, variant, t, t_ref, ratio, tflops in rows:
            f.write(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {name} | {d_in}x{d_out} | "
                    f"{n} | {variant} | {t:.3f} | {t_ref:.3f} | {ratio:.2f}x | {tflops:.0f} |\n")
    print(f"\n{'layer':>20} {'shape':>10} {'recipe':>10} {'fp8 ms':>8} {'bf16 ms':>8} {'speedup':>8}")
    for name, d_in, d_out, variant, t, t_ref, ratio, _ in rows:
        print(f"{name:>20} {f'{d_in}x{d_out}':>10} {variant:>10} {t:8.3f} {t_ref:8.3f} {ratio:7.2f}x")


if __name__ == "__main__":
    main()
