"""Summarise a run directory: `python -m titan_k3.tools.summarize RUN_DIR [--warmup-step N] [--out DIR]`.

Reads only the run directory's files (metrics.jsonl, events.jsonl,
config.toml) and writes summary.md plus PNG plots (loss, both throughput
clocks, grad norms, expert load) into DIR (default RUN_DIR/summary).

Steady training tokens/s is time-weighted over the complete logging windows
that start at or after the warm-up step: a window is two consecutive records
of one session; its tokens and training seconds are the differences of their
`tokens_seen` and `training_seconds`, and the rate is the sum of the tokens
over the sum of the seconds (never a mean of per-window rates).

Resumed runs: each session (process) restarts both clocks, and its records
carry `session_start` and `session_tokens`. A session that resumed from a
checkpoint older than the last logged update redoes updates, so metrics.jsonl
holds those steps twice: the summary keeps the later session's rows
(`final_records`), counts every session's work once, and gives the session
rate of the last session alone.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import tomli

from titan_k3.textfiles import unreadable
from titan_k3.tools.run_records import read_events, read_records, run_dir_problem

PROBES = {
    "smoke": "does the whole step execute end to end?",
    "overfit": "can it learn (memorise one repeated batch)?",
    "stability": "does it stay stable over many successive batches?",
    "throughput": "how fast does it train (steady tokens/s, MFU, memory)?",
}
# Recipes named otherwise whose question is one of the above.
_PROBE_ALIASES = {"pilot": "throughput", "pretrain": "throughput"}
OVERFIT_RATIO = 0.05


@dataclass
class Steady:
    tokens: float
    seconds: float
    windows: int
    mfu: float
    rates: tuple[float, ...] = ()  # each counted window's tokens/s, in step order

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")

    @property
    def spread(self) -> tuple[float, float, float]:
        """(min, median, max) of the window rates: how steady the steady rate was (nan without windows)."""
        if not self.rates:
            return (float("nan"),) * 3
        return min(self.rates), statistics.median(self.rates), max(self.rates)


def final_records(records: list[dict]) -> tuple[list[dict], int]:
    """(the records as the run finally stands, in increasing step order; how many earlier rows were redone).

    A record at or below an earlier record's step was logged by a session that
    resumed from an older checkpoint and redid those updates: it replaces them.
    """
    kept: list[dict] = []
    for r in records:
        while kept and kept[-1]["step"] >= r["step"]:
            kept.pop()
        kept.append(r)
    return kept, len(records) - len(kept)


def _same_session(prev: dict, cur: dict) -> bool:
    if "session_start" in prev and "session_start" in cur:
        return prev["session_start"] == cur["session_start"]
    # Records written before sessions were marked: a session's clocks only grow.
    return cur["training_seconds"] > prev["training_seconds"]


def windows(records: list[dict]) -> list[tuple[dict, dict]]:
    """Complete logging windows: consecutive records of one session (step, tokens and training clock all grow).

    The first record's window starts at step 0 with nothing counted; a resumed
    session (its clocks restart) opens no window across the restart.
    """
    start = {"step": 0, "tokens_seen": 0, "training_seconds": 0.0}
    out = []
    for prev, cur in zip([start, *records[:-1]], records):
        if cur["step"] > prev["step"] and cur["tokens_seen"] > prev["tokens_seen"] and \
                cur["training_seconds"] > prev["training_seconds"] and (prev is start or _same_session(prev, cur)):
            out.append((prev, cur))
    return out


def sessions(records: list[dict]) -> int:
    """How many sessions (the first run and each resume) wrote these records."""
    return 1 + sum(not _same_session(prev, cur) for prev, cur in zip(records, records[1:])) if records else 0


def checked_updates(records: list[dict]) -> int | None:
    """Updates whose invariant checks ran, over every session (each session counts from 0; redone updates count
    again: their checks ran). None: the records predate the count."""
    if not any("invariant_checked_updates" in r for r in records):
        return None
    ends = [prev for prev, cur in zip(records, records[1:]) if not _same_session(prev, cur)] + records[-1:]
    return sum(r.get("invariant_checked_updates", 0) for r in ends)


def invariants_row(violations: dict[str, int], checked: int | None) -> str:
    """The summary's invariants cell: violations by check, and how many updates were checked."""
    found = ", ".join(f"{k}: {v}" for k, v in violations.items()) or "0"
    if checked is None:
        return found
    return f"{found} in {checked:,} checked updates" if checked else f"{found} (no update was checked)"


