"""Routed-expert block (permute, gather, SiTU-GLU experts, combine), forward + backward, on one GPU.

Side by side, in one run, at each shape:
  ours          kernels.grouped_gemm.moe_experts (Triton, fused)
  _grouped_mm   the same block on torch._grouped_mm: same sync-free permutation,
                row gather, eager float32 SiTU-GLU, index-gather combine
  _grouped_mm+c the same with the SiTU-GLU under torch.compile (a stronger peer)
  loop          a Python loop over experts (kernels.grouped_gemm.reference)
plus plain grouped_mm forward vs torch._grouped_mm. Every variant is checked
against the float32 reference (relative RMS error) before it is timed.

With --ep N it times ours instead as one rank of N-way expert parallelism
sees the block (the group's N*T tokens, E/N local experts, every slot routed
elsewhere carrying the id E/N) against the whole block on one GPU, with the
same (token, expert) rows to compute: what EP's shape costs the kernels.

With --master-weights it times ours instead with float32 master weights (the
trainer's single-GPU case): cast by a pass each forward (the default), or
rounded tile by tile in the GEMMs (`cast_in_kernel`, kernels.experts_cast_in_kernel),
against bf16 weights (no cast at all, the floor), each checked first.

    python benchmarks/moe.py [--shapes k3-mini,e64] [--profile] [--ep 2 | --master-weights]

Prints a table and appends dated rows to benchmarks/results/moe.md.
"""

import argparse
import os
import sys

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, print_cuda_profile, rel_rms  # noqa: E402
from kernels.grouped_gemm import grouped_mm, moe_experts, reference, route_permutation, situ_glu  # noqa: E402

SHAPES = {
    # name: (tokens T, top-k, experts E, latent L, hidden F)
    "k3-mini": (32768, 6, 176, 256, 544),
    "e64": (32768, 6, 64, 1024, 256),
}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "moe.md")


def make_inputs(n_tokens, top_k, n_experts, latent, hidden):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n_tokens, latent, generator=gen, device="cuda")
    w1 = torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") / latent**0.5
    w3 = torch.randn(n_experts, latent, hidden, generator=gen, device="cuda") * 8 / latent**0.5
    w2 = torch.randn(n_experts, hidden, latent, generator=gen, device="cuda") / hidden**0.5
    scores = torch.rand(n_tokens, n_experts, generator=gen, device="cuda")
    top, idx = scores.topk(top_k, dim=1)
    prob = top / top.sum(dim=1, keepdim=True)
    dy = torch.randn(n_tokens, latent, generator=gen, device="cuda")
    return [t.bfloat16() for t in (x, w1, w3, w2)] + [idx, prob.bfloat16(), dy.bfloat16()]


def ep_inputs(shape, ep):
    """One EP rank's view: ep*T tokens routed over all E experts, of which it holds the first E/ep; a slot routed
    to another rank's expert carries the id E/ep (no GEMM work, a zero row)."""
    n_tokens, top_k, n_experts, latent, hidden = shape
    x, w1, w3, w2, idx, prob, dy = make_inputs(n_tokens * ep, top_k, n_experts, latent, hidden)
    local = n_experts // ep
    idx = torch.where(idx < local, idx, torch.full_like(idx, local))
    return [x, w1[:local].contiguous(), w3[:local].contiguous(), w2[:local].contiguous(), idx, prob, dy]


def bench_ep(name, shape, ep, profile):
    """ours fwd+bwd on the whole block vs one EP rank's block (same rows to compute); checked first."""
    times = {}
    for label, inputs in (("1 GPU", make_inputs(*shape)), (f"EP{ep} rank", ep_inputs(shape, ep))):
        x, w1, w3, w2, idx, prob, dy = inputs
        ref_in = [t.float().requires_grad_() for t in (x, w1, w3, w2, prob)]
        ref_out = reference.moe_experts(*ref_in[:4], idx, ref_in[4])
        ref_grads = torch.autograd.grad(ref_out, ref_in, dy.float())
        leaves = [t.detach().requires_grad_() for t in (x, w1, w3, w2)] + [idx, prob.detach().requires_grad_()]
        print(f"[{name}] {label}: T={x.shape[0]} E={w1.shape[0]} slots routed here {int((idx < w1.shape[0]).sum())}")
        check("ours", moe_experts, leaves, dy, ref_out, ref_grads)
        del ref_in, ref_grads, ref_out
        grads_of = [t for t in leaves if t.is_floating_point()]
        times[label] = triton.testing.do_bench(fwd_bwd(moe_experts, leaves, dy), grad_to_none=grads_of, rep=500)
        if profile:
            profile_ours(moe_experts, leaves, dy)
    return times


EP_HEADER = ("| date | commit | GPU | torch | triton | shape (bf16, fwd+bwd) | ours, whole block ms "
             "| ours, one EP rank ms | EP rank / whole |")


