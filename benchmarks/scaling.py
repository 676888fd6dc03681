"""Data-parallel scaling of k3-mini training: one GPU vs FSDP2 vs FSDP2 + EP on the same global batch.

    PYTHONPATH=. python benchmarks/scaling.py --out OUTDIR [--gpus 2 --steps 120 --seq 4096 --batch 8] [-- EXTRA]

Each setup is a real `torchrun -m titan_k3.train` launch (the trainer users
run, full recipe), on the same global batch: one GPU runs `--gpus` micro-batches
of gradient accumulation per update, N GPUs one micro-batch each. Extra
trainer overrides after `--` apply to every setup (e.g. `--compile.enable true`).
A noise reference ("1 GPU, split finer": the same global batch in
half-size micro-batches) measures what summation order alone does to the
losses. Reported per setup: the loss at every logged update, its largest
absolute and relative gap to the one-GPU run and that gap over the noise
reference's, steady training tokens/s (time-weighted over the
logging windows after `--warmup-step`), tokens/s per GPU, and scaling =
rate / (N x one-GPU rate). Prints a table last and appends it to OUTDIR/scaling.md;
OUTDIR/scaling.json holds every finished setup's row from the moment it finishes.
`--weak A` measures weak scaling instead: every GPU, the one-GPU run included, runs A micro-batches per
update, so the global batch grows with the GPUs and only the rates are compared.
With `-- --profiling.enable true --profiling.start_step U`, each setup's per-rank
profile summaries (GPU busy / idle / exposed communication) land in OUTDIR too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RUNS, environment, model_args, write_results  # noqa: E402
from titan_k3.metrics.run_dir import read_jsonl  # noqa: E402
from titan_k3.tools.summarize import steady_state  # noqa: E402


NOISE = "1 GPU, split finer"


def setups(gpus: int, batch: int, weak_accum: int = 0) -> dict[str, tuple[int, list[str]]]:
    """name -> (processes, overrides); the one-GPU run accumulates what N GPUs run side by side.

    The noise reference runs the same global batch on one GPU in micro-batches
    half as large: the same math summed in another order, so its loss gap to
    "1 GPU" is what rounding alone does to the trajectory (the bf16 noise a
    parallel setup's gap is judged against).
    weak_accum = A > 0 (weak scaling): every GPU, the one-GPU run included, runs A micro-batches per update,
    so N GPUs train an N times larger global batch (no loss comparison, no noise reference).
    """
    if weak_accum:
        accum = ["--training.grad_accum", str(weak_accum)]
        return {"1 GPU": (1, accum), f"FSDP2 x{gpus}": (gpus, accum),
                f"FSDP2 x{gpus} + EP{gpus}": (gpus, [*accum, "--parallelism.expert_parallel_degree", str(gpus)])}
    finer = [NOISE] if batch % 2 == 0 else []
    return {
        "1 GPU": (1, ["--training.grad_accum", str(gpus)]),
        **{name: (1, ["--training.grad_accum", str(2 * gpus), "--training.local_batch_size", str(batch // 2)])
           for name in finer},
        f"FSDP2 x{gpus}": (gpus, []),
        f"FSDP2 x{gpus} + EP{gpus}": (gpus, ["--parallelism.expert_parallel_degree", str(gpus)]),
    }


def launch(name: str, nproc: int, overrides: list[str], args, extra: list[str]) -> Path:
    slug = name.replace(" ", "").replace("+", "-").lower()
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "-m", "titan_k3.train", *model_args(args.flavor),
        "--training.seq_len", str(args.seq), "--training.local_batch_size", str(args.batch),
        "--training.steps", str(args.steps), "--training.compute_dtype", "bfloat16",
        "--lr_scheduler.warmup_steps", str(min(10, args.steps // 2)), "--metrics.log_freq", str(args.log_freq),
        "--invariants.interval", str(args.log_freq * 5),
        "--job.dump_folder", str(RUNS), "--job.name", slug, *overrides, *extra,
    ]
    shutil.rmtree(RUNS / slug, ignore_errors=True)
    RUNS.mkdir(parents=True, exist_ok=True)
    log = RUNS / f"{slug}.log"
    print("$", " ".join(cmd), f"> {log}", flush=True)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"{name}: {time.perf_counter() - t0:.0f} s wall, exit status {rc}", flush=True)
    if rc != 0:
        raise LaunchFailed(f"exit status {rc}: {_first_error(log)}")
    return RUNS / slug


def _spread(row: dict) -> str:
    """' (290K / 301K / 324K)': the window rates' min / median / max, where the row has them."""
    spread = row.get("window_spread")
    return f" ({' / '.join(f'{x / 1e3:.0f}K' for x in spread)})" if spread else ""


def _startup_seconds(run_dir: Path) -> float | None:
    """Rank 0's "startup" event: seconds from its process start to the end of its first update (None if absent)."""
    events = read_jsonl(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    return next((e["seconds"] for e in events if e["kind"] == "startup"), None)


def _loss_gaps(run: dict, base: dict) -> tuple[float, float]:
    """(largest absolute, largest relative) loss difference to `base` over the updates both logged."""
    common = [s for s in run["losses"] if s in base["losses"]]
    return (max(abs(run["losses"][s] - base["losses"][s]) for s in common),
            max(abs(run["losses"][s] / base["losses"][s] - 1) for s in common))


class LaunchFailed(RuntimeError):
    """A setup's torchrun exited non-zero; the message carries the first error line of its log."""


def _first_error(log: Path) -> str:
    """The first line of the log that names an error (the cause, before torchrun's own report), else its tail."""
    lines = log.read_text(errors="replace").splitlines()
    hits = [ln.strip() for ln in lines if "Error" in ln or ln.startswith("error:")]
    return (hits[0] if hits else " / ".join(lines[-3:]))[:300] + f" (log: {log})"


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--flavor", default="k3-mini", help="debug runs the script on CPU (gloo) to check it")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--log-freq", type=int, default=10)
    p.add_argument("--warmup-step", type=int, default=20, help="steady rates use logging windows after this update")
    p.add_argument("--only", nargs="+", default=[], help="setup names to run (default: all)")
    p.add_argument("--merge", type=Path, nargs="+", default=[],
                   help="scaling.json files of earlier launches (e.g. --only runs on separate GPUs): their rows join "
                        "this table in setup order, and setups they hold are not launched again")
    p.add_argument("--weak", type=int, default=0, metavar="A",
                   help="weak scaling: every GPU (the one-GPU run too) runs A micro-batches per update; the global "
                        "batch grows with the GPUs, so losses are not compared")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment()
    earlier = {r["setup"]: {**r, "losses": {int(s): loss for s, loss in r["losses"].items()}}  # JSON keys are str
               for path in args.merge for r in json.loads(path.read_text())["rows"] if "error" not in r}
    rows = []
    for name, (nproc, overrides) in setups(args.gpus, args.batch, args.weak).items():
        if name in earlier:
            rows.append(earlier[name])
            continue
        if args.only and name not in args.only:
            continue
        try:
            run_dir = launch(name, nproc, overrides, args, extra)
        except LaunchFailed as e:  # one failing setup must not lose the others' numbers
            rows.append({"setup": name, "gpus": nproc, "error": str(e)})
            print(f"{name}: {e}", flush=True)
            continue
        for summary in sorted(run_dir.glob("profile-rank*.txt")):  # with `-- --profiling.enable true`
            (args.out / "profiles").mkdir(exist_ok=True)
            shutil.copy(summary, args.out / "profiles" / f"profile-{run_dir.name}-{summary.stem.split('-')[-1]}.txt")
        records = read_jsonl(run_dir / "metrics.jsonl")
        steady = steady_state(records, args.warmup_step)
        rows.append({"setup": name, "gpus": nproc, "steps": args.steps, "losses": {r["step"]: r["loss"] for r in records},
                     "tokens_per_s": steady.tokens_per_second, "window_spread": steady.spread, "mfu": steady.mfu,
                     "startup_s": _startup_seconds(run_dir),
                     "peak_gib": max((r.get("memory_peak_allocated_gib", 0.0) for r in records), default=0.0)})
        print(json.dumps(rows[-1]), flush=True)
        # NOTE: saved after every setup, so a run stopped by a time limit keeps the setups it finished (and a
        # later `--merge` of this file takes them); the table below rewrites it whole.
        (args.out / "scaling.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    base = next((r for r in rows if r["setup"] == "1 GPU" and "error" not in r), None)
    noise = next((r for r in rows if r["setup"] == NOISE and "error" not in r), None)
    header = ("| date | commit | GPUs | torch | setup | shape | updates | loss at logged updates (first / mid / last) | "
              "max loss gap vs 1 GPU, abs / rel | gap / noise | tokens/s (all GPUs; windows min / median / max) | "
              "tokens/s per GPU | scaling vs 1 GPU "
              "| MFU | peak GiB per GPU | process start to first update s |\n|" + "---|" * 16)
    noise_gap = _loss_gaps(noise, base)[0] if noise is not None and base is not None else None
    lines = []
    for r in rows:
        lead = f"| {env['date']} | {env['commit']} | {r['gpus']}x {env['gpu']} | {env['torch']} | {r['setup']} |"
        if "error" in r:
            lines.append(f"{lead} B{args.batch} T{args.seq} | {args.steps} | — | — | — | — | — | — | — | — | failed: {r['error']} |")
            continue
        steps = sorted(r["losses"])
        shown = " / ".join(f"{r['losses'][s]:.4f}" for s in (steps[0], steps[len(steps) // 2], steps[-1]))
        gap, vs_noise, scaling = "—", "—", "—"
        if base is not None:
            scaling = f"{r['tokens_per_s'] / (r['gpus'] * base['tokens_per_s']):.2f}"
        if base is not None and not args.weak:
            r["max_abs_gap"], r["max_rel_gap"] = _loss_gaps(r, base)
            gap = f"{r['max_abs_gap']:.4f} / {r['max_rel_gap']:.2%}"
            if noise_gap and r is not noise and r is not base:
                vs_noise = f"{r['max_abs_gap'] / noise_gap:.1f}x"
        startup = f"{r['startup_s']:.1f}" if r.get("startup_s") is not None else "—"
        seqs = args.batch * (r["gpus"] * args.weak if args.weak else args.gpus)
        lines.append(f"{lead} B{args.batch} T{args.seq}, global {seqs} seqs | {r.get('steps', '—')} | "
                     f"{shown} | {gap} | {vs_noise} | {r['tokens_per_s']:,.0f}{_spread(r)} | {r['tokens_per_s'] / r['gpus']:,.0f} | "
                     f"{scaling} | {100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {startup} |")
    table = header + "\n" + "\n".join(lines)
    if extra:
        table += f"\n\nExtra trainer overrides for every setup: `{' '.join(extra)}`"
    write_results(args.out, "scaling", table, env, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
