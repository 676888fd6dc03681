"""Benchmark: fused linear cross-entropy vs bf16 logits + F.cross_entropy (vocab 163,840).

Forward + backward time (median of `triton.testing.do_bench`) and peak memory
(`torch.cuda.max_memory_allocated` above what was allocated before the call)
for the fused path, the naive path (bf16 logits, `F.cross_entropy`) and the
chunked PyTorch reference, at 32,768 tokens x D 512 x V 163,840 in bf16.
Correctness of each against a float32 reference is checked before timing.
Then: a sweep of the fused chunk size, the Triton row kernel's block / warps,
and a time breakdown of one chunk (matmuls vs the row kernel).

    PYTHONPATH=. python benchmarks/fused_ce.py [--tokens 32768 --dim 512 --vocab 163840] [--out FILE]

Prints a table last and appends a dated Markdown row to the results file.
"""

import argparse
import os

import torch
import torch.nn.functional as F
import triton
import triton.testing

import kernels.fused_ce.ce_rows as ce_rows_module
from benchmarks.common import environment, rel_rms
from kernels.fused_ce import linear_cross_entropy, reference

IGNORE = -100
GiB = 2**30


def naive_bf16(h, weight, targets, ignore_index=IGNORE):
    """The baseline: full bf16 logits and F.cross_entropy, as an eager model would do it."""
    logits = h @ weight.t()
    loss_sum = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return loss_sum, (targets != ignore_index).sum()


def fwd_bwd(fn, h, weight, targets, **kw):
    loss, _ = fn(h, weight, targets, IGNORE, **kw)
    loss.backward()
    return loss


def loss_and_grads(fn, h, weight, targets, **kw):
    h = h.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    loss = fwd_bwd(fn, h, weight, targets, **kw)
    return loss.detach().float(), h.grad, weight.grad


def peak_bytes(fn, h, weight, targets, **kw):
    h.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(fn, h, weight, targets, **kw)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    h.grad = weight.grad = None
    return peak


def time_ms(fn, h, weight, targets, **kw):
    return triton.testing.do_bench(
        lambda: fwd_bwd(fn, h, weight, targets, **kw), warmup=200, rep=1000, grad_to_none=[h, weight],
        return_mode="median",
    )


