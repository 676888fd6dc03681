"""MLA attention at the k3-mini shape: which SDPA backend (and head-dim layout) runs forward + backward fastest.

    PYTHONPATH=. python benchmarks/attention.py --out OUTDIR [--batch 8 --seq 4096]

MLA's queries and keys are 192 wide (128 no-PE + 64 RoPE) and its values 128.
Timed variants, each causal, bf16, forward and forward + backward (median of
`triton.testing.do_bench`): cuDNN and memory-efficient attention as the model
calls them (value width 128), and cuDNN and flash with the values zero-padded
to 192 (flash needs equal widths; the padded output columns are dropped).
"model layout" runs cuDNN on the strides the model hands it (transposed views
of [B, T, H, d] projections) instead of contiguous [B, H, T, d] tensors.
Every variant's output and gradients are checked against cuDNN's before it is
timed. Appends a table with ratios to the cuDNN row to OUTDIR/attention.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, rel_rms, write_results  # noqa: E402
from titan_k3.models.k3.args import get_flavor  # noqa: E402


def attend(q, k, v, backend: SDPBackend, pad_v: bool) -> torch.Tensor:
    """Causal SDPA [B, H, T, d] with one backend; pad_v: values zero-padded to the query width."""
    dv = v.shape[-1]
    if pad_v:
        v = F.pad(v, (0, q.shape[-1] - dv))
    with sdpa_kernel([backend]):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)
    return o[..., :dv]


VARIANTS = {
    "cudnn": (SDPBackend.CUDNN_ATTENTION, False),
    "cudnn, model layout": (SDPBackend.CUDNN_ATTENTION, False),
    "efficient": (SDPBackend.EFFICIENT_ATTENTION, False),
    "cudnn, v padded": (SDPBackend.CUDNN_ATTENTION, True),
    "flash, v padded": (SDPBackend.FLASH_ATTENTION, True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention.py needs a CUDA GPU")
        return 1
    a = get_flavor("k3-mini")
    B, T, H = args.batch, args.seq, a.mla_heads
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(d):
        return torch.randn(B, H, T, d, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)

    q, k, v = leaf(a.qk_nope_dim + a.qk_rope_dim), leaf(a.qk_nope_dim + a.qk_rope_dim), leaf(a.v_head_dim)
    do = torch.randn(B, H, T, a.v_head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    # The model's layout: q, k, v are [B, T, H, d] projections seen as [B, H, T, d] (transposed views, v a
    # slice of the key-value projection); the gradient of o arrives transposed the same way.
    qm, km = (x.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for x in (q, k))
    kv = torch.cat([k.detach()[..., : a.qk_nope_dim], v.detach()], dim=-1).transpose(1, 2).contiguous()
    vm = kv.transpose(1, 2)[..., a.qk_nope_dim :].detach().requires_grad_(True)
    dom = do.transpose(1, 2).contiguous().transpose(1, 2)
    env, rows, ref = environment(), [], None
    for name, (backend, pad_v) in VARIANTS.items():
        model_layout = name.endswith("model layout")
        qkv, g_out = ((qm, km, vm), dom) if model_layout else ((q, k, v), do)
        try:
            o = attend(*qkv, backend, pad_v)
            grads = torch.autograd.grad(o, qkv, g_out)
        except RuntimeError as e:  # a backend that refuses this shape is a result, not a crash
            rows.append(dict(env, variant=name, error=str(e).splitlines()[0][:120]))
            continue
        outs = (o, *grads)
        if ref is None:
            ref = outs
        err = max(rel_rms(x, r) for x, r in zip(outs, ref))

        def fwd(qkv=qkv, backend=backend, pad_v=pad_v):
            with torch.no_grad():
                attend(*qkv, backend, pad_v)

        def fwd_bwd(qkv=qkv, g_out=g_out, backend=backend, pad_v=pad_v):
            torch.autograd.grad(attend(*qkv, backend, pad_v), qkv, g_out)

        rows.append(dict(env, variant=name, fwd_ms=triton.testing.do_bench(fwd, return_mode="median"),
                         fwd_bwd_ms=triton.testing.do_bench(fwd_bwd, return_mode="median"), max_rel_rms=err))
        print(rows[-1], flush=True)
    base = next((r["fwd_bwd_ms"] for r in rows if r["variant"] == "cudnn" and "fwd_bwd_ms" in r), None)
    lines = [f"\n### MLA attention, B{B} T{T} H{H}, qk {q.shape[-1]} / v {a.v_head_dim}, causal, bf16",
             "| date | commit | GPU | torch | variant | fwd ms | fwd+bwd ms | vs cuDNN (fwd+bwd) | max rel. RMS vs cuDNN |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['variant']} | — | — | — | {r['error']} |")
        else:
            ratio = f"{base / r['fwd_bwd_ms']:.2f}x" if base else "—"
            lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['variant']} | {r['fwd_ms']:.3f} | "
                         f"{r['fwd_bwd_ms']:.3f} | {ratio} | {r['max_rel_rms']:.1e} |")
    write_results(args.out, "attention", "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