def session_rate(last: dict) -> float:
    """The last session's tokens/s on its session clock: its own tokens over its own wall time."""
    if last["session_seconds"] <= 0:
        return float("nan")
    # NOTE: records from before session_tokens existed count the run's tokens; right for a run never resumed.
    return last.get("session_tokens", last["tokens_seen"]) / last["session_seconds"]


def steady_state(records: list[dict], warmup_step: int = 0) -> Steady:
    """Tokens and training seconds summed over the windows starting at or after `warmup_step`."""
    tokens = seconds = mfu_seconds = 0.0
    rates = []
    for prev, cur in windows(records):
        if prev["step"] < warmup_step:
            continue
        dt = cur["training_seconds"] - prev["training_seconds"]
        tokens += cur["tokens_seen"] - prev["tokens_seen"]
        seconds += dt
        # A record's MFU is its window's rate times a constant, so weighting by time recovers the steady MFU.
        mfu_seconds += cur.get("mfu", float("nan")) * dt
        rates.append((cur["tokens_seen"] - prev["tokens_seen"]) / dt)
    return Steady(tokens, seconds, len(rates), mfu_seconds / seconds if seconds > 0 else float("nan"), tuple(rates))


def probe_of(config: dict) -> str | None:
    """The probe a run answers, from its description ('overfit: ...') or its recipe file's name."""
    job = config.get("job", {})
    words = re.findall(r"[a-z]+", f"{job.get('description', '')} {Path(job.get('config_file', '')).stem}".lower())
    for word in words:
        if word in PROBES:
            return word
        if word in _PROBE_ALIASES:
            return _PROBE_ALIASES[word]
    return None


def _verdict(probe: str | None, records: list[dict], config: dict, steady: Steady) -> str:
    if probe is None or not records:
        return "no probe recognised in job.description or the recipe name" if records else "no metrics recorded"
    last, first = records[-1], records[0]
    steps = config.get("training", {}).get("steps")
    if probe == "smoke":
        ok = steps is None or last["step"] >= steps
        return f"{'yes' if ok else 'no'}: reached step {last['step']}" + (f" of {steps}" if steps else "") + \
            f", {last.get('skipped_updates', 0)} skipped updates"
    if probe == "overfit":
        # NOTE: against the session's first update, which every record carries (records before it: the first logged
        # one); by the first log step of one repeated batch the loss is already near its floor.
        step, start = first.get("session_first_step", first["step"]), first.get("session_first_loss", first["loss"])
        ratio = last["loss"] / start if start else float("nan")
        return (f"{'yes' if ratio < OVERFIT_RATIO else 'no'}: final loss is {100 * ratio:.2f}% of update {step}'s "
                f"{start:.4f} (target < {100 * OVERFIT_RATIO:.0f}%)")
    if probe == "stability":
        skipped = last.get("skipped_updates", 0)
        return f"{'yes' if skipped == 0 else 'no'}: {skipped} skipped updates, loss {first['loss']:.4f} -> {last['loss']:.4f}"
    return f"{steady.tokens_per_second:,.0f} steady training tokens/s, MFU {100 * steady.mfu:.2f}%"


def _moe_layers(records: list[dict]) -> list[int]:
    layers = {int(m.group(1)) for r in records for k in r if (m := re.match(r"^moe/(\d+)/load$", k))}
    return sorted(layers)


