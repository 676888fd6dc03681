"""MLA attention at the k3-mini shape: which SDPA backend (and head-dim layout) runs forward + backward fastest.

    PYTHONPATH=. python benchmarks/attention.py --out OUTDIR [--batch 8 --seq 4096 --tables causal documents]

MLA's queries and keys are 192 wide (128 no-PE + 64 RoPE) and its values 128.
Timed variants, bf16, forward and forward + backward (median of
`triton.testing.do_bench`), in two tables.

causal: cuDNN and memory-efficient attention as the model calls them (value
width 128), and cuDNN and flash with the values zero-padded to 192 (flash needs
equal widths; the padded output columns are dropped). "model layout" runs on
the strides the model hands it (transposed views of [B, T, H, d] projections)
instead of contiguous [B, H, T, d] tensors. Checked against cuDNN's output and
gradients before timing.

documents: packed documents as the loader makes them (lengths uniform in
200..3000 from a fixed seed, every row restarting with a new document, the
last one cut at the row's end), masked the two ways the model can: SDPA on the
dense [B, 1, T, T] mask (cuDNN and memory-efficient), flex_attention on the
documents' BlockMask (`kernels.attention = flex`) and flash's variable-length
kernel on the boundaries, values padded to 192 (`kernels.attention = varlen`); cuDNN's ragged kernel on the same
boundaries (`aten._cudnn_attention_forward` with cumulative sequence lengths, as nested tensors reach it: no
padding, no dense mask; its backward comes from torch's autograd formula); plain causal cuDNN on the same tensors for
reference, and the per-forward cost of building each mask. Each variant is
checked against SDPA's float32 math path on its own mask before timing.
Appends each table, with ratios to its first row, to OUTDIR/attention.md.
"""

from __future__ import annotations

import argparse
import functools
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
from titan_k3.models.k3.documents import Documents  # noqa: E402
from titan_k3.models.k3.mla import compiled_flex_attention, document_varlen_attention  # noqa: E402

DOC_LENGTHS = (200, 3000)
"""Document lengths of the documents table, uniform in this closed range (tokens)."""


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


def packed_boundaries(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """cu_seqlens int64 [N+1] on the host: per row, lengths uniform in DOC_LENGTHS until the row is full."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for row in range(batch):
        end = (row + 1) * seq
        while cu[-1] < end:
            n = int(torch.randint(DOC_LENGTHS[0], DOC_LENGTHS[1] + 1, (1,), generator=gen))
            cu.append(min(cu[-1] + n, end))
    return torch.tensor(cu, dtype=torch.int64)


def sdpa(q, k, v, backend: SDPBackend, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA [B, H, T, d] with one backend: the dense bool mask, or causal when mask is None."""
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=q.shape[-1] ** -0.5)


