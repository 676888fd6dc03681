"""Benchmark: fused linear cross-entropy vs bf16 logits + F.cross_entropy (vocab 163,840).

Forward + backward time (median of `triton.testing.do_bench`) and peak memory
(`torch.cuda.max_memory_allocated` above what was allocated before the call)
for the fused path, the naive path (bf16 logits, `F.cross_entropy`) and the
chunked PyTorch reference, at 32,768 tokens x D 512 x V 163,840 in bf16.
Correctness of each against a float32 reference is checked before timing.
Then: a sweep of the fused chunk size, the Triton row kernel's launches, and a
time breakdown of one chunk (matmuls vs the row kernel). `--rows-launch` runs
only the row kernel's launches that read its second pass from L2 (kernels/fused_ce/ce_rows.py
RowsLaunch) against one program per row, each twice in turn. `--one-pass` runs only
the one-pass row kernel's launches (kernels/fused_ce/ce_one_pass.py, with the two row
scalings it adds to the gradient products) against the two-pass kernel's default launch.

    PYTHONPATH=. python benchmarks/fused_ce.py [--tokens 32768 --dim 512 --vocab 163840] [--out FILE]
        [--rows-launch | --one-pass]

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
from kernels.fused_ce.ce_one_pass import ce_rows_one_pass
from kernels.fused_ce.ce_rows import RowsLaunch, ce_rows

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


ROW_LAUNCHES = {
    # The kernel's default launch (one program per SM looping over the rows, the second pass backwards), then the
    # sweep of one program per row (session 1's table); the fused timings below run the fastest.
    "default (one per SM, backwards)": ce_rows_module.LAUNCH,
    "block 2048, 4 warps": RowsLaunch(2048, 4),
    "block 4096, 8 warps (before session 44)": RowsLaunch(),
    "block 8192, 8 warps": RowsLaunch(8192, 8),
    "block 8192, 16 warps": RowsLaunch(8192, 16),
    "block 16384, 16 warps": RowsLaunch(16384, 16),
}
L2_LAUNCHES = {
    # The second read from L2: one program per row keeps ~1,000 rows (~330 MB at V 163,840) in flight, far more
    # than L2's 50 MB, so it reads every row twice from HBM. A few programs per SM hold fewer rows in flight;
    # walking the second pass backwards starts it on what the first pass read last; prefetching keeps two steps
    # in flight per program, which the lost parallelism needs; the hints ask L2 to keep the first pass's lines.
    "per row, backwards": RowsLaunch(reverse=True),
    "per row, backwards, prefetch": RowsLaunch(reverse=True, prefetch=True),
    "per row, backwards, hints": RowsLaunch(reverse=True, l2_hints=True),
    **{f"{k}/SM, block {b} x {w} warps, {'backwards' if r else 'forwards'}{', prefetch' if p else ''}{', hints' if h else ''}":
       RowsLaunch(b, w, k, r, p, h)
       for k, b, w, r, p, h in (
           (1, 16384, 16, False, True, False),
           (1, 16384, 16, True, True, False),
           (1, 16384, 16, True, True, True),
           (1, 8192, 16, True, True, True),
           (2, 8192, 8, True, True, False),
           (2, 8192, 8, True, True, True),
           (2, 16384, 16, True, True, True),
           (2, 4096, 8, True, True, True),
           (4, 4096, 8, True, True, True),
           (4, 4096, 8, True, False, True),
           # Around session 44's fastest (2/SM, 16,384 x 16 warps, backwards, prefetch, hints): each of its
           # choices undone alone, and its neighbours in block, warps and programs.
           (2, 16384, 16, False, True, True),
           (2, 16384, 16, True, False, True),
           (2, 16384, 8, True, True, True),
           (3, 16384, 8, True, True, True),
           (2, 32768, 16, True, True, True),
           (1, 32768, 32, True, True, True),
           (1, 16384, 32, True, True, True),
           # Around session 45's fastest (1/SM, 32,768 x 32 warps, backwards, prefetch, hints): larger steps won,
           # so the next size up, each of its choices undone alone, and two programs per SM of that size.
           (1, 65536, 32, True, True, True),
           (1, 65536, 32, True, False, True),
           (1, 32768, 32, True, False, True),
           (1, 32768, 32, False, True, True),
           (1, 32768, 32, True, True, False),
           (1, 32768, 16, True, True, True),
           (2, 32768, 16, True, False, True),
       )},
}

ONE_PASS_LAUNCHES = {
    # One read and one write of each row, no second pass to keep in L2: so many rows in flight may serve as well
    # as few. The launch's reverse and L2 hints do not apply.
    **{f"{f'{k}/SM' if k else 'per row'}, block {b} x {w} warps{', prefetch' if p else ''}": RowsLaunch(b, w, k, False, p)
       for k, b, w, p in (
           (0, 4096, 8, False),
           (0, 4096, 8, True),
           (0, 16384, 16, True),
           (1, 16384, 16, True),
           (1, 32768, 32, True),
           (1, 32768, 32, False),
           (2, 16384, 16, True),
           (2, 8192, 8, True),
           (4, 4096, 8, True),
       )},
}


def _time_launches(logits_src, buf, launches: dict[str, RowsLaunch], step, check):
    """Per launch: `step(launch)` on a fresh copy of the chunk in `buf`, `check(name)` on its result, then its median
    time less the copy's. Returns [(name, launch, ms)]."""
    copy_ms = triton.testing.do_bench(lambda: buf.copy_(logits_src), return_mode="median")
    results = []
    for name, launch in launches.items():
        def run():
            buf.copy_(logits_src)
            step(launch)

        run()
        check(name)
        results.append((name, launch, triton.testing.do_bench(run, return_mode="median") - copy_ms))
    return results


