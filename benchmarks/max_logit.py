"""Benchmark: QK-Clip's per-head max logit of one MLA layer, the chunked einsum vs the Triton kernel.

Side by side, in one run, at the training shape (B8 T4096, the flavor's MLA heads and q/k width,
bf16), plain causal and with packed documents (lengths drawn from 1 .. 2 * doc_len - 1):
  reference  kernels.max_logit.max_logit_per_head_reference: 512-query chunks of float32 products
             (q, k cast to float32 before the einsum since bd6756a; max_logit.md's times are of the bf16
             einsum before it), masked_fill, amax (the model's path before the kernel)
  ours       kernels.max_logit.max_logit_per_head: one pass over the allowed key blocks, no scores
Each is checked against the float32 reference on the same inputs before it is timed; the extra
memory a call allocates beyond its inputs is recorded too. `--sweep` also times alternative
tiles, warps and stages of ours.

    PYTHONPATH=. python benchmarks/max_logit.py [--flavor k3-mini --batch 8 --seq 4096 --doc-len 1000] [--out OUTDIR]

Prints a table last and appends it to OUTDIR/max_logit.md (OUTDIR/max_logit.json: the rows).
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

from benchmarks.common import add_packed_shape_args, environment, median_ms, packed_pos, write_results  # noqa: E402
from kernels.max_logit import kernel, max_logit_per_head, max_logit_per_head_reference  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402

# (BQ, BK, num_warps, num_stages) timed by --sweep.
SWEEP = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
         (64, 64, 4, 3), (64, 128, 4, 3), (256, 64, 8, 3)]


def make_inputs(batch: int, seq: int, heads: int, width: int, dtype: torch.dtype, device: str):
    """q, k [B, H, T, E] as MLA passes them: transposed views of [B, T, H, E] tensors."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(batch, seq, heads, width, device=device, generator=gen).to(dtype).transpose(1, 2)
            for _ in range(2)]


def extra_gib(fn) -> float:
    """GiB a call of fn allocates at its peak beyond what was allocated before it (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def sweep_launch(q, k, scale, pos, label: str) -> None:
    """Ours at each launch setting of SWEEP (checked first); LAUNCH restored after."""
    saved = dict(kernel.LAUNCH)
    truth = max_logit_per_head_reference(q.float(), k.float(), scale, pos)
    try:
        for bq, bk, warps, stages in SWEEP:
            kernel.LAUNCH.clear()
            kernel.LAUNCH["default"] = dict(BQ=bq, BK=bk, num_warps=warps, num_stages=stages)
            try:
                got = max_logit_per_head(q, k, scale, pos)
            except Exception as e:  # noqa: BLE001 - a setting that does not build is reported, not fatal
                print(f"sweep {label} BQ {bq} BK {bk} warps {warps} stages {stages}: failed: {e}"[:300], flush=True)
                continue
            assert torch.allclose(got, truth, rtol=1e-4, atol=1e-4), (bq, bk, warps, stages, got, truth)
            ms = median_ms(lambda: max_logit_per_head(q, k, scale, pos))
            print(f"sweep {label} BQ {bq} BK {bk} warps {warps} stages {stages}: {ms:.3f} ms", flush=True)
    finally:
        kernel.LAUNCH.clear()
        kernel.LAUNCH.update(saved)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_packed_shape_args(p)
    p.add_argument("--sweep", action="store_true", help="also time alternative launch settings of ours")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)  # the interpreter has no bf16
    flavor = FLAVORS[args.flavor]
    heads, width = flavor.mla_heads, flavor.qk_nope_dim + flavor.qk_rope_dim
    scale = width**-0.5
    q, k = make_inputs(args.batch, args.seq, heads, width, dtype, device)
    layouts = {"causal": None, f"docs ~{args.doc_len}": packed_pos(args.batch, args.seq, args.doc_len, device)}
    variants = {"reference": max_logit_per_head_reference, "ours": max_logit_per_head}
    env, rows = environment(), []
    for label, pos in layouts.items():
        truth = max_logit_per_head_reference(q.float(), k.float(), scale, pos)
        for name, fn in variants.items():
            err = ((fn(q, k, scale, pos) - truth).abs() / truth.abs()).max().item()
            print(f"{label} check {name}: worst head rel error {err:.1e} vs float32", flush=True)
            assert err < 1e-4, (label, name, err)  # both take float32 products of the bf16 inputs
        timed = {name: median_ms(lambda fn=fn, pos=pos: fn(q, k, scale, pos)) for name, fn in variants.items()}
        memory = {name: extra_gib(lambda fn=fn, pos=pos: fn(q, k, scale, pos)) for name, fn in variants.items()}
        # Logits inside the mask: a token at position p inside its document sees p + 1 keys.
        n_allowed = args.batch * args.seq * (args.seq + 1) // 2 if pos is None else int((pos + 1).sum())
        print(f"{label}: reference {timed['reference']:.3f} ms, ours {timed['ours']:.3f} ms", flush=True)
        rows.append({
            "shape": f"B{args.batch} T{args.seq} H{heads} E{width} {str(dtype).removeprefix('torch.')}",
            "layout": label, **{f"{name}_ms": timed[name] for name in variants},
            **{f"{name}_extra_gib": memory[name] for name in variants},
            "ours_tflops": 2 * width * heads * n_allowed / timed["ours"] / 1e9,
        })
        if args.sweep:
            sweep_launch(q, k, scale, pos, label)
    header = (
        "| date | commit | GPU | torch | triton | shape | layout | reference ms | ours ms | ours vs reference "
        "| reference extra GiB | ours extra GiB | ours TFLOP/s (masked-in logits) |\n|" + "---|" * 13
    )
    lines = [
        f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {r['shape']} "
        f"| {r['layout']} | {r['reference_ms']:.3f} | {r['ours_ms']:.3f} | {r['reference_ms'] / r['ours_ms']:.1f}x "
        f"| {r['reference_extra_gib']:.2f} | {r['ours_extra_gib']:.4f} | {r['ours_tflops']:.0f} |"
        for r in rows
    ]
    write_results(args.out, "max_logit", header + "\n" + "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