def plot(records: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    paths = []

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in records])
    ax.set(xlabel="step", ylabel="loss", title="training loss")
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["tokens_per_second_training"] for r in records], label="training clock (window)")
    ax.plot(steps, [r["tokens_per_second_session"] for r in records], label="session clock (this session)")
    ax.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax.legend()
    save(fig, "throughput.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["grad_norm"] for r in records], label="global", color="black")
    for group in sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("grad_norm/")}):
        ax.plot(steps, [r.get(f"grad_norm/{group}", float("nan")) for r in records], label=group)
    ax.set(xlabel="step", ylabel="grad norm (before clipping)", title="gradient norms", yscale="log")
    ax.legend(fontsize=8)
    save(fig, "grad_norm.png")

    layers = _moe_layers(records)
    if layers:
        import numpy as np

        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        last = next(r for r in reversed(records) if f"moe/{layers[0]}/load" in r)
        load = np.array([last[f"moe/{layer}/load"] for layer in layers])
        im = axes[0].imshow(load * load.shape[1], aspect="auto", cmap="viridis", interpolation="nearest")
        axes[0].set(xlabel="expert", ylabel="MoE layer", yticks=range(len(layers)), yticklabels=layers,
                    title=f"expert load / uniform share, step {last['step']}")
        fig.colorbar(im, ax=axes[0])
        dead = np.array([[r.get(f"moe/{layer}/dead_fraction", np.nan) for r in records] for layer in layers])
        im = axes[1].imshow(dead, aspect="auto", cmap="magma", vmin=0, vmax=1, interpolation="nearest",
                            extent=(steps[0], steps[-1], len(layers) - 0.5, -0.5))
        axes[1].set(xlabel="step", ylabel="MoE layer", yticks=range(len(layers)), yticklabels=layers,
                    title="dead-expert fraction")
        fig.colorbar(im, ax=axes[1])
        save(fig, "expert_load.png")
    return paths


RECORD_KEYS = ("step", "tokens_seen", "training_seconds", "session_seconds", "loss", "grad_norm",
               "tokens_per_second_training", "tokens_per_second_session")
"""What the summary and its plots read of every metrics.jsonl record (the trainer writes each in every record)."""


