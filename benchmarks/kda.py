"""Chunked KDA on one GPU: ours (kernels.kda.chunk_kda) vs fla's chunk_kda, forward and forward+backward.

Same run, same inputs, same flags, at each shape and gate:
  plain   g is the precomputed log decay
  safe    the raw gate with the safe gate fused into the kernel: g = -5 sigmoid(exp(A_log) (g_raw + dt_bias))
          (fla: use_gate_in_kernel=True, safe_gate=True, lower_bound=-5)
bf16 inputs, no initial or final state. Ours is checked against fla (relative RMS of
the output and of dq) before it is timed. The first call of ours (safe gate, kernel compilation,
no autotuning) is timed too.

    python benchmarks/kda.py [--shapes b8-t4096-h8,k3-mini,b32-t1024-h8] [--no-fla] [--profile] [--sweep]
                             [--out FILE_OR_FOLDER]

--candidates "kernel.setting=value;..." also times ours under each alternative ops.LAUNCH table in the
same run (rows labelled with it in the gate column), so a launch change and fla share one measurement.
The safe gate's paths are settings too: the default is the exact path; "safe.diag_dot=1;safe.fuse_bwd=1" is
the bounded one (bounded products, fused backward); "dfused.BV=32" and the like tune it.
--profile prints the per-kernel table of ours for the plain and the safe gate (default launch table).
Prints a table and appends dated rows to benchmarks/results/kda.md, or to --out (a folder gets kda.md).
--sweep times ours fwd+bwd with one launch setting of kernels.kda.ops.LAUNCH changed at a time
(plain gate, at each shape) and appends that table to kda-sweep.md beside the results file.
"""

import argparse
import contextlib
import os
import sys
import time

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import environment, print_cuda_profile, rel_rms  # noqa: E402
from kernels.kda import chunk_kda, kda_gate, l2norm, ops  # noqa: E402

SHAPES = {
    # name: (B, T, H, K = V); the two shapes our KDA speed target names come first
    "b8-t4096-h8": (8, 4096, 8, 128),
    "k3-mini": (8, 4096, 4, 128),
    "b32-t1024-h8": (32, 1024, 8, 128),
}
# (kernel, settings changed from kernels.kda.ops.LAUNCH) for --sweep
SWEEP = [
    ("scores", dict(BK=64)), ("scores", dict(num_warps=8)),
    ("solve", dict(num_warps=4)),
    ("wy", dict(num_warps=8)), ("wy", dict(num_stages=3)),
    ("state", dict(BV=32)), ("state", dict(num_warps=4)), ("state", dict(num_stages=1)),
    ("output", dict(num_warps=8)), ("output", dict(num_stages=3)),
    ("dstate", dict(BV=32)), ("dstate", dict(num_stages=1)),
    ("dchunk", dict(BK=128)), ("dchunk", dict(num_warps=4)), ("dchunk", dict(num_stages=1)),
    ("dintra", dict(BK=64)), ("dintra", dict(num_warps=8)),
]
# ops.LAUNCH entries that only the fused safe gate's bounded paths read
SAFE_ONLY = {"safe", "dfused"}
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "kda.md")
LOWER_BOUND = -5.0


