"""Throughput of `python -m titan_k3.data.prepare` on a synthetic corpus (CPU only).

    python benchmarks/prepare.py [--mb 200] [--workers 1,2] [--keep DIR]

Generates a corpus of `--mb` MB of JSONL in two sources (Zipf-distributed pseudo-words
in sentences and lines; ~4% exact duplicates, ~4% near duplicates, ~3% junk, ~2% too
short, a few documents with a planted benchmark 13-gram), then runs the whole
pipeline (16 MB shards, so stage C has work for every worker) once per worker count and prints per-stage wall time, MB/s per worker and
with all workers, and the worker time by step. Appends a dated row per run to
benchmarks/results/prepare.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from titan_k3.data.prepare.config import DecontaminationConfig, PrepareConfig, SourceConfig  # noqa: E402
from titan_k3.data.prepare.pipeline import prepare  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "prepare.md"


def _vocabulary(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    p = 1.0 / np.arange(1, 27)
    lengths = rng.integers(2, 10, n)
    return ["".join(rng.choice(letters, k, p=p / p.sum())) for k in lengths]


def _document(rng: np.random.Generator, vocab: list[str], cdf: np.ndarray, n_words: int) -> str:
    ids = np.minimum(np.searchsorted(cdf, rng.random(n_words)), len(vocab) - 1)
    words = [vocab[i] for i in ids]
    ends = np.flatnonzero(rng.random(n_words) < 0.07)
    for e in ends:
        words[e] += "."
    newlines = set(np.flatnonzero(rng.random(n_words) < 0.015).tolist())
    return "".join(w + ("\n" if i in newlines else " ") for i, w in enumerate(words)).strip()


def make_corpus(root: Path, mb: float, seed: int = 0) -> tuple[list[SourceConfig], Path]:
    """Two JSONL sources totalling `mb` MB and a benchmark file; returns (sources, benchmark path)."""
    rng = np.random.default_rng(seed)
    vocab = _vocabulary(rng, 50_000)
    zipf = 1.0 / np.arange(1, len(vocab) + 1) ** 1.05
    cdf = np.cumsum(zipf / zipf.sum())
    bench_ctx = [_document(rng, vocab, cdf, 40) for _ in range(200)]
    root.mkdir(parents=True, exist_ok=True)
    bench = root / "bench.jsonl"
    bench.write_text("".join(json.dumps({"context": c, "choices": ["yes", "no"], "gold": 0}) + "\n" for c in bench_ctx))
    sources = []
    for name, share in (("web", 0.75), ("books", 0.25)):
        (root / name).mkdir(parents=True)
        target, written, k, recent = mb * 1e6 * share, 0, 0, []
        f = None
        while written < target:
            if f is None or f.tell() > 32e6:
                if f:
                    f.close()
                f = open(root / name / f"part-{len(list((root / name).iterdir())):04d}.jsonl", "w")
            r = rng.random()
            if r < 0.04 and recent:
                text = recent[rng.integers(len(recent))]
            elif r < 0.08 and recent:
                words = recent[rng.integers(len(recent))].split(" ")
                for i in rng.choice(len(words), max(1, len(words) // 100), replace=False):
                    words[i] = "zz" + words[i]
                text = " ".join(words)
            elif r < 0.11:
                text = " ".join(f"{x:08d}" for x in rng.integers(0, 10**8, 200))
            elif r < 0.13:
                text = "see more"
            else:
                text = _document(rng, vocab, cdf, int(rng.lognormal(6.2, 0.8)) + 20)
                if rng.random() < 0.002:
                    ctx = bench_ctx[rng.integers(len(bench_ctx))].split(" ")
                    text += " " + " ".join(ctx[:13])
                recent = (recent + [text])[-200:]
            line = json.dumps({"id": f"{name}-{k}", "text": text}) + "\n"
            f.write(line)
            written += len(line.encode())
            k += 1
        f.close()
        sources.append(SourceConfig(name=name, path=str(root / name), weight=share))
    return sources, bench


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    with contextlib.suppress(OSError):  # no /proc (not Linux): fall back to platform
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=200.0, help="corpus size in MB (>= 200 for the recorded figure)")
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts to run")
    ap.add_argument("--tokenizer", default="embedded")
    ap.add_argument("--keep", help="directory to generate into and keep (default: a temporary one)")
    ap.add_argument("--no-record", action="store_true", help="do not append to benchmarks/results/prepare.md")
    args = ap.parse_args()

    commit = _git("rev-parse", "--short", "HEAD") + ("+dirty" if _git("status", "--porcelain", "--", "titan_k3/data", "benchmarks/prepare.py") else "")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="titan_k3-prepare-bench-"))
    t0 = time.perf_counter()
    sources, bench = make_corpus(root / "corpus", args.mb)
    corpus_mb = sum(p.stat().st_size for s in sources for p in Path(s.path).iterdir()) / 1e6
    print(f"corpus: {corpus_mb:.1f} MB of JSONL in {root / 'corpus'} ({time.perf_counter() - t0:.1f}s to generate)")

    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        out = root / f"out-w{workers}"
        shutil.rmtree(out, ignore_errors=True)
        cfg = PrepareConfig(
            output=str(out), tokenizer=args.tokenizer, workers=workers, sources=sources, shard_mb=16.0,
            decontamination=DecontaminationConfig(benchmarks=[str(bench)]),
        )
        load0 = os.getloadavg()[0]
        t = time.perf_counter()
        prepare(cfg, log=lambda *_: None)
        wall = time.perf_counter() - t
        stats = json.loads((out / "stats.json").read_text())
        row = summarize(workers, wall, stats, (load0 + os.getloadavg()[0]) / 2)
        rows.append(row)
        print(f"\nworkers={workers}: {wall:.1f}s wall (load average {row['load']:.1f} on {os.cpu_count()} cores)")
        print(f"  all workers: {row['mbps_all']:.2f} MB/s wall; per worker: {row['mbps_worker_cpu']:.2f} MB/s of worker CPU time")
        for stage in ("A", "B", "C"):
            t_ = stats["timings"][stage]
            steps = ", ".join(f"{k} {v:.1f}s" for k, v in t_.get("worker_s", {}).items())
            print(f"  stage {stage}: {t_['wall_s']:.1f}s wall, {t_.get('cpu_s', 0):.1f}s worker CPU  {steps}")
        print(f"  decisions: {row['decisions']}; tokens: {row['tokens']}")

    if not args.no_record:
        record(rows, corpus_mb, args.tokenizer, commit)
    if not args.keep:
        shutil.rmtree(root)


def summarize(workers: int, wall: float, stats: dict, load: float) -> dict:
    tm = stats["timings"]
    mb = tm["A"]["bytes"] / 1e6
    cpu = tm["A"]["cpu_s"] + tm["C"]["cpu_s"]
    decisions = {d: sum(c.get(d, 0) for c in stats["counts"].values()) for d in
                 ("accepted", "too_short", "low_quality", "exact_duplicate", "near_duplicate", "contaminated")}
    return {
        "workers": workers, "wall": wall, "mb": mb, "load": load, "timings": tm,
        "mbps_all": mb / wall, "mbps_worker_cpu": mb / cpu,
        "stage_mbps_cpu": {s: mb / tm[s]["cpu_s"] for s in ("A", "C")},
        "decisions": decisions, "tokens": sum(stats["tokens"].values()),
    }


def record(rows: list[dict], corpus_mb: float, tokenizer: str, commit: str) -> None:
    import datasketch
    import tokenizers

    header = (
        "| date | commit | CPU | cores | load avg | python | datasketch | tokenizers | tokenizer | corpus MB | workers "
        "| wall s | MB/s all workers (wall) | MB/s per worker (CPU) | stage A: wall s, MB/s per worker CPU "
        "(read/normalize/filter/minhash/decontam worker s) | stage B wall s | stage C: wall s, MB/s per worker CPU "
        "(tokenize worker s) | accepted / docs |\n" + "|---" * 19 + "|\n"
    )
    if not RESULTS.is_file():
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(
            "# prepare throughput\n\nRecorded by `python benchmarks/prepare.py` (CPU only). MB are input JSONL bytes "
            "as read. *MB/s all workers* is MB over the wall time of the whole run (all stages), so it depends on "
            "what else the machine runs (see load avg); *MB/s per worker* is MB over the worker processes' CPU "
            "seconds (stages A + C), the figure a free core gives. Worker seconds per step are summed over workers.\n\n"
            + header
        )
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    with open(RESULTS, "a") as f:
        for r in rows:
            tm = r["timings"]
            a = tm["A"]["worker_s"]
            steps = "/".join(f"{a.get(k, 0):.0f}" for k in ("read", "normalize", "filter", "minhash", "decontaminate"))
            docs = sum(r["decisions"].values())
            f.write(
                f"| {date} | {commit} | {_cpu()} | {os.cpu_count()} | {r['load']:.1f} | {platform.python_version()} "
                f"| {datasketch.__version__} | {tokenizers.__version__} | {tokenizer} | {corpus_mb:.0f} | {r['workers']} "
                f"| {r['wall']:.1f} | {r['mbps_all']:.2f} | {r['mbps_worker_cpu']:.2f} "
                f"| {tm['A']['wall_s']:.1f}, {r['stage_mbps_cpu']['A']:.2f} ({steps}) | {tm['B']['wall_s']:.1f} "
                f"| {tm['C']['wall_s']:.1f}, {r['stage_mbps_cpu']['C']:.2f} ({tm['C']['worker_s'].get('tokenize', 0):.0f}) "
                f"| {r['decisions']['accepted']} / {docs} |\n"
            )
    print(f"\nrecorded in {RESULTS}")


if __name__ == "__main__":
    main()