def ep_table(args, env):
    """--ep: each shape's whole block against one EP rank's, printed and appended to moe.md."""
    lines = []
    for name in args.shapes.split(","):
        t = bench_ep(name, SHAPES[name], args.ep, args.profile)
        whole, rank = t["1 GPU"], t[f"EP{args.ep} rank"]
        lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | "
                     f"{name}, EP{args.ep} | {whole:.3f} | {rank:.3f} | {rank / whole:.2f} |")
    table = EP_HEADER + "\n" + "|---" * (EP_HEADER.count("|") - 1) + "|\n" + "\n".join(lines) + "\n"
    print(table)
    with open(RESULTS, "a") as f:
        f.write(f"\nOne EP rank's block vs the whole block (benchmarks/moe.py --ep {args.ep}):\n\n{table}")


MASTER_HEADER = ("| date | commit | GPU | torch | triton | shape (bf16 x, fwd+bwd) | bf16 weights ms "
                 "| float32 masters, cast pass ms | float32 masters, cast in kernel ms | in kernel / cast pass |")


def master_weights_table(args, env):
    """--master-weights: ours with float32 master weights cast by a pass or in the GEMMs, against bf16 weights."""
    lines = []
    for name in args.shapes.split(","):
        x, w1, w3, w2, idx, prob, dy = make_inputs(*SHAPES[name])
        ref_in = [t.float().requires_grad_() for t in (x, w1, w3, w2, prob)]
        ref_out = reference.moe_experts(*ref_in[:4], idx, ref_in[4])
        ref_grads = torch.autograd.grad(ref_out, ref_in, dy.float())
        del ref_in
        times = {}
        for label, dtype, in_kernel in (("bf16", x.dtype, False), ("cast pass", torch.float32, False),
                                        ("in kernel", torch.float32, True)):
            leaves = ([x.detach().requires_grad_()] + [w.detach().to(dtype).requires_grad_() for w in (w1, w3, w2)]
                      + [idx, prob.detach().requires_grad_()])

            def fn(*inputs, in_kernel=in_kernel):
                return moe_experts(*inputs, cast_in_kernel=in_kernel)

            check(label, fn, leaves, dy, ref_out, ref_grads)
            grads_of = [t for t in leaves if t.is_floating_point()]
            times[label] = triton.testing.do_bench(fwd_bwd(fn, leaves, dy), grad_to_none=grads_of, rep=500)
            if args.profile:
                profile_ours(fn, leaves, dy)
        lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {name} "
                     f"| {times['bf16']:.3f} | {times['cast pass']:.3f} | {times['in kernel']:.3f} "
                     f"| {times['in kernel'] / times['cast pass']:.2f} |")
    table = MASTER_HEADER + "\n" + "|---" * (MASTER_HEADER.count("|") - 1) + "|\n" + "\n".join(lines) + "\n"
    print(table)
    with open(RESULTS, "a") as f:
        f.write(f"\nfloat32 master weights: a cast pass or the cast in the GEMMs (benchmarks/moe.py --master-weights):"
                f"\n\n{table}")