def make_inputs(B, T, H, D):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = l2norm(torch.randn(B, T, H, D, device="cuda", generator=gen))
    k = l2norm(torch.randn(B, T, H, D, device="cuda", generator=gen))
    v = torch.randn(B, T, H, D, device="cuda", generator=gen)
    g_raw = torch.randn(B, T, H, D, device="cuda", generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    A_log = torch.zeros(H, device="cuda")
    dt = torch.exp(torch.empty(H, D, device="cuda").uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
    g = kda_gate(g_raw, A_log, dt_bias, None)
    do = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16()
    bf = [x.bfloat16() for x in (q, k, v)]
    return bf, g, g_raw.bfloat16(), beta.bfloat16(), A_log, dt_bias, do


def variants(gate, with_fla):
    """{name: fn(q, k, v, g, beta, A_log, dt_bias) -> o} for one gate."""
    out = {}
    if gate == "plain":
        out["ours"] = lambda q, k, v, g, beta, A_log, dt_bias: chunk_kda(q, k, v, g, beta)[0]
    else:
        out["ours"] = lambda q, k, v, g, beta, A_log, dt_bias: chunk_kda(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, gate_lower_bound=LOWER_BOUND
        )[0]
    if with_fla:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        if gate == "plain":
            out["fla"] = lambda q, k, v, g, beta, A_log, dt_bias: fla_chunk_kda(q, k, v, g, beta)[0]
        else:
            out["fla"] = lambda q, k, v, g, beta, A_log, dt_bias: fla_chunk_kda(
                q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias.reshape(-1), use_gate_in_kernel=True,
                safe_gate=True, lower_bound=LOWER_BOUND,
            )[0]
    return out


def parse_candidate(text):
    """"dintra.BK=64;scores.BK=64" -> {"dintra": {"BK": 64}, "scores": {"BK": 64}} (changes to ops.LAUNCH)."""
    changes = {}
    for item in filter(None, text.split(";")):
        key, value = item.split("=")
        kernel, setting = key.split(".")
        if kernel not in ops.LAUNCH:
            raise SystemExit(f"--candidates {text!r}: no kernel {kernel!r} in kernels.kda.ops.LAUNCH")
        changes.setdefault(kernel, {})[setting] = int(value)
    return changes


@contextlib.contextmanager
def launch_settings(changes):
    """ops.LAUNCH with `changes` applied, forward and backward alike, restored afterwards."""
    kept = {kernel: dict(ops.LAUNCH[kernel]) for kernel in changes}
    for kernel, change in changes.items():
        ops.LAUNCH[kernel] = {**kept[kernel], **change}
    try:
        yield
    finally:
        ops.LAUNCH.update(kept)


def bench_shape(name, shape, with_fla, rep_ms, candidates=()):
    """Rows of one shape: per gate, ours under the defaults and under each candidate launch table, beside fla."""
    B, T, H, D = shape
    (q, k, v), g, g_raw, beta, A_log, dt_bias, do = make_inputs(B, T, H, D)
    all_settings = {"ours": {}, **{f"ours[{c}]": parse_candidate(c) for c in candidates}}
    rows = []
    for gate in ("plain", "safe"):
        # a candidate that changes only the safe gate's paths would time the plain gate's defaults again
        settings = {name: c for name, c in all_settings.items()
                    if name == "ours" or gate == "safe" or not set(c) <= SAFE_ONLY}
        g_in = g if gate == "plain" else g_raw
        fns = variants(gate, with_fla)
        fns.update({vname: fns["ours"] for vname in settings})
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g_in, beta, A_log, dt_bias)]
        outs = {}
        for vname, fn in fns.items():
            with launch_settings(settings.get(vname, {})):
                o = fn(*leaves)
                dq = torch.autograd.grad(o, leaves[0], do)[0]
            outs[vname] = (o, dq)
            assert torch.isfinite(o).all() and torch.isfinite(dq).all(), f"{vname} {gate}: non-finite"
        checks = {}
        if "fla" in outs:
            for vname in settings:
                e_o, e_dq = rel_rms(outs[vname][0], outs["fla"][0]), rel_rms(outs[vname][1], outs["fla"][1])
                checks[vname] = f"o {e_o:.1e}, dq {e_dq:.1e}"
                print(f"  [{name} {gate}] {vname} vs fla rel-RMS: {checks[vname]}")
                if not max(e_o, e_dq) < 3e-2:
                    raise SystemExit(f"{vname} and fla disagree at {name} {gate}; not timing")
        times = {}
        for vname, fn in fns.items():
            with launch_settings(settings.get(vname, {})):
                with torch.no_grad():
                    t_f = triton.testing.do_bench(lambda: fn(q, k, v, g_in, beta, A_log, dt_bias), rep=rep_ms)

                def fwd_bwd():
                    fn(*leaves).backward(do)

                t_fb = triton.testing.do_bench(fwd_bwd, grad_to_none=leaves, rep=rep_ms)
            times[vname] = (t_f, t_fb)
        for vname in settings:
            label = gate if vname == "ours" else f"{gate}, {vname[5:-1]}"
            rows.append(dict(shape=f"B{B} T{T} H{H} K=V={D}", gate=label, times={"ours": times[vname], **(
                {"fla": times["fla"]} if "fla" in times else {})}, check=checks.get(vname, ""), tokens=B * T))
        print(f"  [{name} {gate}] " + ", ".join(f"{n} fwd {t[0]:.3f} ms fwd+bwd {t[1]:.3f} ms" for n, t in times.items()))
    return rows


def first_call_seconds(shape):
    """Wall time of the very first forward+backward in this process (kernel compilation included).

    With the safe gate fused in, as the K3 model calls it (its kernels differ from the plain gate's).
    """
    B, T, H, D = shape
    (q, k, v), _, g_raw, beta, A_log, dt_bias, do = make_inputs(B, T, H, D)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g_raw, beta, A_log, dt_bias)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    variants("safe", with_fla=False)["ours"](*leaves).backward(do)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def profile_ours(shape):
    """Per-kernel CUDA table of ours fwd+bwd, plain gate then safe gate."""
    B, T, H, D = shape
    (q, k, v), g, g_raw, beta, A_log, dt_bias, do = make_inputs(B, T, H, D)
    for gate in ("plain", "safe"):
        leaves = [x.detach().clone().requires_grad_(True)
                  for x in (q, k, v, g if gate == "plain" else g_raw, beta, A_log, dt_bias)]
        fn = variants(gate, with_fla=False)["ours"]
        print(f"profile of ours, {gate} gate, B{B} T{T} H{H} K=V={D}, 5 fwd+bwd:")
        print_cuda_profile(lambda fn=fn, leaves=leaves: fn(*leaves).backward(do), row_limit=20)