def sweep_row_kernel(logits_src, targets_C):
    """Time the Triton row kernel alone (loss + in-place gradient) on one chunk per (block, warps).

    Returns [(block, warps, ms)]; the losses must agree across configs (only the summation order differs).
    """
    loss_C = torch.empty(logits_src.shape[0], dtype=torch.float32, device=logits_src.device)
    buf = torch.empty_like(logits_src)
    first_loss = None
    copy_ms = triton.testing.do_bench(lambda: buf.copy_(logits_src), return_mode="median")
    results = []
    for block, warps in ((2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)):
        ce_rows_module.BLOCK_V, ce_rows_module.NUM_WARPS = block, warps

        def run():
            buf.copy_(logits_src)
            ce_rows_module.ce_rows(buf, targets_C, loss_C, IGNORE, True)

        run()
        first_loss = loss_C.clone() if first_loss is None else first_loss
        assert torch.allclose(loss_C, first_loss, rtol=1e-5, atol=1e-5), (block, warps)
        ms = triton.testing.do_bench(run, return_mode="median") - copy_ms
        results.append((block, warps, ms))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--out", default="benchmarks/results/fused_ce.md")
    args = parser.parse_args()
    n, d, v = args.tokens, args.dim, args.vocab
    dev = "cuda"
    torch.manual_seed(0)
    h = torch.randn(n, d, device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(v, d, device=dev) / d**0.5).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=dev)
    targets[::13] = IGNORE

    # The row kernel's launch config first, on one 4096-row chunk, so the fused timings use the best.
    c = 4096
    hc = h[:c]
    logits = hc @ weight.t()
    sweep = sweep_row_kernel(logits, targets[:c].contiguous())
    chunk_bytes = c * v * 2
    for block, warps, ms in sweep:
        print(f"row kernel block {block} warps {warps}: {ms:.3f} ms "
              f"({3 * chunk_bytes / ms / 1e6:.0f} GB/s counting 2 reads + 1 write)", flush=True)
    block, warps, _ = min(sweep, key=lambda r: r[2])
    ce_rows_module.BLOCK_V, ce_rows_module.NUM_WARPS = block, warps
    best_row_kernel = f"block {block}, {warps} warps"
    print(f"chosen row kernel: {best_row_kernel}", flush=True)

    # Breakdown of the same chunk: the three matmuls.
    gw32 = torch.zeros(v, d, device=dev)
    t_logits = triton.testing.do_bench(lambda: torch.mm(hc, weight.t(), out=logits), return_mode="median")
    t_dh = triton.testing.do_bench(lambda: torch.mm(logits, weight, out_dtype=torch.float32), return_mode="median")
    t_dw = triton.testing.do_bench(
        lambda: torch.addmm(gw32, logits.t(), hc, out_dtype=torch.float32, out=gw32), return_mode="median"
    )
    flop = 2 * c * v * d
    print(f"chunk {c}: logits mm {t_logits:.3f} ms ({flop / t_logits / 1e9:.0f} TFLOP/s), "
          f"dH mm {t_dh:.3f} ms ({flop / t_dh / 1e9:.0f}), dW addmm {t_dw:.3f} ms ({flop / t_dw / 1e9:.0f})", flush=True)
    del logits, gw32

    # Correct first: every version against a float32 reference on the same (bf16-valued) inputs.
    ref_loss, ref_gh, ref_gw = loss_and_grads(reference.linear_cross_entropy, h.float(), weight.float(), targets)
    variants = {
        "fused (ours)": (linear_cross_entropy, {}),
        "bf16 logits + F.cross_entropy": (naive_bf16, {}),
        "chunked PyTorch reference": (reference.linear_cross_entropy, {}),
    }
    errors = {}
    for name, (fn, kw) in variants.items():
        loss, gh, gw = loss_and_grads(fn, h, weight, targets, **kw)
        errors[name] = (abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), rel_rms(gh, ref_gh), rel_rms(gw, ref_gw))
        print(f"check {name}: loss rel err {errors[name][0]:.2e}, dH rel rms {errors[name][1]:.2e}, "
              f"dW rel rms {errors[name][2]:.2e}", flush=True)
        assert errors[name][0] < 5e-3 and errors[name][1] < 2e-2 and errors[name][2] < 2e-2, name
    del ref_gh, ref_gw

    h.requires_grad_(True)
    weight.requires_grad_(True)
    rows = {}
    for name, (fn, kw) in variants.items():
        mem = peak_bytes(fn, h, weight, targets, **kw)
        ms = time_ms(fn, h, weight, targets, **kw)
        rows[name] = (ms, mem)
        print(f"time {name}: {ms:.2f} ms, peak {mem / GiB:.2f} GiB", flush=True)

    # Where the fused peak sits: after the forward alone (grads held) vs the whole step.
    h.grad = weight.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, _ = linear_cross_entropy(h, weight, targets, IGNORE)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    torch.cuda.synchronize()
    print(f"fused peak in forward {fwd_peak / GiB:.3f} GiB, held after forward {held / GiB:.3f} GiB, "
          f"whole step {(torch.cuda.max_memory_allocated() - base) / GiB:.3f} GiB", flush=True)
    del loss
    h.grad = weight.grad = None

    # Chunk-size sweep of the fused path.
    chunk_rows = {}
    for c in (2048, 4096, 8192, 16384):
        chunk_rows[c] = (time_ms(linear_cross_entropy, h, weight, targets, chunk_rows=c),
                         peak_bytes(linear_cross_entropy, h, weight, targets, chunk_rows=c))
        print(f"fused chunk_rows={c}: {chunk_rows[c][0]:.2f} ms, peak {chunk_rows[c][1] / GiB:.2f} GiB", flush=True)

    fused_ms, fused_mem = rows["fused (ours)"]
    naive_ms, naive_mem = rows["bf16 logits + F.cross_entropy"]
    ref_ms, ref_mem = rows["chunked PyTorch reference"]
    matmul_floor_ms = 3 * 2 * n * v * d / 790e12 * 1e3
    env = environment()
    shape = f"N{n} D{d} V{v} bf16"
    speedup = naive_ms / fused_ms
    mem_ratio = fused_mem / naive_mem
    row = (
        f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {shape} "
        f"| {fused_ms:.2f} | {n / fused_ms / 1e3:.2f}M | {fused_mem / GiB:.2f} "
        f"| {naive_ms:.2f} | {naive_mem / GiB:.2f} | {ref_ms:.2f} | {ref_mem / GiB:.2f} "
        f"| {speedup:.2f}x | {mem_ratio:.3f} |"
    )
    header = (
        "| date | commit | GPU | torch | triton | shape | fused fwd+bwd ms | fused tok/s | fused peak GiB "
        "| bf16 logits + F.cross_entropy ms | its peak GiB | chunked reference ms | its peak GiB "
        "| speedup vs F.cross_entropy | peak memory ratio |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    new = not os.path.exists(args.out)
    with open(args.out, "a") as f:
        if new:
            f.write("# Fused linear cross-entropy (fwd+bwd), vocab 163,840\n\n" + header)
        f.write(row + "\n")

    print()
    print(f"{'version':34s} {'fwd+bwd ms':>10s} {'peak GiB':>9s} {'loss err':>9s} {'dH rms':>9s} {'dW rms':>9s}")
    for name, (ms, mem) in rows.items():
        e = errors[name]
        print(f"{name:34s} {ms:10.2f} {mem / GiB:9.2f} {e[0]:9.1e} {e[1]:9.1e} {e[2]:9.1e}")
    print(f"three-matmul floor at 790 TFLOP/s: {matmul_floor_ms:.2f} ms; row kernel: {best_row_kernel}")
    print(f"fused vs F.cross_entropy: {speedup:.2f}x faster, {mem_ratio:.3f} of its peak memory")
    print(row)


if __name__ == "__main__":
    main()
