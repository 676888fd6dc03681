"""k3-mini checkpoint cost on one GPU: blocking vs async DCP save, and the size on disk.

    PYTHONPATH=. python benchmarks/checkpoint.py --out OUTDIR [--flavor k3-mini --saves 2]

For each mode the trainer runs a few updates (so the optimizer has its
Muon momenta and AdamW moments), then saves `--saves` times through the
run's own CheckpointManager, one save after each further update. Reported per
mode, from the manager's `checkpoint_saved` events: the time the step loop is
blocked (the whole save when blocking; staging to host memory when async),
the time until the checkpoint is committed, the size of one checkpoint, and
the median step time while an async write is in flight next to the median
step time without one (what the background write costs the step loop).
Prints a table last and appends dated rows to OUTDIR/checkpoint.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RUNS, environment, model_args, sync  # noqa: E402
from titan_k3.config import load_job_config  # noqa: E402
from titan_k3.metrics.run_dir import read_jsonl  # noqa: E402


def timed_step(trainer) -> float:
    sync()
    t = time.perf_counter()
    trainer.train_step()
    sync()
    return time.perf_counter() - t


def run_mode(mode: str, flavor: str, seq: int, batch: int, saves: int, out: Path) -> dict:
    from titan_k3.train import Trainer

    name = f"ckpt-{mode}"
    shutil.rmtree(RUNS / name, ignore_errors=True)
    cfg = load_job_config([
        *model_args(flavor), "--training.seq_len", str(seq),
        "--training.local_batch_size", str(batch), "--training.compute_dtype", "bfloat16", "--training.steps", "100",
        "--invariants.enable", "false", "--metrics.log_freq", "1000", "--job.dump_folder", str(RUNS),
        "--job.name", name, "--checkpoint.enable", "true", "--checkpoint.async_mode", mode,
        "--checkpoint.interval", "1000", "--checkpoint.keep_latest_k", "1",
    ])
    trainer = Trainer(cfg)
    plain = [timed_step(trainer) for _ in range(4)][1:]
    during = []
    for _ in range(saves):
        trainer.step += 1
        trainer.checkpointer.save(trainer.step)
        # NOTE: the step right after an async save runs while the background thread writes.
        during.append(timed_step(trainer))
    trainer.checkpointer.wait()
    trainer.close()
    events = [e for e in read_jsonl(trainer.run_dir / "events.jsonl") if e.get("kind") == "checkpoint_saved"]
    if len(events) != saves:
        raise RuntimeError(f"{mode}: expected {saves} checkpoint_saved events, found {len(events)}")
    return {
        "mode": mode, "flavor": flavor, "seq": seq, "batch": batch,
        "blocked_s": statistics.median(e["blocking_seconds"] for e in events),
        "committed_s": statistics.median(e["seconds"] for e in events),
        "size_gib": events[-1]["bytes"] / 2**30,
        "step_ms": 1e3 * statistics.median(plain),
        "step_during_write_ms": 1e3 * statistics.median(during),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="k3-mini")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--saves", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    rows = [run_mode(mode, args.flavor, args.seq, args.batch, args.saves, args.out) for mode in ("disabled", "async")]
    for r in rows:
        print(json.dumps(r), flush=True)
    header = ("| date | commit | GPU | torch | flavor | mode | step loop blocked s | committed after s | size GiB | "
              "step ms | step ms during async write |\n|" + "---|" * 11)
    lines = [
        f"| {env['date']} | {env['commit']} | {env['gpu']} | {env['torch']} | {r['flavor']} B{r['batch']} T{r['seq']} | "
        f"{'blocking' if r['mode'] == 'disabled' else 'async'} | {r['blocked_s']:.2f} | {r['committed_s']:.2f} | "
        f"{r['size_gib']:.2f} | {r['step_ms']:.0f} | {r['step_during_write_ms']:.0f} |"
        for r in rows
    ]
    table = header + "\n" + "\n".join(lines)
    with open(args.out / "checkpoint.md", "a") as f:
        f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