def load(run_dir: Path) -> tuple[list[dict], list[dict], dict]:
    """(metrics.jsonl's records, events.jsonl's events, config.toml) of a run directory, each checked as the trainer
    writes it; ValueError of one line naming the file otherwise."""
    run_dir = Path(run_dir)
    if problem := run_dir_problem(run_dir):
        raise ValueError(f"run_dir={problem}")
    records = read_records(run_dir / "metrics.jsonl", RECORD_KEYS)
    events = read_events(run_dir / "events.jsonl")
    config = {}
    if (run_dir / "config.toml").exists():
        try:
            config = tomli.loads((run_dir / "config.toml").read_text())
        except tomli.TOMLDecodeError as e:
            raise ValueError(f"{run_dir / 'config.toml'}: not valid TOML ({e})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(unreadable(str(run_dir / "config.toml"), e)) from None
    return records, events, config


def summarize(run_dir: Path, warmup_step: int = 0, loaded: tuple[list[dict], list[dict], dict] | None = None
              ) -> tuple[str, dict]:
    """(Markdown text, the numbers as a dict) for one run directory (`loaded`: its `load(run_dir)`, read once)."""
    run_dir = Path(run_dir)
    records, events, config = loaded or load(run_dir)
    if not records:
        raise ValueError(f"run_dir={str(run_dir)!r}: metrics.jsonl has no records")
    checked = checked_updates(records)
    records, redone = final_records(records)
    steady = steady_state(records, warmup_step)
    if warmup_step and not steady.windows:
        starts = [prev["step"] for prev, _ in windows(records)]
        raise ValueError(f"--warmup-step={warmup_step}: no logging window starts at or after it (the last starts at "
                         f"update {max(starts, default=0)}: the run's steady rate would be nan)")
    last = records[-1]
    probe = probe_of(config)

    def peak(key):
        values = [r[key] for r in records if key in r]
        return max(values) if values else None

    numbers = {
        "steps": last["step"],
        "tokens_seen": last["tokens_seen"],
        "warmup_step": warmup_step,
        "steady_windows": steady.windows,
        "steady_tokens_per_second_training": steady.tokens_per_second,
        "steady_mfu": steady.mfu,
        "tokens_per_second_session": session_rate(last),
        "sessions": sessions(records),
        "redone_records": redone,
        "memory_peak_allocated_gib": peak("memory_peak_allocated_gib"),
        "memory_peak_reserved_gib": peak("memory_peak_reserved_gib"),
        "host_rss_gib": peak("host_rss_gib"),
        "loss_start": records[0]["loss"],
        "loss_end": last["loss"],
        "skipped_updates": last.get("skipped_updates", 0),
        "probe": probe,
        "events": {kind: sum(e["kind"] == kind for e in events) for kind in sorted({e["kind"] for e in events})},
        "invariant_violations": dict(sorted(Counter(e.get("check", "unnamed") for e in events
                                                    if e["kind"] == "invariant_violation").items())),
        "invariant_checked_updates": checked,
    }
    gib = lambda v: "n/a (no accelerator)" if v is None else f"{v:.2f} GiB"  # noqa: E731
    lines = [
        f"# Run `{run_dir.name}`",
        "",
        f"**Probe:** {probe or 'none'}" + (f" — {PROBES[probe]}" if probe else ""),
        f"**Answer:** {_verdict(probe, records, config, steady)}",
        "",
        "| measure | value |",
        "|---|---|",
        f"| updates / tokens | {last['step']:,} / {last['tokens_seen']:,} |",
        f"| steady training tokens/s (windows from step {warmup_step}: {steady.windows}) | {steady.tokens_per_second:,.1f} |",
        f"| session tokens/s (last session) | {numbers['tokens_per_second_session']:,.1f} |",
        f"| sessions (start + resumes) | {numbers['sessions']}"
        + (f" ({redone} logged records redone after a resume; the later ones kept)" if redone else "") + " |",
        f"| steady MFU | {100 * steady.mfu:.3f}% |",
        f"| peak memory allocated / reserved | {gib(numbers['memory_peak_allocated_gib'])} / {gib(numbers['memory_peak_reserved_gib'])} |",
        f"| peak host RSS | {gib(numbers['host_rss_gib'])} |",
        # NOTE: the first logged update, not update 1: the trainer logs every metrics.log_freq updates.
        f"| loss at update {records[0]['step']:,} (first logged) -> {last['step']:,} | {numbers['loss_start']:.4f} -> "
        f"{numbers['loss_end']:.4f} |",
        f"| skipped updates | {numbers['skipped_updates']} |",
        f"| events | {', '.join(f'{k}: {v}' for k, v in numbers['events'].items()) or 'none'} |",
        f"| invariant violations | {invariants_row(numbers['invariant_violations'], checked)} |",
        "",
        "![loss](loss.png) ![throughput](throughput.png) ![grad norm](grad_norm.png)",
    ]
    if _moe_layers(records):
        lines.append("![expert load](expert_load.png)")
    return "\n".join(lines) + "\n", numbers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m titan_k3.tools.summarize", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--warmup-step", type=int, default=0, help="steady rates use windows starting at or after this step")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default RUN_DIR/summary)")
    args = parser.parse_args(argv)
    if args.warmup_step < 0:
        print(f"error: --warmup-step={args.warmup_step}: must be >= 0", file=sys.stderr)
        return 2
    try:
        # NOTE: read once: a run still being written adds records between two reads, and the plots are the summary's.
        loaded = load(args.run_dir)
        text, _ = summarize(args.run_dir, args.warmup_step, loaded)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "summary"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.md").write_text(text)
        plot(final_records(loaded[0])[0], out)
    except OSError as e:
        print(f"error: --out {str(out)!r}: cannot write the summary there ({e.strerror or e})", file=sys.stderr)
        return 2
    print(text)
    print(f"written: {out}/summary.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
