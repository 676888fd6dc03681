"""What every GPU benchmark shares: the error measure and the environment a result row records."""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
import triton
import triton.testing

from titan_k3.metrics.profile import gpu_kernels
from titan_k3.metrics.profile import synchronize as sync  # noqa: F401 - the benchmarks' GPU wait

ROOT = Path(__file__).resolve().parents[1]
# NOTE: run directories of benchmark trainings stay out of the results folder (a device call returns few files).
RUNS = Path(os.environ.get("BENCH_RUNS", "/tmp/titan_k3-bench-runs"))


def median_ms(fn, grad_to_none: list[torch.Tensor] | None = None) -> float:
    """Median ms of fn(): triton's do_bench on CUDA; three wall-clock runs elsewhere (the CPU interpreter's smoke runs,
    where the time means nothing)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def add_packed_shape_args(p: argparse.ArgumentParser) -> None:
    """--flavor, --batch, --seq, --doc-len: the training shape of a benchmark over packed documents (`packed_pos`)."""
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--doc-len", type=int, default=1000, help="mean document length of the packed layout")


def packed_pos(batch: int, seq: int, doc_len: int, device: str, seed: int = 1) -> torch.Tensor:
    """Documents.pos_BT of documents of 1 .. 2 * doc_len - 1 tokens, every row start a document start."""
    from titan_k3.models.k3.documents import Documents

    gen = torch.Generator().manual_seed(seed)
    cuts = [0]
    for b in range(batch):
        while cuts[-1] < (b + 1) * seq:
            cuts.append(min((b + 1) * seq, cuts[-1] + int(torch.randint(1, 2 * doc_len, (1,), generator=gen))))
    return Documents.build(batch, seq, torch.tensor(cuts), torch.device(device)).pos_BT


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """RMS of (x - ref) over the RMS of ref, computed in float64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def git_commit() -> str:
    """The short commit of the tree, or "unknown" where it has no git metadata."""
    # NOTE: BENCH_COMMIT (or COMMIT) names the commit where the tree runs without its git history.
    named = os.environ.get("BENCH_COMMIT") or os.environ.get("COMMIT")
    if named:
        return named
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def peak_gib() -> float:
    """Peak CUDA memory allocated since the last reset, GiB (0 without CUDA)."""
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def peak_reserved_gib() -> float:
    """Peak CUDA memory the allocator reserved since the last reset, GiB (0 without CUDA).

    NOTE: with CUDA graphs this is the footprint to compare: a graph's pool stays reserved between replays, but
    only the tensors alive at the end of its capture count as allocated, so the allocated peak leaves out the
    activations' pool while the optimizer's own memory is in use.
    """
    return torch.cuda.max_memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0


def reserved_by_pool(segments: list[dict]) -> list[dict]:
    """The allocator's reserved memory per pool, from `torch.cuda.memory_snapshot()`'s segments, largest first.

    One row per (pool, stream): "pool" is "default" or the CUDA graph pool's id, with GiB reserved, allocated
    (blocks in use) and free inside it, the largest free block (what one more allocation could take without
    growing the pool) and the segment count. NOTE: a CUDA graph's pool keeps its capture's blocks; when the
    reserved total stays above the allocated one, this says which pool holds the difference.
    """
    pools: dict[tuple, dict] = {}
    for seg in segments:
        pool_id = tuple(seg.get("segment_pool_id") or (0, 0))
        key = ("default" if pool_id == (0, 0) else f"graph pool {pool_id[0]}.{pool_id[1]}", seg.get("stream", 0))
        row = pools.setdefault(key, {"pool": key[0], "stream": key[1], "segments": 0, "reserved": 0, "allocated": 0,
                                     "largest_free": 0})
        row["segments"] += 1
        row["reserved"] += seg["total_size"]
        row["allocated"] += seg["allocated_size"]
        free = [b["size"] for b in seg.get("blocks", []) if b["state"] == "inactive"]
        row["largest_free"] = max([row["largest_free"], *free])
    out = []
    for row in sorted(pools.values(), key=lambda r: -r["reserved"]):
        out.append({"pool": row["pool"], "stream": row["stream"], "segments": row["segments"],
                    **{f"{k}_gib": round(row[k] / 2**30, 3) for k in ("reserved", "allocated", "largest_free")},
                    "free_gib": round((row["reserved"] - row["allocated"]) / 2**30, 3)})
    return out