def sweep_row_kernel(logits_src, targets_C, launches: dict[str, RowsLaunch]):
    """Time the Triton row kernel alone (loss + in-place gradient) on one chunk per launch.

    Returns [(name, launch, ms)]. Each launch's loss must agree with the first's (only the summation order differs),
    and its gradient with the first's to bf16 rounding.
    """
    loss_C = torch.empty(logits_src.shape[0], dtype=torch.float32, device=logits_src.device)
    buf = torch.empty_like(logits_src)
    first = []

    def check(name):
        if not first:
            first.extend((loss_C.clone(), buf.clone()))
        assert torch.allclose(loss_C, first[0], rtol=1e-5, atol=1e-5), name
        assert torch.allclose(buf.float(), first[1].float(), rtol=1e-2, atol=1e-6), name

    return _time_launches(logits_src, buf, launches,
                          lambda launch: ce_rows(buf, targets_C, loss_C, IGNORE, True, launch=launch), check)


def sweep_one_pass(logits_src, targets_C, h_CD, launches: dict[str, RowsLaunch]):
    """Time the one-pass row kernel on one chunk per launch, with the two [C, D] row scalings it adds to the
    gradient products (h's rows in h's dtype, dH's float32 rows).

    Returns [(name, launch, ms)]. Each launch's loss must agree with the two-pass kernel's, and scale * E' with its
    gradient to bf16 rounding.
    """
    rows, dim = h_CD.shape
    f32 = dict(dtype=torch.float32, device=logits_src.device)
    loss_C, scale_C, dh_CD = torch.empty(rows, **f32), torch.empty(rows, **f32), torch.ones(rows, dim, **f32)
    buf = logits_src.clone()
    ce_rows(buf, targets_C, loss_C, IGNORE, True)
    want_loss, want_grad = loss_C.clone(), buf.to(torch.float32, copy=True)

    def step(launch):
        ce_rows_one_pass(buf, targets_C, loss_C, scale_C, IGNORE, launch=launch)
        (h_CD.float() * scale_C[:, None]).to(h_CD.dtype)
        dh_CD.mul_(scale_C[:, None])

    def check(name):
        assert torch.allclose(loss_C, want_loss, rtol=1e-5, atol=1e-5), name
        assert torch.allclose(buf.float() * scale_C[:, None], want_grad, rtol=1e-2, atol=1e-6), name

    return _time_launches(logits_src, buf, launches, step, check)


