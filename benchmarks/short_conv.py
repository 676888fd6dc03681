"""Benchmark: KDA's short convolution + SiLU, forward + backward: our Triton kernels against fla's and the compiled reference.

Side by side, in one run, at the training shape (B8 T4096, the flavor's KDA width H * K, 4 taps, bf16,
packed documents with lengths drawn from 1 .. 2 * doc_len - 1):
  compiled   torch.compile of kernels.short_conv.causal_conv_silu_reference: what the compiled model
             runs with kernels.conv = "torch" (inductor fuses the shifts, masks and SiLU)
  fla        flash-linear-attention's causal_conv1d (Triton, SiLU fused; what `benchmarks/peer_compiled.py`'s
             ShortConvolution runs), the batch as one packed sequence with cu_seqlens; skipped, and said so, where
             fla does not import or run (the CPU smoke run)
  ours       kernels.short_conv.causal_conv_silu (Triton forward; backward in two passes)
The ratio is against the faster of fla and the compiled reference. Each is checked against the float32 reference (y, dx, dw, relative RMS) before it is timed. A KDA layer
runs three of these (q, k, v) per micro-batch.

    PYTHONPATH=. python benchmarks/short_conv.py [--flavor k3-mini --batch 8 --seq 4096 --doc-len 1000] [--out OUTDIR]
        [--sweep]

--sweep also times our backward alone under each launch setting of SWEEP for its dz pass (tile rows and channels,
row tiles per program, warps), pinned in `kernels.short_conv.triton_conv.DZ_LAUNCH`, each checked against the
default's gradients first, and appends that table too.

Prints a table last and appends it to OUTDIR/short_conv.md (OUTDIR/short_conv.json: the rows).
Without a GPU it runs on Triton's CPU interpreter in float32, the reference uncompiled (a smoke run; the
times mean nothing).
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

from benchmarks.common import add_packed_shape_args, environment, median_ms, packed_pos, rel_rms, write_results  # noqa: E402
from kernels.short_conv import causal_conv_silu, causal_conv_silu_reference, triton_conv  # noqa: E402
from kernels.short_conv.ops import _conv_backward_op  # noqa: E402
from titan_k3.models.k3.args import FLAVORS  # noqa: E402

TAPS = 4
SWEEP = [dict(BLOCK_T=t, BLOCK_C=c, TILES=n, num_warps=w) for t, c, n, w in (
    (8, 128, 16, 4), (8, 128, 8, 4), (8, 128, 32, 4), (4, 128, 32, 4), (8, 64, 16, 4), (16, 128, 8, 4),
    (8, 256, 16, 8), (4, 256, 32, 4))]


def fwd_bwd(fn, x, w, pos, dy):
    """One forward + backward; returns (y, dx, dw)."""
    x.grad = w.grad = None
    y = fn(x, w, pos)
    y.backward(dy)
    return y, x.grad, w.grad


def fla_conv():
    """fla's causal_conv1d behind our (x, w, pos) signature, or None with the reason where it is not usable here."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception as e:  # noqa: BLE001 - a missing or broken install is reported, not fatal
        return None, f"{type(e).__name__}: {e}"
    if not torch.cuda.is_available():
        return None, "needs CUDA"

    def run(x_BTC, w_C1W, pos_BT):
        B, T, C = x_BTC.shape
        starts = torch.nonzero(pos_BT.reshape(-1) == 0).reshape(-1)
        cu = torch.cat([starts, starts.new_tensor([B * T])]).to(torch.int32)
        y, _ = causal_conv1d(x_BTC.reshape(1, B * T, C), w_C1W[:, 0, :].to(x_BTC.dtype), activation="silu",
                             cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        return y.reshape(B, T, C)

    return run, ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_packed_shape_args(p)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sweep", action="store_true", help="also time the backward under each launch setting of SWEEP")
    args = p.parse_args()
    on_cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_cuda else ("cpu", torch.float32)  # the interpreter has no bf16
    flavor = FLAVORS[args.flavor]
    channels = flavor.kda_heads * flavor.kda_head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.batch, args.seq, channels, device=device, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(channels, 1, TAPS, device=device, generator=gen) / TAPS**0.5).requires_grad_()
    dy = torch.randn(args.batch, args.seq, channels, device=device, generator=gen).to(dtype)
    pos = packed_pos(args.batch, args.seq, args.doc_len, device)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    truth = fwd_bwd(causal_conv_silu_reference, x32, w32, pos, dy.float())
    compiled = torch.compile(causal_conv_silu_reference) if on_cuda else causal_conv_silu_reference
    variants = {"compiled": compiled, "ours": causal_conv_silu}
    fla, why = fla_conv()
    if fla is None:
        print(f"fla skipped: {why}", flush=True)
    else:
        variants = {"compiled": compiled, "fla": fla, "ours": causal_conv_silu}
    errors = {}
    for name, fn in variants.items():
        got = fwd_bwd(fn, x, w, pos, dy)
        errors[name] = [rel_rms(a, b) for a, b in zip(got, truth)]
        print(f"check {name}: rel-RMS y {errors[name][0]:.1e}, dx {errors[name][1]:.1e}, dw {errors[name][2]:.1e} "
              "vs float32", flush=True)
        assert max(errors[name]) < 2e-2, (name, errors[name])  # bf16 inputs and outputs
    timed = {name: median_ms(lambda fn=fn: fwd_bwd(fn, x, w, pos, dy), grad_to_none=[x, w])
             for name, fn in variants.items()}
    forward = {name: median_ms(lambda fn=fn: fn(x.detach(), w.detach(), pos)) for name, fn in variants.items()}
    print("fwd+bwd: " + ", ".join(f"{n} {t:.3f} ms" for n, t in timed.items()), flush=True)
    best = min((n for n in timed if n != "ours"), key=timed.get)
    env = environment()
    row = {"shape": f"B{args.batch} T{args.seq} C{channels} W{TAPS} {str(dtype).removeprefix('torch.')}",
           "layout": f"docs ~{args.doc_len}", **{f"{n}_ms": timed[n] for n in variants},
           **{f"{n}_fwd_ms": forward[n] for n in variants}, "ours_rel_rms": errors["ours"], "baseline": best}
    # NOTE: the minimum traffic of fwd + bwd: x read twice, y, dy, dx once each (dz's round trip not counted).
    moved = 5 * x.numel() * x.element_size()
    fla_ms = f"{timed['fla']:.3f}" if "fla" in timed else "— (skipped)"
    header = ("| date | commit | GPU | torch | triton | shape | layout | compiled fwd+bwd ms | fla fwd+bwd ms | ours "
              "fwd+bwd ms | ours vs the faster of the two | compiled fwd ms | ours fwd ms | ours GB/s (5 passes) "
              "| ours rel-RMS y / dx / dw |\n|" + "---|" * 15)
    line = (f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {row['shape']} "
            f"| {row['layout']} | {timed['compiled']:.3f} | {fla_ms} | {timed['ours']:.3f} "
            f"| {timed[best] / timed['ours']:.2f}x ({best}) | {forward['compiled']:.3f} | {forward['ours']:.3f} "
            f"| {moved / timed['ours'] / 1e6:.0f} | {' / '.join(f'{e:.1e}' for e in errors['ours'])} |")
    table, rows = header + "\n" + line, [row]
    if args.sweep:
        sweep_table, sweep_rows = sweep_backward(x.detach(), w.detach(), pos, dy, env, row["shape"])
        table, rows = table + "\n\n" + sweep_table, rows + sweep_rows
    write_results(args.out, "short_conv", table, env, rows)
    return 0