def pools_table(rows: list[dict]) -> str:
    """`reserved_by_pool`'s rows as a Markdown table."""
    lines = ["| pool | stream | segments | reserved GiB | allocated GiB | free GiB | largest free block GiB |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['pool']} | {r['stream']} | {r['segments']} | {r['reserved_gib']:.2f} | {r['allocated_gib']:.2f} | "
              f"{r['free_gib']:.2f} | {r['largest_free_gib']:.2f} |" for r in rows]
    return "\n".join(lines)


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def model_args(flavor: str) -> list[str]:
    """Trainer flags for a benchmark flavor: k3-mini at the real vocabulary; debug (CPU smoke) as it comes."""
    return ["--model.flavor", flavor] + (["--model.vocab_size", "163840"] if flavor != "debug" else [])


def write_results(out: Path, name: str, table: str, env: dict, rows: list[dict]) -> None:
    """Append the Markdown table to OUT/NAME.md, write OUT/NAME.json (env + rows), print the table last."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{name}.md", "a") as f:
        f.write(table + "\n")
    (out / f"{name}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    print(table)


ENV_COLUMNS = ("date", "commit", "GPU", "torch", "triton")


def env_cells(env: dict) -> str:
    """The first five cells of a results row ('| date | commit | GPU | torch | triton | '), from `environment()`."""
    return f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {env['triton']} | "


def markdown_table(columns: list[str], lines: list[str]) -> str:
    """A results table: ENV_COLUMNS then `columns` as its header, over rows that start with `env_cells`."""
    header = [*ENV_COLUMNS, *columns]
    return "| " + " | ".join(header) + " |\n" + "|---" * len(header) + "|\n" + "\n".join(lines) + "\n"


def append_section(path: str | Path, heading: str, intro: str, table: str) -> None:
    """Append '### heading', an intro line and the table to a results file (and print the table)."""
    print("\n" + table)
    with open(path, "a") as f:
        f.write(f"\n### {heading}\n\n{intro}\n\n{table}")


def environment() -> dict:
    """date, commit, gpu, torch, triton: the columns every results row starts with; host: the machine (in the JSON)."""
    return {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": host(),
    }


def host() -> str:
    """'<hostname> (<CPU model>, <n> cores)': two machines of one GPU kind can differ in the host, and a host-bound
    step (the strong peer's) moves with it, so a ratio is read against the machine it was measured on."""
    model = "unknown CPU"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # not Linux: the model stays unknown
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{platform.node()} ({model}, {os.cpu_count()} cores)"


def kernel_ms(fn, iters: int = 10, grad_to_none: list[torch.Tensor] | None = None) -> float:
    """GPU kernel time of one fn() call in ms: its kernels' durations summed (torch.profiler) over `iters` calls after
    three warm-up calls, divided by `iters`. Unlike do_bench's wall time, the host's launches do not count: the time
    a CUDA graph replay of fn would take when its kernels run back to back. `grad_to_none`: tensors whose .grad is
    reset before each call (as do_bench does), so that no call pays for adding into the last one's gradients."""
    def call():
        for t in grad_to_none or []:
            t.grad = None
        fn()

    for _ in range(3):
        call()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        sync()
    return sum(end - start for _, start, end in gpu_kernels(prof)) / iters / 1e3


def print_cuda_profile(run, row_limit: int = 20) -> None:
    """Prints the per-kernel CUDA time table of five calls of run(), after three warm-up calls."""
    for _ in range(3):
        run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=row_limit))