def column_major(w):
    """Same values, stored [E, M, K] and viewed [E, K, M]: torch._grouped_mm's fast layout for mat_b."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def grouped_mm_block(glu):
    """The expert block on torch._grouped_mm with the same sync-free permutation as ours."""

    def block(x, w1, w3, w2, idx, prob):
        n_tokens, top_k = idx.shape
        order, offsets = route_permutation(idx, w1.shape[0])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        x_s = x[order // top_k]
        g = torch._grouped_mm(x_s, w1, offs=offsets)
        u = torch._grouped_mm(x_s, w3, offs=offsets)
        out = torch._grouped_mm(glu(g, u).to(x.dtype), w2, offs=offsets)
        out = out[inverse].view(n_tokens, top_k, -1).float()
        return (out * prob.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)

    return block


def fwd_bwd(fn, inputs, dy):
    def run():
        fn(*inputs).backward(dy)

    return run


def check(name, fn, inputs, dy, ref_out, ref_grads):
    params = [t for t in inputs if t.is_floating_point()]
    y = fn(*inputs)
    grads = torch.autograd.grad(y, params, dy)
    errs = [rel_rms(y, ref_out)] + [rel_rms(g, r) for g, r in zip(grads, ref_grads)]
    worst = max(errs)
    print(f"  {name:14s} rel-RMS vs fp32: y {errs[0]:.2e}, grads(x,w1,w3,w2,p) " + " ".join(f"{e:.1e}" for e in errs[1:]))
    if not worst < 2e-2:
        raise SystemExit(f"{name} is wrong at this shape (rel-RMS {worst:.3e}); not timing it")


def bench_shape(name, shape, profile):
    n_tokens, top_k, n_experts, latent, hidden = shape
    x, w1, w3, w2, idx, prob, dy = make_inputs(*shape)
    ref_in = [t.float().requires_grad_() for t in (x, w1, w3, w2, prob)]
    ref_out = reference.moe_experts(*ref_in[:4], idx, ref_in[4])
    ref_grads = torch.autograd.grad(ref_out, ref_in, dy.float())
    del ref_in

    def leaves(w_layout=lambda w: w):
        ws = [w_layout(w) for w in (w1, w3, w2)]
        return [t.detach().requires_grad_() for t in (x, *ws)] + [idx, prob.detach().requires_grad_()]

    compiled_glu = torch.compile(situ_glu)
    variants = [
        ("ours", moe_experts, leaves()),
        ("_grouped_mm", grouped_mm_block(situ_glu), leaves(column_major)),
        ("_grouped_mm+c", grouped_mm_block(compiled_glu), leaves(column_major)),
        ("loop", reference.moe_experts, leaves()),
    ]
    print(f"[{name}] T={n_tokens} k={top_k} E={n_experts} L={latent} F={hidden} bf16")
    for vname, fn, inputs in variants:
        check(vname, fn, inputs, dy, ref_out, ref_grads)
    flops = 3 * 2 * n_tokens * top_k * latent * hidden * 3  # three GEMMs, fwd + 2x bwd
    times = {}
    for vname, fn, inputs in variants:
        grads_of = [t for t in inputs if t.is_floating_point()]
        reps = 20 if vname == "loop" else 100
        times[vname] = triton.testing.do_bench(fwd_bwd(fn, inputs, dy), grad_to_none=grads_of, rep=reps * 5)
    # plain grouped GEMM forward: the sorted rows through the first expert GEMM.
    order, offsets = route_permutation(idx, n_experts)
    x_s = x[order // top_k].contiguous()
    w1_cm = column_major(w1)
    err = rel_rms(grouped_mm(x_s, w1, offsets), reference.grouped_mm(x_s.float(), w1.float(), offsets))
    print(f"  grouped_mm fwd rel-RMS vs fp32 {err:.2e}")
    assert err < 2e-2
    t_mm = triton.testing.do_bench(lambda: grouped_mm(x_s, w1, offsets))
    t_tmm = triton.testing.do_bench(lambda: torch._grouped_mm(x_s, w1_cm, offs=offsets))
    if profile:
        profile_ours(variants[0][1], variants[0][2], dy)
    return {
        "shape": f"T{n_tokens} k{top_k} E{n_experts} L{latent} F{hidden}",
        "times": times,
        "tflops": flops / times["ours"] / 1e9,
        "mm": (t_mm, t_tmm, 2 * x_s.shape[0] * latent * hidden / t_mm / 1e9),
    }


def profile_ours(fn, inputs, dy):
    print_cuda_profile(fwd_bwd(fn, inputs, dy), row_limit=15)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--profile", action="store_true", help="print a per-kernel table of ours")
    parser.add_argument("--ep", type=int, default=0, help="time ours as one rank of this many-way EP sees the block")
    parser.add_argument("--master-weights", action="store_true",
                        help="time ours with float32 master weights, cast by a pass or in the GEMMs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe.py needs a CUDA GPU")
    env = environment()
    if args.ep:
        return ep_table(args, env)
    if args.master_weights:
        return master_weights_table(args, env)
    rows = [bench_shape(name, SHAPES[name], args.profile) for name in args.shapes.split(",")]
    header = (
        "| date | commit | GPU | torch | triton | shape (bf16, fwd+bwd) | ours ms | TFLOP/s | _grouped_mm ms "
        "| _grouped_mm+compiled GLU ms | loop ms | vs _grouped_mm | vs +compiled | vs loop "
        "| grouped_mm fwd ms (ours / torch) | ratio |"
    )
    lines = []
    for r in rows:
        t = r["times"]
        t_mm, t_tmm, _ = r["mm"]
        lines.append(
            f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {r['shape']} "
            f"| {t['ours']:.3f} | {r['tflops']:.0f} | {t['_grouped_mm']:.3f} | {t['_grouped_mm+c']:.3f} | {t['loop']:.2f} "
            f"| {t['_grouped_mm'] / t['ours']:.2f}x | {t['_grouped_mm+c'] / t['ours']:.2f}x | {t['loop'] / t['ours']:.1f}x "
            f"| {t_mm:.3f} / {t_tmm:.3f} | {t_tmm / t_mm:.2f}x |"
        )
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    new_file = not os.path.exists(RESULTS)
    with open(RESULTS, "a") as f:
        if new_file:
            f.write("# Routed-expert block: fwd+bwd medians (triton.testing.do_bench)\n\n")
            f.write(header + "\n" + "|---" * (header.count("|") - 1) + "|\n")
        f.write("\n".join(lines) + "\n")
    print(header)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