def sweep_backward(x, w, pos, dy, env, shape: str) -> tuple[str, list[dict]]:
    """(table, rows): our backward alone under each SWEEP setting of its dz pass (pinned in DZ_LAUNCH, restored
    after), each checked against the default setting's gradients first."""
    default = dict(triton_conv.DZ_LAUNCH)
    want = _conv_backward_op(dy, x, w, pos)
    lines = ["| date | commit | GPU | shape | dz BLOCK_T | dz BLOCK_C | dz TILES | dz warps | bwd ms | vs default | rel-RMS dx / dw vs default |",
             "|" + "---|" * 11]
    base, rows = None, []
    try:
        for setting in [default] + [s for s in SWEEP if s != default]:
            triton_conv.DZ_LAUNCH.clear()
            triton_conv.DZ_LAUNCH.update(setting)
            got = _conv_backward_op(dy, x, w, pos)
            errs = [rel_rms(a, b) for a, b in zip(got, want)]
            assert max(errs) < 1e-2, (setting, errs)
            ms = median_ms(lambda: _conv_backward_op(dy, x, w, pos))
            base = base or ms
            rows.append({**setting, "bwd_ms": ms, "rel_rms_vs_default": errs})
            lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {shape} | {setting['BLOCK_T']} "
                         f"| {setting['BLOCK_C']} | {setting['TILES']} | {setting['num_warps']} | {ms:.4f} "
                         f"| {base / ms:.2f}x | {errs[0]:.1e} / {errs[1]:.1e} |")
            print(lines[-1], flush=True)
    finally:
        triton_conv.DZ_LAUNCH.clear()
        triton_conv.DZ_LAUNCH.update(default)
    return "\n".join(lines), rows


if __name__ == "__main__":
    raise SystemExit(main())
