"""What holds the accelerator's memory at its peak: the allocator's trace replayed to the moment of most bytes
allocated, and the blocks alive then, grouped by where they were allocated.

    baseline = start_recording()          # before the work whose peak is wanted
    ...                                   # build, warm up, capture, train
    text = peak_report(torch.cuda.memory._snapshot(), baseline, "title")
    stop_recording()

`torch.cuda.max_memory_allocated` says how high the peak is; this says what it is made of and when it happened
(the call stack of the allocation that set it). Each block alive at the peak is attributed to the innermost frame
of its allocation's Python stack in the repository (`repo_frame`: code in titan_k3/, kernels/ or benchmarks/), and
also to the innermost frame of any file (which, for compiled code, is the generated module's line). Allocations
inside a CUDA graph's capture count like any other: a graph's private pool holds them while it lives.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch

from titan_k3.config.errors import ConfigError

GIB = 2**30
REPO = Path(__file__).resolve().parents[2]
REPO_DIRS = ("titan_k3", "kernels", "benchmarks")
MAX_ENTRIES = 2_000_000
"""Events the allocator keeps (a ring: past it the oldest go). A k3-mini update replayed from its CUDA graph adds
almost none; an eager one some thousands."""


def start_recording(device: torch.device | None = None) -> int:
    """Start the allocator's trace with Python stacks (CUDA only); returns the bytes allocated on `device` now (the
    baseline: blocks allocated before the trace show in it only when they are freed)."""
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=MAX_ENTRIES)
    return torch.cuda.memory_allocated(device)


def stop_recording() -> None:
    torch.cuda.memory._record_memory_history(enabled=None)


def replay_to_peak(trace: list[dict], baseline: int) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the alloc that reached it, {addr: alloc entry} alive at that moment) of one device's
    trace, starting from `baseline` bytes allocated before the trace began.

    An alloc adds its size, a completed free takes it away (the allocator's own count: a block freed while another
    stream still uses it stays allocated until its events complete). A free of a block allocated before the trace
    lowers the count without being in the live set: the baseline's blocks are not attributed (index -1 when the
    peak is the baseline itself).
    """
    live: dict[int, dict] = {}
    now = peak = baseline
    peak_index, peak_live = -1, {}
    for i, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = entry
            now += entry["size"]
            if now > peak:
                peak, peak_index, peak_live = now, i, None  # copied lazily: the peak may be passed many times
        elif action == "free_completed":
            now -= entry["size"]
            if peak_live is None:
                peak_live = dict(live)
            live.pop(entry["addr"], None)
    if peak_live is None:
        peak_live = dict(live)
    return peak, peak_index, peak_live


def _frame(f: dict) -> str:
    return f"{f.get('filename', '?')}:{f.get('line', '?')} {f.get('name', '?')}"


def repo_frame(frames: list[dict], root: Path = REPO) -> str:
    """The innermost frame (frames innermost first, as the allocator records them) in the repository's code, as
    "path:line function" relative to its root; "(outside the repository)" when no frame is."""
    for f in frames:
        path = Path(f.get("filename", ""))
        try:
            rel = path.resolve().relative_to(root)
        except (ValueError, OSError):
            continue
        if rel.parts and rel.parts[0] in REPO_DIRS and rel.name != "memory_peak.py":
            return f"{rel}:{f.get('line', '?')} {f.get('name', '?')}"
    return "(outside the repository)"


def _group_table(live: dict[int, dict], key, top: int) -> list[str]:
    groups: dict[str, list[int]] = defaultdict(list)
    for entry in live.values():
        groups[key(entry)].append(entry["size"])
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    lines = ["| GiB | blocks | largest block MiB | allocated at |", "|---|---|---|---|"]
    for where, sizes in rows[:top]:
        lines.append(f"| {sum(sizes) / GIB:.3f} | {len(sizes)} | {max(sizes) / 2**20:.1f} | {where} |")
    if len(rows) > top:
        rest = [s for _, sizes in rows[top:] for s in sizes]
        lines.append(f"| {sum(rest) / GIB:.3f} | {len(rest)} | {max(rest) / 2**20:.1f} | ({len(rows) - top} more places) |")
    return lines


