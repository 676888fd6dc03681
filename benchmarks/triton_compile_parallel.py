"""Does Triton compile kernels in parallel inside one process? Serial vs threads vs processes, same kernels.

    PYTHONPATH=. python benchmarks/triton_compile_parallel.py [--kernels 8 --workers 8] [--out OUTDIR]

Cold start spends ~20 s of its critical path compiling our Triton kernels on
their first call, one after another (a cold k3-mini start, py-spy:
benchmarks/results/compile_startup.md). Whether a start-up precompile can use a
thread pool or needs worker processes depends on how much of `compile` runs
without the GIL (the MLIR/LLVM passes, ptxas). This compiles N distinct
variants of one GEMM-with-epilogue kernel (a constexpr salt makes each a cache
miss, with the same work) three ways, each in a fresh Triton cache: one after
another, in a thread pool, and in a pool of spawned processes (their start-up
included). Needs a CUDA GPU (compilation targets it; nothing is launched).
Prints a table last and appends it to OUTDIR/triton_compile_parallel.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_epilogue(a_ptr, b_ptr, c_ptr, M, N, K, SALT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """c = silu(a @ b) * SALT: a tiled GEMM with a float32 epilogue, about the size of our expert kernels."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
        out = acc * tl.sigmoid(acc) * SALT
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    return gemm_epilogue


def compile_variant(salt: int) -> float:
    """Compile variant `salt` (no launch); returns its seconds."""
    import torch

    kernel = _kernel()
    a = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    kernel.warmup(a, a, a, 256, 256, 256, SALT=salt, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, grid=(1,))
    return time.perf_counter() - t0


def measure(mode: str, salts: list[int], workers: int) -> dict:
    t0 = time.perf_counter()
    if mode == "serial":
        each = [compile_variant(s) for s in salts]
    elif mode == "threads":
        with ThreadPoolExecutor(workers) as pool:
            each = list(pool.map(compile_variant, salts))
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            each = list(pool.map(compile_variant, salts))
    return {"mode": mode, "kernels": len(salts), "workers": 1 if mode == "serial" else workers,
            "wall_s": time.perf_counter() - t0, "sum_of_compiles_s": sum(each)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, default=8)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("triton_compile_parallel.py: needs CUDA (Triton compiles for the GPU it finds)", file=sys.stderr)
        return 2
    from benchmarks.common import environment, write_results

    env, rows = environment(), []
    compile_variant(10_000)  # the first compile pays Triton's own imports and the driver: not part of any mode
    for i, mode in enumerate(("serial", "threads", "processes")):
        # NOTE: a fresh cache per mode and distinct salts: every compile is a miss; spawned workers inherit it.
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{mode}-")
        rows.append(measure(mode, [1 + i * args.kernels + j for j in range(args.kernels)], args.workers))
        print(rows[-1], flush=True)
    serial = rows[0]["wall_s"]
    table = "\n".join([
        "| date | commit | GPU | torch | triton | mode | kernels | workers | wall s | sum of compile s | speed-up vs serial |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | {r['mode']} | "
          f"{r['kernels']} | {r['workers']} | {r['wall_s']:.2f} | {r['sum_of_compiles_s']:.2f} | {serial / r['wall_s']:.2f}x |"
          for r in rows),
    ])
    write_results(args.out, "triton_compile_parallel", table, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
