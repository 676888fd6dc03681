"""Where a cold start goes: a py-spy recording of the trainer's first update, summed by what each thread did.

    py-spy record -r 25 --idle --threads --nonblocking --format raw -o cold.txt -- python -m titan_k3.train ...
    python benchmarks/startup_breakdown.py cold.txt

py-spy's raw format is one line per distinct stack: `thread (tid): name;frame;frame;... count`, frames as
`function (file:line)`, root first. Each sample is put in the first bucket of BUCKETS that matches its stack
(order matters: Triton compiling inside an autotuner is a compile, not a benchmark), and the buckets of the
threads the first update waits on (the main thread, the autograd engine's) are printed in seconds
(samples / rate). A second table names the call sites of our own kernels that
paid for a Triton compile on their first call, the part a parallel precompile at start-up would move off the
critical path.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

# (label, substrings any of which marks a stack), first match wins.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("Triton compile (a kernel's first call)", ("triton/compiler/compiler.py",)),
    ("Triton autotune (benchmarking configs)", ("triton/runtime/autotuner.py",)),
    ("inductor: waiting for its compile workers", ("wait_on_futures", "AsyncCompile.wait", "_wait_futures")),
    ("inductor: code generation and loading", ("torch/_inductor/",)),
    ("AOT autograd", ("torch/_functorch/",)),
    ("dynamo: tracing", ("torch/_dynamo/",)),
    ("imports", ("_find_and_load",)),
    ("building the trainer (other)", ("Trainer.__init__",)),
    ("waiting in backward() for the autograd thread", ("run_backward", "_engine_run_backward")),
]
IDLE = "idle or other"
_OURS = re.compile(r"^(\S+) \(((kernels|titan_k3)/[^:]+):(\d+)\)$")


def read_raw(path: Path) -> list[tuple[str, list[str], int]]:
    """[(thread, frames root first, samples)] from a py-spy raw recording."""
    stacks = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        thread, *frames = stack.split(";")
        stacks.append((thread, frames, int(count)))
    return stacks


def bucket(frames: list[str]) -> str:
    joined = ";".join(frames)
    return next((label for label, marks in BUCKETS if any(m in joined for m in marks)), IDLE)


def critical_threads(stacks) -> list[str]:
    """The threads a first update waits on: the main thread, and the autograd engine's (it runs backward)."""
    main = [t for t, _, _ in stacks if t.endswith("MainThread")]
    autograd = [t for t, frames, _ in stacks if any("_backward_impl" in f or "BackwardCFunction" in f for f in frames)]
    return list(dict.fromkeys(main + autograd))


def breakdown(stacks, threads: list[str]) -> dict[str, Counter]:
    """{thread: Counter(bucket -> samples)} for `threads`."""
    per_thread: dict[str, Counter] = {t: Counter() for t in threads}
    for thread, frames, count in stacks:
        if thread in per_thread:
            per_thread[thread][bucket(frames)] += count
    return per_thread


def first_call_compiles(stacks, threads) -> Counter:
    """(thread, our innermost function @ file:line) -> samples spent compiling a Triton kernel below it."""
    sites = Counter()
    for thread, frames, count in stacks:
        if thread not in threads or not any("triton/compiler/compiler.py" in f for f in frames):
            continue
        # The deepest frame that is ours or inductor's kernel loader says whose kernel is compiling (our ops run
        # inside inductor's compiled graphs, so inductor frames above ours do not make a kernel inductor's).
        for frame in reversed(frames):
            if "torch/_inductor/runtime/triton_heuristics.py" in frame:
                sites[(thread, "inductor's generated kernels")] += count
                break
            ours = _OURS.match(frame)
            if ours:
                name, path, _, line = ours.groups()
                sites[(thread, f"{name} @ {path}:{line}")] += count
                break
    return sites


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recording", type=Path)
    p.add_argument("--rate", type=float, default=25.0, help="py-spy's sampling rate (-r)")
    p.add_argument("--sites", type=int, default=15)
    args = p.parse_args()
    stacks = read_raw(args.recording)
    threads = breakdown(stacks, critical_threads(stacks))
    for thread, counts in threads.items():
        print(f"\n{thread}: {sum(counts.values()) / args.rate:.1f} s sampled\n")
        print("| what | seconds |\n|---|---|")
        for label, n in counts.most_common():
            print(f"| {label} | {n / args.rate:.1f} |")
    print("\nOur kernels' first-call Triton compiles (call site, seconds):\n")
    print("| thread | call site | seconds |\n|---|---|---|")
    for (thread, site), n in first_call_compiles(stacks, set(threads)).most_common(args.sites):
        print(f"| {thread} | {site} | {n / args.rate:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