def sweep(name, shape, rep_ms):
    """Rows (kernel, change, fwd+bwd ms, ratio to the defaults) with one LAUNCH entry changed at a time."""
    B, T, H, D = shape
    (q, k, v), g, _, beta, _, _, do = make_inputs(B, T, H, D)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta)]

    def fwd_bwd():
        chunk_kda(*leaves)[0].backward(do)

    base = triton.testing.do_bench(fwd_bwd, grad_to_none=leaves, rep=rep_ms)
    print(f"  [sweep {name}] defaults: {base:.3f} ms")
    rows = [("defaults", "", f"{base:.3f}", "1.00x")]
    for kernel, change in SWEEP:
        label = ", ".join(f"{key}={val}" for key, val in change.items())
        try:
            with launch_settings({kernel: change}):
                t = triton.testing.do_bench(fwd_bwd, grad_to_none=leaves, rep=rep_ms)
            rows.append((kernel, label, f"{t:.3f}", f"{base / t:.2f}x"))
        except Exception as e:  # noqa: BLE001 - a setting that cannot launch (e.g. out of shared memory) is a result
            rows.append((kernel, label, "failed", type(e).__name__))
        print(f"  [sweep {name}] {kernel} {label}: {rows[-1][2]} ms")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--no-fla", action="store_true", help="time ours alone (fla-core not installed)")
    parser.add_argument("--profile", action="store_true", help="print a per-kernel table of ours")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time per measurement")
    parser.add_argument("--sweep", action="store_true", help="time one launch setting changed at a time")
    parser.add_argument("--out", default=RESULTS, help="Markdown file for the rows, or a folder (rows go to kda.md)")
    parser.add_argument("--candidates", nargs="*", default=[],
                        help='alternative launch tables timed beside the defaults, e.g. "dintra.BK=64;scores.BK=64"')
    parser.add_argument("--commit", default="", help="commit to record when the tree has no git metadata")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kda.py needs a CUDA GPU")
    out = os.path.join(args.out, "kda.md") if os.path.isdir(args.out) else args.out
    env = environment()
    commit = args.commit or env["commit"]
    names = args.shapes.split(",")
    first = first_call_seconds(SHAPES[names[0]])
    print(f"first call of ours, safe gate (compile, no autotune): {first:.1f} s")
    if args.profile:
        profile_ours(SHAPES[names[0]])
    header = (
        "| date | commit | GPU | torch | triton | shape (bf16) | gate | ours fwd ms | ours fwd+bwd ms "
        "| fwd+bwd Mtok/s | fla fwd ms | fla fwd+bwd ms | fwd ratio | fwd+bwd ratio | ours vs fla rel-RMS | ours first call s |"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if not os.path.exists(out):
        with open(out, "w") as f:
            f.write("# Chunked KDA: medians (triton.testing.do_bench), ratio = fla time / ours\n\n")
            f.write(header + "\n" + "|---" * (header.count("|") - 1) + "|\n")
    print(header)
    # NOTE: rows are appended shape by shape, so a run cut short (fla's first-call autotune is long) keeps what it measured.
    for name in names:
        for r in bench_shape(name, SHAPES[name], not args.no_fla, args.rep_ms, args.candidates):
            of, ofb = r["times"]["ours"]
            ff, ffb = r["times"].get("fla", (float("nan"), float("nan")))
            line = (
                f"| {env['date']} | {commit} | {env['gpu']} | {env['torch']} | {env['triton']} "
                f"| {r['shape']} | {r['gate']} | {of:.3f} | {ofb:.3f} | {r['tokens'] / ofb / 1e3:.2f} | {ff:.3f} "
                f"| {ffb:.3f} | {ff / of:.2f}x | {ffb / ofb:.2f}x | {r['check']} | {first:.1f} |"
            )
            with open(out, "a") as f:
                f.write(line + "\n")
            print(line)
    if args.sweep:
        sweep_out = os.path.join(os.path.dirname(os.path.abspath(out)), "kda-sweep.md")
        for name in names:
            B, T, H, D = SHAPES[name]
            rows = sweep(name, SHAPES[name], args.rep_ms)
            with open(sweep_out, "a") as f:
                f.write(f"\n## {env['date']} {commit} {env['gpu']} torch {env['torch']} triton {env['triton']}, "
                        f"B{B} T{T} H{H} K=V={D} bf16 plain gate: ours fwd+bwd, one launch setting changed\n\n")
                f.write("| kernel | change | fwd+bwd ms | defaults / this |\n|---|---|---|---|\n")
                f.writelines(f"| {' | '.join(r)} |\n" for r in rows)


if __name__ == "__main__":
    main()
