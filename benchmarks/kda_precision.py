"""KDA gradients against the float64 recurrence, per path, dtype and shape: where the Triton kernels go wrong.

    PYTHONPATH=. python benchmarks/kda_precision.py [--out OUTDIR] [--launch "dchunk.num_stages=1;..."]
                                                    [--fla [--dtypes bfloat16,float16]]

Each case runs the safe gate (random raw gate, lower bound -5, the A_log / dt_bias initialisation of docs/k3.md §2.1)
forward and backward through `kernels.kda.chunk_kda` under one launch path ("exact": the default unfused
backward; "bounded-fused": bounded products, fused backward) and through `recurrent_kda` in float64, and
reports the relative RMS error of the output and of every gradient. `--launch` overrides ops.LAUNCH entries
(e.g. "dchunk.BK=32") to check a launch setting's precision before it is timed.
A correctness tool, not a timing: appends a table to OUTDIR/kda_precision.md. Without a GPU, `--smoke`
runs one small float32 case on Triton's CPU interpreter (a check of the script, not of the GPU).
`--fla` runs flash-linear-attention's own test cases (FLA_CASES below) in bf16 and fp16 (`--dtypes`), under the
`--launch` overrides, and appends a pass / fail table to OUTDIR/kda_fla_cases.md (tests/gpu/test_kda_fla_gpu.py
asserts the same at the defaults).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, rel_rms, write_results  # noqa: E402
from benchmarks.kda import launch_settings, parse_candidate  # noqa: E402
from kernels.kda import chunk_kda, chunk_kda_reference, l2norm, ops, recurrent_kda  # noqa: E402

PATHS = {"exact": dict(diag_dot=0, fuse_bwd=0), "bounded-fused": dict(diag_dot=1, fuse_bwd=1)}
NAMES = ("o", "q", "k", "v", "g", "beta", "h0", "A_log", "dt_bias")
# (path, B, T, H, K, dtype): the session-7 failure and the neighbours that isolate it.
CASES = [
    ("exact", 2, 300, 2, 128, torch.float32), ("bounded-fused", 2, 300, 2, 128, torch.float32),
    ("exact", 2, 300, 2, 128, torch.bfloat16), ("exact", 2, 300, 2, 64, torch.float32),
    ("exact", 1, 16, 1, 128, torch.float32), ("exact", 2, 300, 8, 128, torch.float32),
]
SMOKE = [("exact", 1, 20, 1, 16, torch.float32)]


# flash-linear-attention's own KDA cases: the parameter lists of test_chunk and test_chunk_varlen in its
# tests/ops/test_kda.py (fla-org/flash-linear-attention at bc3b101), their inputs and their per-tensor tolerances
# (relative RMS error against a recurrent reference), written out here as data. Left out: the test_chunk cases
# with more value heads than key heads (HV > H; chunk_kda has one head count). fla's chunk size (one varlen case
# asks for 32), TMA and recompute switches pick its implementation, not the math: every case runs our 64-token
# chunks. Our reference runs in float64 (fla's: float32) on the same low-precision inputs.
FLA_CHUNK_TOL = dict(o=0.005, ht=0.005, dq=0.008, dk=0.008, dv=0.008, dg=0.02, db=0.02, dh0=0.008, dbias=0.008)
FLA_VARLEN_TOL = dict(o=0.005, ht=0.005, dq=0.007, dk=0.008, dv=0.007, dg=0.015, db=0.015, dh0=0.007, dbias=0.005)
# fla only warns when dA (the A_log gradient) exceeds these; so do the tests.
FLA_DA_WARN = {"chunk": 0.003, "varlen": 0.008}


@dataclass(frozen=True)
class FlaCase:
    """One case. kind "chunk": B sequences of T, uniform q, k, v; "varlen": one row packing cu_seqlens, normal q, v,
    hard resets (g = -1000 on a mask_p share of the gate's entries: the raw gate's when gate_in_kernel)."""

    kind: str
    B: int
    T: int
    H: int
    D: int
    scale: float | None = None
    normalizer: float = 1.0
    mask_p: float = 0.0
    l2norm_in_kernel: bool = False
    gate_in_kernel: bool = False
    safe_gate: bool = False
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        fused = "safe" if self.safe_gate else "softplus"
        gate = fused if self.gate_in_kernel else ("g>=-5" if self.safe_gate else "g")
        shape = f"B{self.B} T{self.T}" if self.cu_seqlens is None else f"cu{list(self.cu_seqlens)}"
        return (f"{self.kind} {shape} H{self.H} D{self.D} scale{self.scale} norm{self.normalizer} "
                f"mask{self.mask_p} {gate}{' l2-in-kernel' if self.l2norm_in_kernel else ''}")

    @property
    def tolerances(self) -> dict[str, float]:
        tol = dict(FLA_CHUNK_TOL if self.kind == "chunk" else FLA_VARLEN_TOL)
        if not self.gate_in_kernel:
            del tol["dbias"]
        return tol


def _chunk(B, T, H, D, scale, normalizer, mask_p, l2, gate, safe):
    return FlaCase("chunk", B, T, H, D, scale, normalizer, mask_p, l2, gate, safe)


def _varlen(H, D, mask_p, cu, gate, safe):
    return FlaCase("varlen", 1, cu[-1], H, D, None, 1.0, mask_p, False, gate, safe, tuple(cu))


FLA_CASES = [
    _chunk(1, 63, 1, 64, 1, 1, 0, False, False, True),
    _chunk(2, 500, 3, 60, 1, 1, 0, False, False, True),
    _chunk(2, 1000, 3, 64, 0.1, 1, 0.5, False, False, False),
    _chunk(3, 1024, 4, 100, 1, 0.1, 0, False, False, False),
    _chunk(4, 1024, 4, 128, 0.1, 1, 0, False, False, True),
    _chunk(4, 1024, 4, 128, 0.1, 1, 0, True, False, True),
    _chunk(2, 1500, 4, 128, 0.1, 10, 0, False, True, False),
    _chunk(4, 2048, 8, 64, 0.1, 1, 0, False, True, True),
    _varlen(4, 60, 0.1, [0, 15], True, False),
    _varlen(4, 64, 0.9, [0, 256, 500, 1000], True, False),
    _varlen(4, 128, 0.5, [0, 256, 500, 1000], False, False),
    _varlen(4, 100, 0, [0, 15, 100, 300, 1200, 2000], True, False),
    _varlen(4, 256, 0, [0, 100, 300, 1200, 3000, 4096], False, True),
    _varlen(4, 60, 0.1, [0, 31, 96, 160], True, False),
]


def fla_inputs(case: FlaCase, dtype: torch.dtype, device: str, seed: int = 42) -> dict:
    """The case's inputs as fla draws them (our own generator), rounded to dtype where fla holds them in it.

    Returns the leaves (q, k, v, g, beta, h0, A_log, dt_bias: float64 holding the rounded values), the
    cotangents do, dht and the keyword arguments both chunk_kda and recurrent_kda take.
    """
    gen = torch.Generator().manual_seed(seed)
    B, T, H, D = case.B, case.T, case.H, case.D
    N = B if case.cu_seqlens is None else len(case.cu_seqlens) - 1

    def rnd(*shape, fn=torch.randn, dt=dtype):
        return fn(*shape, generator=gen, dtype=torch.float64).to(dt).double()

    if case.kind == "chunk":
        q, k, v = (rnd(B, T, H, D, fn=torch.rand) for _ in range(3))
    else:
        q, k, v = rnd(B, T, H, D), l2norm(rnd(B, T, H, D, dt=torch.float32)).to(dtype).double(), rnd(B, T, H, D)
    g = rnd(B, T, H, D, dt=dtype if case.gate_in_kernel else torch.float32)
    A_log = dt_bias = None
    if case.gate_in_kernel:
        if case.kind == "chunk":
            A_log = rnd(H, dt=torch.float32)
        else:
            A_log = torch.empty(H, dtype=torch.float64).uniform_(1, 16, generator=gen).float().log().double()
        dt_bias = rnd(H, D, dt=torch.float32)
    else:
        g = torch.nn.functional.logsigmoid(g).float().double() / case.normalizer
        g = g * (torch.rand(g.shape, generator=gen, dtype=torch.float64) > case.mask_p)
    if case.kind == "varlen":
        keep = torch.rand(g.shape, generator=gen, dtype=torch.float64) > case.mask_p
        g = torch.where(keep, g, -1000.0)
    if case.safe_gate and not case.gate_in_kernel:
        g = g.clamp(-5, 0)
    beta = (rnd(B, T, H) if case.kind == "chunk" else rnd(B, T, H, fn=torch.rand)).sigmoid().to(dtype).double()
    h0 = rnd(N, H, D, D, dt=torch.float32)
    do = rnd(B, T, H, D)
    dht = rnd(N, H, D, D, dt=torch.float32, fn=torch.randn if case.kind == "chunk" else torch.rand)
    if not case.l2norm_in_kernel:
        # fla normalises q (and k in test_chunk) outside the kernel, in the graph; here before it, in float64
        q = l2norm(q).to(dtype).double()
        if case.kind == "chunk":
            k = l2norm(k).to(dtype).double()
    kw = dict(scale=case.scale, use_qk_l2norm=case.l2norm_in_kernel,
              cu_seqlens=None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, device=device),
              gate_lower_bound=-5.0 if case.safe_gate else None)
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, A_log=A_log, dt_bias=dt_bias)
    return dict(leaves={n: None if x is None else x.to(device) for n, x in leaves.items()},
                do=do.to(device), dht=dht.to(device), kw=kw)


FLA_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "db", "h0": "dh0", "A_log": "dA", "dt_bias": "dbias"}


def fla_errors(case: FlaCase, dtype: torch.dtype, device: str) -> dict[str, float]:
    """Relative RMS errors (fla's measure) of chunk_kda in dtype against float64, by fla's names.

    The float64 truth is the chunked PyTorch reference (equal to the token-by-token recurrence to 1e-10,
    tests/kernels/test_kda.py), which runs the long cases in seconds.
    """
    x = fla_inputs(case, dtype, device)

    def run(fn, cast):
        leaves = {n: None if t is None else cast(n, t).requires_grad_(True) for n, t in x["leaves"].items()}
        o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
                   output_final_state=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], **x["kw"])
        ((o.double() * x["do"]).sum() + (ht.double() * x["dht"]).sum()).backward()
        return dict(o=o, ht=ht, **{FLA_NAMES[n]: t.grad for n, t in leaves.items() if t is not None})

    def low(name, t):
        if name in ("h0", "A_log", "dt_bias") or (name == "g" and not case.gate_in_kernel):
            return t.float().clone()
        return t.to(dtype).clone()

    want = run(chunk_kda_reference, lambda name, t: t.clone())
    got = run(chunk_kda, low)
    return {n: rel_rms(got[n], want[n]) for n in want}


def grads_of(fn, leaves_in: list[torch.Tensor], do: torch.Tensor, dS: torch.Tensor) -> list[torch.Tensor]:
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves_in]
    q, k, v, g, beta, h0, A_log, dt_bias = leaves
    o, S = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias,
              gate_lower_bound=-5.0)
    ((o.double() * do).sum() + (S.double() * dS).sum()).backward()
    return [o.detach()] + [x.grad for x in leaves]


def case(path: str, B: int, T: int, H: int, K: int, dtype: torch.dtype, device: str, seed: int = 10) -> list[float]:
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = dict(device=device, dtype=torch.float64)
    q = torch.randn(B, T, H, K, generator=gen, **dev)
    k = l2norm(torch.randn(B, T, H, K, generator=gen, **dev))
    v = torch.randn(B, T, H, K, generator=gen, **dev)
    g = torch.randn(B, T, H, K, generator=gen, **dev) * 3  # the raw gate
    beta = torch.rand(B, T, H, generator=gen, **dev)
    h0 = torch.randn(B, H, K, K, generator=gen, **dev) * 0.1
    A_log = torch.randn(H, generator=gen, **dev) * 0.3
    dt = torch.exp(torch.empty(H, K, **dev).uniform_(-6.9, -2.3, generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    do = torch.randn(B, T, H, K, generator=gen, **dev)
    dS = torch.randn(h0.shape, generator=gen, **dev)
    want = grads_of(recurrent_kda, [q, k, v, g, beta, h0, A_log, dt_bias], do, dS)
    with launch_settings({"safe": PATHS[path]}):
        low = [x.to(dtype) for x in (q, k, v, g, beta)] + [h0.float(), A_log.float(), dt_bias.float()]
        got = grads_of(chunk_kda, low, do, dS)
    return [rel_rms(a, b) for a, b in zip(got, want)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--launch", default="", help='ops.LAUNCH overrides, "kernel.setting=value;..."')
    p.add_argument("--smoke", action="store_true", help="one small float32 case (runs on CPU too)")
    p.add_argument("--fla", action="store_true", help="fla's test_chunk / test_chunk_varlen cases in bf16 and fp16")
    p.add_argument("--dtypes", default="bfloat16,float16", help="--fla: the dtypes to run on a GPU, comma-separated")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.fla:
        with launch_settings(parse_candidate(args.launch)):
            return fla_main(args.out, device, args.dtypes.split(","), args.launch)
    if device == "cpu" and not args.smoke:
        print("kda_precision: needs CUDA (the defect it measures is a GPU one); --smoke checks the script on CPU")
        return 2
    env, rows = environment(), []
    with launch_settings(parse_candidate(args.launch)):
        for path, B, T, H, K, dtype in SMOKE if args.smoke else CASES:
            errs = case(path, B, T, H, K, dtype, device)
            rows.append(dict(env, path=path, shape=f"B{B} T{T} H{H} K=V={K}", dtype=str(dtype).split(".")[-1],
                             launch=args.launch or "default", **dict(zip(NAMES, errs))))
            print(rows[-1], flush=True)
    lines = ["\n### KDA gradients vs the float64 recurrence (relative RMS error)",
             "| date | commit | GPU | torch | triton | launch | path | shape | dtype | " + " | ".join(NAMES) + " |",
             "|" + "---|" * (9 + len(NAMES))]
    for r in rows:
        lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['torch']} | {r['triton']} | {r['launch']} | "
                     f"{r['path']} | {r['shape']} | {r['dtype']} | " + " | ".join(f"{r[n]:.1e}" for n in NAMES) + " |")
    write_results(args.out, "kda_precision", "\n".join(lines), env, rows)
    return 0


def fla_main(out: Path, device: str, dtypes: list[str] = ("bfloat16", "float16"), launch: str = "") -> int:
    """FLA_CASES in `dtypes` (float32 on CPU) under the `launch` overrides: a pass / fail table against fla's
    tolerances."""
    env, rows = environment(), []
    dtypes = [getattr(torch, d) for d in dtypes] if device == "cuda" else [torch.float32]
    names = ("o", "ht", "dq", "dk", "dv", "dg", "db", "dh0", "dbias", "dA")
    for case in FLA_CASES:
        for dtype in dtypes:
            errors = fla_errors(case, dtype, device)
            failed = sorted(n for n, tol in case.tolerances.items() if not errors[n] < tol)
            rows.append(dict(env, case=case.name, dtype=str(dtype).split(".")[-1], failed=failed, **errors))
            print(rows[-1], flush=True)
    lines = [f"\n### fla's KDA test cases vs float64 (relative RMS error; fla's tolerances; launch {launch or 'default'})",
             "| date | commit | GPU | case | dtype | result | " + " | ".join(names) + " |",
             "|" + "---|" * (6 + len(names))]
    for r in rows:
        result = "fail: " + ", ".join(r["failed"]) if r["failed"] else "pass"
        lines.append(f"| {r['date']} | {r['commit']} | {r['gpu']} | {r['case']} | {r['dtype']} | {result} | "
                     + " | ".join(f"{r[n]:.1e}" if n in r else "—" for n in names) + " |")
    write_results(out, "kda_fla_cases", "\n".join(lines), env, rows)
    return 0 if not any(r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