def time_variants(variants: dict, inputs: dict, references: dict) -> list[dict]:
    """variants: name -> (fn(q, k, v), input layout, reference key); each checked against its reference, then timed.

    references: key -> (o, dq, dk, dv), or None: the first variant that runs becomes that reference.
    """
    rows = []
    for name, (fn, layout, ref_key) in variants.items():
        qkv, g_out = inputs[layout]
        try:
            o = fn(*qkv)
            grads = torch.autograd.grad(o, qkv, g_out)
        except Exception as e:  # a backend that refuses this shape (or fails to compile it) is a result, not a crash
            rows.append(dict(variant=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            print(rows[-1], flush=True)
            continue
        if references[ref_key] is None:
            references[ref_key] = (o, *grads)
        err = max(rel_rms(x, r) for x, r in zip((o, *grads), references[ref_key]))

        def fwd(fn=fn, qkv=qkv):
            with torch.no_grad():
                fn(*qkv)

        def fwd_bwd(fn=fn, qkv=qkv, g_out=g_out):
            torch.autograd.grad(fn(*qkv), qkv, g_out)

        rows.append(dict(variant=name, fwd_ms=triton.testing.do_bench(fwd, return_mode="median"),
                         fwd_bwd_ms=triton.testing.do_bench(fwd_bwd, return_mode="median"), max_rel_rms=err))
        print(rows[-1], flush=True)
    return rows


def table(title: str, base_name: str, ref_name: str, env: dict, rows: list[dict]) -> list[str]:
    base = next((r["fwd_bwd_ms"] for r in rows if r["variant"] == base_name and "fwd_bwd_ms" in r), None)
    header = f"| date | commit | GPU | torch | variant | fwd ms | fwd+bwd ms | vs {base_name} (fwd+bwd) | max rel. RMS vs {ref_name} |"
    lines = [title, header, "|---|---|---|---|---|---|---|---|---|"]
    head = f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} |"
    for r in rows:
        if "error" in r:
            lines.append(f"{head} {r['variant']} | — | — | — | {r['error']} |")
        elif "fwd_bwd_ms" not in r:
            lines.append(f"{head} {r['variant']} | {r['fwd_ms']:.3f} | — | — | — |")
        else:
            ratio = f"{base / r['fwd_bwd_ms']:.2f}x" if base else "—"
            lines.append(f"{head} {r['variant']} | {r['fwd_ms']:.3f} | {r['fwd_bwd_ms']:.3f} | {ratio} | {r['max_rel_rms']:.1e} |")
    return lines


def causal_table(B: int, T: int, H: int, inputs: dict, env: dict) -> tuple[list[dict], list[str]]:
    """The causal backends, and flex on a causal BlockMask, checked against cuDNN."""
    (q, _, v), _ = inputs["contiguous"]
    block_mask = Documents.build(B, T, None, torch.device("cuda")).block_mask()

    def flex(q, k, v):
        return compiled_flex_attention(q, k, v, block_mask=block_mask, scale=q.shape[-1] ** -0.5)

    variants = {name: (functools.partial(attend, backend=backend, pad_v=pad_v),
                       "model" if name.endswith("model layout") else "contiguous", "cudnn")
                for name, (backend, pad_v) in VARIANTS.items()}
    variants["flex, causal BlockMask"] = (flex, "contiguous", "cudnn")
    rows = [dict(env, **r) for r in time_variants(variants, inputs, {"cudnn": None})]
    title = f"\n### MLA attention, B{B} T{T} H{H}, qk {q.shape[-1]} / v {v.shape[-1]}, causal, bf16"
    return rows, table(title, "cudnn", "cuDNN", env, rows)


def documents_table(B: int, T: int, H: int, inputs: dict, env: dict) -> tuple[list[dict], list[str]]:
    """Packed documents: dense-mask SDPA against flex_attention on the BlockMask and flash's variable-length kernel
    on the boundaries, checked against float32 math."""
    cu = packed_boundaries(B, T)
    docs = Documents.build(B, T, cu, torch.device("cuda"))
    mask, block_mask = docs.attention_mask(), docs.block_mask()
    (q, k, v), do = inputs["contiguous"]
    scale = q.shape[-1] ** -0.5

    def math_reference(m):
        leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
        with sdpa_kernel([SDPBackend.MATH]):
            o = F.scaled_dot_product_attention(*leaves, attn_mask=m, is_causal=m is None, scale=scale)
        return (o, *torch.autograd.grad(o, leaves, do.float()))

    def flex(q, k, v):
        return compiled_flex_attention(q, k, v, block_mask=block_mask, scale=scale)

    def varlen(q, k, v):
        return document_varlen_attention(q, k, v, docs.cu_seqlens_i32, scale)

    def cudnn_ragged(q, k, v):
        def rows(t):  # [B, H, T, d] -> token-major [B*T, H, d]
            return t.transpose(1, 2).reshape(B * T, H, t.shape[-1])

        o = torch.ops.aten._cudnn_attention_forward(rows(q), rows(k), rows(v), None, docs.cu_seqlens_i32,
                                                    docs.cu_seqlens_i32, T, T, True, 0.0, True, False, scale=scale)[0]
        return o.view(B, T, H, -1).transpose(1, 2)

    references = {"documents": math_reference(mask), "causal": math_reference(None)}
    cudnn, efficient = (functools.partial(sdpa, backend=b, mask=mask)
                        for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION))
    variants = {
        "dense mask, cudnn": (cudnn, "contiguous", "documents"),
        "dense mask, cudnn, model layout": (cudnn, "model", "documents"),
        "dense mask, efficient": (efficient, "contiguous", "documents"),
        "flex, BlockMask": (flex, "contiguous", "documents"),
        "flex, BlockMask, model layout": (flex, "model", "documents"),
        "flash varlen, v padded": (varlen, "contiguous", "documents"),
        "flash varlen, v padded, model layout": (varlen, "model", "documents"),
        "cudnn ragged": (cudnn_ragged, "contiguous", "documents"),
        "causal cudnn, no documents (reference)": (functools.partial(sdpa, backend=SDPBackend.CUDNN_ATTENTION, mask=None),
                                                   "contiguous", "causal"),
    }
    rows = time_variants(variants, inputs, references)
    # What each mask costs to build, once per forward (eager; a compiled sublayer builds it inside its graph).
    for method in ("attention_mask", "block_mask"):
        def build(method=method):
            getattr(Documents.build(B, T, cu, torch.device("cuda")), method)()

        ms = triton.testing.do_bench(build, return_mode="median")
        rows.append(dict(variant=f"Documents.build + {method}()", fwd_ms=ms))
        print(rows[-1], flush=True)
    rows = [dict(env, **r) for r in rows]
    lengths = (cu[1:] - cu[:-1]).double()
    kept = sum(int(n.sum()) for n in (block_mask.kv_num_blocks, block_mask.full_kv_num_blocks) if n is not None)
    n_blocks = -(-T // block_mask.BLOCK_SIZE[0])
    causal_blocks = B * n_blocks * (n_blocks + 1) // 2
    title = (f"\n### MLA attention, B{B} T{T} H{H}, qk {q.shape[-1]} / v {v.shape[-1]}, packed documents, bf16\n"
             f"{len(lengths)} documents, lengths uniform in {DOC_LENGTHS[0]}..{DOC_LENGTHS[1]} (seed 0, cut at row ends; "
             f"mean {lengths.mean():.0f}); the BlockMask computes {kept} of the {causal_blocks} causal "
             f"{block_mask.BLOCK_SIZE[0]}x{block_mask.BLOCK_SIZE[1]} blocks ({kept / causal_blocks:.0%}).\n")
    return rows, table(title, "dense mask, cudnn", "float32 math, same mask", env, rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--tables", nargs="+", choices=["causal", "documents"], default=["causal", "documents"])
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
    inputs = {"contiguous": ((q, k, v), do), "model": ((qm, km, vm), dom)}
    env, rows, lines = environment(), [], []
    if "causal" in args.tables:
        r, t = causal_table(B, T, H, inputs, env)
        rows, lines = rows + r, lines + t
    if "documents" in args.tables:
        r, t = documents_table(B, T, H, inputs, env)
        rows, lines = rows + r, lines + t
    write_results(args.out, "attention", "\n".join(lines), env, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
