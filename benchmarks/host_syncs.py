"""Where the training step makes the host wait for the GPU: every synchronising CUDA call, by call site.

    torchrun --nproc_per_node 2 benchmarks/host_syncs.py --warmup 5 --updates 3 -- TRAINER ARGS
    (one GPU: python benchmarks/host_syncs.py ... -- TRAINER ARGS)

A step that waits for the GPU stops the host from queueing work ahead, which
costs throughput wherever the host is the bottleneck (two GPUs at micro-batch
8: session 8 profiled two cudaStreamSynchronize calls per FSDP2 update, source
unknown). This builds the real Trainer from the trainer's own arguments, runs
`--warmup` updates (compilation and the allocator may sync), then `--updates`
more under CUDA's sync-debug "warn" mode, recording the Python stack of every
synchronising call. Each rank prints its call sites (the innermost frame of
ours, the innermost frame of torch, calls per update), the trainer's own
intended syncs included (the window-end read-backs): a site not meant to be
there is the finding. Needs CUDA (the debug mode is CUDA's).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_OURS = ("titan_k3/", "kernels/", "benchmarks/")


def call_site(stack: list[traceback.FrameSummary]) -> str:
    """'ours file:line function <- torch file:line function': the innermost frame of ours and of torch below it."""
    ours = next((f for f in reversed(stack) if any(p in f.filename for p in _OURS)
                 and not f.filename.endswith("host_syncs.py")), None)
    torch_frame = next((f for f in reversed(stack) if "/torch/" in f.filename and "warnings" not in f.filename), None)

    def short(f, root):
        return f"{f.filename[f.filename.rfind(root):]}:{f.lineno} {f.name}" if f else "?"

    site = short(ours, next((p for p in _OURS if ours and p in ours.filename), ""))
    return f"{site} <- {short(torch_frame, 'torch/')}" if torch_frame else site


class SyncRecorder:
    """Collects the stack of each CUDA sync-debug warning (UserWarning 'called a synchronizing CUDA operation')."""

    def __init__(self):
        self.sites: Counter = Counter()

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                self.sites[call_site(traceback.extract_stack()[:-1])] += 1
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        return self

    def __exit__(self, *exc):
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)


def main() -> int:
    argv = sys.argv[1:]
    trainer_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=5, help="updates before recording (compilation may sync)")
    p.add_argument("--updates", type=int, default=3, help="updates recorded")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("host_syncs.py: needs CUDA (it uses CUDA's sync-debug mode)", file=sys.stderr)
        return 2
    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    steps = args.warmup + args.updates
    # One update past the recorded ones: the run's last update runs the invariant checks, which synchronise.
    trainer = Trainer(load_job_config([*trainer_args, "--training.steps", str(steps + 1)]))
    try:
        for _ in range(args.warmup):
            trainer.train_step()
        torch.cuda.synchronize()
        with SyncRecorder() as recorder:
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(args.updates):
                    trainer.train_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        trainer.close()
    rank = int(os.environ.get("RANK", 0))
    lines = [f"rank {rank}: {sum(recorder.sites.values())} synchronising calls in {args.updates} updates",
             "| calls per update | call site (ours <- torch) |", "|---|---|"]
    lines += [f"| {n / args.updates:.2f} | {site} |" for site, n in recorder.sites.most_common()]
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
