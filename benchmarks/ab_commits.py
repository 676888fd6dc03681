"""The training step of several commits, side by side on one machine: which change moved the step, and by how much.

    python benchmarks/ab_commits.py prepare --dir build/ab REV [REV ...]       # where the git history is
    python benchmarks/ab_commits.py run --dir build/ab --out OUTDIR [--rounds N] -- [train_throughput.py args]

`prepare` writes each commit's tree (`git archive`, without benchmarks/results) under DIR/<short hash> and the list
to DIR/trees.json: the folder travels to a GPU machine that has no git history (there the benchmarks' commit column
would name whatever stale repository it finds). `run` times every tree with `benchmarks/train_throughput.py
--isolate` from inside that tree (its own code, its own variants), the commit named through BENCH_COMMIT, round
after round with the order reversed each round (a drift of the machine then cancels between neighbours), and
writes OUTDIR/ab_commits.md: per commit, variant and shape the runs' median, fastest and slowest ms per update and
the median's change against the first commit listed. Each run's own rows stay under OUTDIR/<commit>/round<N>/.

Repeated runs of one commit on an H200 spread 0.0-0.4 ms per k3-mini update (train_throughput.md, session 19): a
change smaller than that needs more rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "trees.json"


def prepare(directory: Path, revs: list[str]) -> list[dict]:
    """Each rev's tree under directory/<short hash>; returns (and writes) the manifest [{commit, rev, path}]."""
    trees = []
    for rev in revs:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", f"{rev}^{{commit}}"],
                                capture_output=True, text=True)
        if commit.returncode != 0:
            raise SystemExit(f"ab_commits prepare: '{rev}' names no commit of {ROOT}: {commit.stderr.strip()}")
        short = commit.stdout.strip()
        if any(t["commit"] == short for t in trees):
            continue
        tree = directory / short
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", short], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(tree), "--exclude=benchmarks/results"], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"ab_commits prepare: git archive {short} failed")
        trees.append({"commit": short, "rev": rev, "path": short})
    (directory / MANIFEST).write_text(json.dumps(trees, indent=2) + "\n")
    return trees


def run(directory: Path, out: Path, rounds: int, throughput_args: list[str]) -> list[dict]:
    """Every tree's train_throughput.py --isolate, `rounds` times in alternating order; returns every row."""
    trees = json.loads((directory / MANIFEST).read_text())
    rows: list[dict] = []
    for round_ in range(1, rounds + 1):
        for tree in trees if round_ % 2 else trees[::-1]:
            dest = out / tree["commit"] / f"round{round_}"
            src = directory / tree["path"]
            cmd = [sys.executable, str(src / "benchmarks" / "train_throughput.py"), "--isolate", "--out", str(dest),
                   *throughput_args]
            # NOTE: the tree first, then the caller's path (where a GPU machine's extra wheels were unpacked)
            path = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
            env = {**os.environ, "BENCH_COMMIT": tree["commit"], "PYTHONPATH": path}
            done = subprocess.run(cmd, cwd=src, env=env)
            result = dest / "train_throughput.json"
            if done.returncode != 0 or not result.is_file():
                rows.append({"commit": tree["commit"], "round": round_, "error": f"exit {done.returncode}, no rows"})
                continue
            for row in json.loads(result.read_text())["rows"]:
                rows.append({**row, "commit": tree["commit"], "round": round_})
    table = summary(rows, [t["commit"] for t in trees])
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab_commits.json").write_text(json.dumps({"trees": trees, "rows": rows}, indent=2) + "\n")
    with open(out / "ab_commits.md", "a") as f:
        f.write(table + "\n")
    print(table)
    return rows


def summary(rows: list[dict], commits: list[str]) -> str:
    """Per commit, variant and shape: runs, median / fastest / slowest ms per update, the median's change against
    the first commit's at the same variant and shape; failed runs are listed under the table."""
    lines = ["| commit | variant | shape | runs | median ms | fastest ms | slowest ms | vs " + commits[0] + " |",
             "|---|---|---|---|---|---|---|---|"]
    timed = [r for r in rows if "ms_per_step" in r]
    slots = sorted({(r["variant"], r["seq"], r["batch"]) for r in timed})
    for variant, seq, batch in slots:
        medians = {}
        for commit in commits:
            ms = sorted(r["ms_per_step"] for r in timed
                        if (r["commit"], r["variant"], r["seq"], r["batch"]) == (commit, variant, seq, batch))
            if not ms:
                continue
            medians[commit] = statistics.median(ms)
            base = medians.get(commits[0])
            change = f"{medians[commit] - base:+.1f} ms" if base is not None and commit != commits[0] else "—"
            lines.append(f"| {commit} | {variant} | B{batch} T{seq} | {len(ms)} | {medians[commit]:.1f} | {ms[0]:.1f} "
                         f"| {ms[-1]:.1f} | {change} |")
    failed = [r for r in rows if "ms_per_step" not in r]
    lines += [f"- {r['commit']} round {r['round']}: {r.get('variant', 'run')} failed: {r.get('error', 'no time')}"
              for r in failed]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="write each commit's tree and the manifest (needs the git history)")
    prep.add_argument("--dir", type=Path, default=ROOT / "build" / "ab")
    prep.add_argument("revs", nargs="+")
    go = sub.add_parser("run", help="time every prepared tree; arguments after -- go to train_throughput.py")
    go.add_argument("--dir", type=Path, default=ROOT / "build" / "ab")
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--rounds", type=int, default=2)
    go.add_argument("throughput_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command == "prepare":
        for tree in prepare(args.dir, args.revs):
            print(f"{tree['rev']} -> {args.dir / tree['path']}")
        return
    if args.rounds < 1:
        raise SystemExit(f"ab_commits run: --rounds {args.rounds} must be >= 1")
    if not (args.dir / MANIFEST).is_file():
        raise SystemExit(f"ab_commits run: {args.dir / MANIFEST} is missing; run 'ab_commits.py prepare' first")
    extra = args.throughput_args[1:] if args.throughput_args[:1] == ["--"] else args.throughput_args
    # NOTE: absolute: each tree runs with its own folder as the working directory (a relative --dir named its
    # script twice over, build/ab/X/build/ab/X/..., and every run failed).
    run(args.dir.resolve(), args.out.resolve(), args.rounds, extra)


if __name__ == "__main__":
    main()