def _launch_table(logits, flag: str, what: str, runs, base_name: str, passes: int, out: str) -> None:
    """Two runs of a launch sweep on the chunk `logits` as a dated table (ms of both runs, GB/s counting `passes`
    passes over the chunk, the ratio to row `base_name`), printed and appended to `out`; then the fastest launch in
    the form `benchmarks/train_throughput.py --rows-launch` takes."""
    c, v = logits.shape
    chunk_bytes = logits.numel() * logits.element_size()
    title = f"### {what}, one {c}-row chunk of V {v} {str(logits.dtype).removeprefix('torch.')} (`benchmarks/fused_ce.py {flag}`)"
    env = environment()
    lines = ["", title, "",
             f"| date | commit | GPU | torch | triton | launch | ms (two runs) | GB/s ({passes} passes) | vs {base_name} |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = min(r[2] for run in runs for r in run if r[0] == base_name)
    for i, (name, _launch, _) in enumerate(runs[0]):
        ms = [run[i][2] for run in runs]
        best = min(ms)
        lines.append(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {name} "
                     f"| {ms[0]:.3f} / {ms[1]:.3f} | {passes * chunk_bytes / best / 1e6:.0f} | {base / best:.3f}x |")
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    fastest = min(zip(runs[0], runs[1]), key=lambda pair: min(pair[0][2], pair[1][2]))[0][1]
    print("fastest launch:", ",".join(str(int(f)) for f in fastest), flush=True)
    with open(out, "a") as f:
        f.write(text)


def rows_launch_probe(logits, targets_C, out: str) -> None:
    """--rows-launch: every launch of L2_LAUNCHES against one program per row on one chunk, each timed twice in turn (the
    order of a run must not decide), appended to `out` as a dated table."""
    launches = {"per row, block 4096 x 8 warps": RowsLaunch(), **L2_LAUNCHES}
    runs = [sweep_row_kernel(logits, targets_C, launches) for _ in range(2)]
    _launch_table(logits, "--rows-launch", "The row kernel's launch", runs, "per row, block 4096 x 8 warps", 3, out)


def one_pass_probe(logits, targets_C, h_CD, out: str) -> None:
    """--one-pass: the one-pass row kernel at every launch of ONE_PASS_LAUNCHES against the two-pass kernel's default
    launch, each timed twice in turn, appended to `out` as a dated table (GB/s counting one read and one write)."""
    runs = [sweep_row_kernel(logits, targets_C, {"two-pass, default launch": ce_rows_module.LAUNCH})
            + sweep_one_pass(logits, targets_C, h_CD, ONE_PASS_LAUNCHES) for _ in range(2)]
    _launch_table(logits, "--one-pass", "The one-pass row kernel against the two-pass one", runs,
                  "two-pass, default launch", 2, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=163840)
    parser.add_argument("--out", default="benchmarks/results/fused_ce.md")
    probe = parser.add_mutually_exclusive_group()
    probe.add_argument("--rows-launch", action="store_true",
                       help="only the row kernel's launches (L2_LAUNCHES) against one program per row, on one 4096-row chunk")
    probe.add_argument("--one-pass", action="store_true",
                       help="only the one-pass row kernel's launches (ONE_PASS_LAUNCHES) against the two-pass kernel, "
                            "on one 4096-row chunk")
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
    if args.rows_launch:
        rows_launch_probe(logits, targets[:c].contiguous(), args.out)
        return
    if args.one_pass:
        one_pass_probe(logits, targets[:c].contiguous(), hc, args.out)
        return
    sweep = sweep_row_kernel(logits, targets[:c].contiguous(), ROW_LAUNCHES)
    chunk_bytes = c * v * 2
    for name, _, ms in sweep:
        print(f"row kernel {name}: {ms:.3f} ms ({3 * chunk_bytes / ms / 1e6:.0f} GB/s counting 2 reads + 1 write)",
              flush=True)
    best_row_kernel, ce_rows_module.LAUNCH, _ = min(sweep, key=lambda r: r[2])
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