def peak_report(snapshot: dict, baseline: int, title: str, device: int = 0, top: int = 25,
                root: Path = REPO) -> str:
    """Markdown: the peak (GiB, the stack of the allocation that reached it) and the blocks alive at it grouped by
    the innermost repository frame and by the innermost frame of any file, largest first."""
    traces = snapshot.get("device_traces") or [[]]
    trace = traces[device] if device < len(traces) else []
    peak, index, live = replay_to_peak(trace, baseline)
    traced = sum(e["size"] for e in live.values())
    lines = [f"# {title}: what is allocated at the peak", "",
             f"Peak {peak / GIB:.3f} GiB allocated: {traced / GIB:.3f} GiB in {len(live)} blocks allocated while the "
             f"trace ran, {(peak - traced) / GIB:.3f} GiB allocated before it ({baseline / GIB:.3f} GiB then). "
             f"Trace: {len(trace)} events."]
    if len(trace) >= MAX_ENTRIES:
        lines += ["", f"**The trace reached its limit of {MAX_ENTRIES:,} events: its oldest are gone, so the peak and "
                  "its blocks above are undercounted. Record fewer updates.**"]
    if index >= 0:
        frames = trace[index].get("frames", [])
        lines += ["", f"The allocation that reached it ({trace[index]['size'] / 2**20:.1f} MiB), innermost frame first:",
                  "```", *(_frame(f) for f in frames[:20]), "```"]
    lines += ["", "By the innermost frame in the repository:", ""]
    lines += _group_table(live, lambda e: repo_frame(e.get("frames", []), root), top)
    lines += ["", "By the innermost frame (compiled code: the generated module's line):", ""]
    lines += _group_table(live, lambda e: _frame(e["frames"][0]) if e.get("frames") else "(no stack)", top)
    return "\n".join(lines) + "\n"


def check_memory_peak(updates: int, device: torch.device) -> None:
    """`profiling.memory_peak_updates` can be recorded on `device` (ConfigError, one line)."""
    if updates and device.type != "cuda":
        raise ConfigError(f"config key 'profiling.memory_peak_updates' = {updates}: the allocator's trace needs "
                          f"a CUDA device; this run is on {device}")


class PeakRecorder:
    """`[profiling] memory_peak_updates = N`: the allocator's trace from construction (before the model's build)
    through update N, then memory-peak-rank{R}.md in the run directory (`peak_report`).

    Writing the report never ends the training it observes: a failure is printed and logged as a
    "memory_peak_failed" event, and the trace stops either way.
    """

    def __init__(self, updates: int, device: torch.device):
        check_memory_peak(updates, device)
        self.updates, self.baseline, self.device = updates, None, device
        if updates:
            self.baseline = start_recording(device)

    def after(self, update: int, run_dir: Path, rank: int, events=None) -> Path | None:
        """After each update (1-based): at update N, write the report and stop the trace; its path, else None."""
        if self.baseline is None or update != self.updates:
            return None
        path = Path(run_dir) / f"memory-peak-rank{rank}.md"
        try:
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            path.write_text(peak_report(torch.cuda.memory._snapshot(), self.baseline,
                                        f"rank {rank}, the model's build and updates 1-{update}", device=index))
        except Exception as e:  # noqa: BLE001 - a diagnostic must not end the training it observes
            message = f"update {update}: writing the memory-peak report failed: {type(e).__name__}: {e}"
            print(f"[memory_peak] {message}", flush=True)
            if events is not None:
                events.emit("memory_peak_failed", message, step=update)
            return None
        finally:
            stop_recording()
            self.baseline = None
        if events is not None:
            events.emit("memory_peak", f"the peak of the build and updates 1-{update}: {path}", step=update)
        return path
