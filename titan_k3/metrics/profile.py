"""torch.profiler over chosen training updates, summarised where the time goes.

`[profiling] enable = true` profiles `steps` updates from `start_step` on every
rank and writes, per rank, into the run directory:
  profile-rank{R}.txt        the summary below (`profile_report`)
  trace-rank{R}.json.gz      a Chrome / Perfetto trace (`trace = true`)

The summary answers what a step-time question needs first:
  - GPU timeline over the profiled wall time: busy (any kernel running), idle
    (host waits, launch gaps), compute, communication (NCCL kernels) and the
    communication no compute overlapped (exposed), as unions of kernel intervals;
  - GPU time by kind (matmul, communication, Triton, other kernels);
  - where the GPU sits idle: the gaps between kernels by size, and the largest with
    the kernels either side and the host event running over each (`gap_report`);
  - kernels by GPU time, operators by self GPU time, the optimizer's named ranges;
  - every kernel by name (count, total, mean), and GPU time by the scope that
    launched it (the autograd node, compiled graph or named range around the
    launch): where an elementwise kernel's hundred calls come from. Kernels
    replayed from a CUDA graph have no launching op and count as "(CUDA graph)";
  - where the profiler recorded input shapes (`record_shapes=True`), operators by
    input shapes: which of an op's calls cost (e.g. a sum over a [P, D] partial
    against one over [D, P]); most useful on an eager step, whose ops launch
    their own kernels.
Without CUDA (CPU runs, tests) the timeline is absent and the tables hold host time.
"""

from __future__ import annotations

import bisect
import gzip
import shutil
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType

# Kernel name fragments by kind; the first kind that matches wins.
KINDS = (
    ("communication", ("nccl", "all_gather", "reduce_scatter", "allreduce", "all_to_all", "sendrecv")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "wgmma", "bmm", "matmul")),
)


def kernel_kind(name: str) -> str:
    """"communication", "matmul", "triton" or "other" for a GPU kernel's name.

    Triton kernels (ours, and inductor's fused ones) carry a bare identifier as their
    name; CUDA C++ kernels (torch's own, cuDNN) a signature ("void at::native::...<...>(...)").
    """
    low = name.lower()
    for kind, fragments in KINDS:
        if any(f in low for f in fragments):
            return kind
    return "triton" if name.isidentifier() else "other"


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals, overlaps counted once."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def exposed_length(covered: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Length of the union of `covered` that no interval of `cover` overlaps."""
    return union_length(covered + cover) - union_length(cover)


def timeline(kernels: list[tuple[str, float, float]], wall: float) -> dict[str, float]:
    """Shares of `wall` from (name, start, end) kernel intervals (one time unit throughout)."""
    comm = [(s, e) for name, s, e in kernels if kernel_kind(name) == "communication"]
    compute = [(s, e) for name, s, e in kernels if kernel_kind(name) != "communication"]
    busy = union_length(comm + compute)
    return {
        "wall": wall,
        "busy": busy / wall,
        "idle": 1 - busy / wall,
        "compute": union_length(compute) / wall,
        "communication": union_length(comm) / wall,
        "exposed communication": exposed_length(comm, compute) / wall,
    }


def gpu_kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every GPU kernel the profiler saw.

    NOTE: not the GPU mirrors of `record_function` ranges (user annotations):
    they span their kernels and the gaps between them, so counting them would
    call idle time busy and count every annotated kernel twice.
    """
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not _annotation(e) and e.time_range.end > e.time_range.start]


def _annotation(e) -> bool:
    return bool(getattr(e, "is_user_annotation", False))


def _host_events(prof) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every host event with a duration: ops, `record_function` ranges and CUDA
    runtime calls (cudaLaunchKernel, cudaDeviceSynchronize...), on every thread."""
    return [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == DeviceType.CPU and e.time_range.end > e.time_range.start]


def kernels_by_name(kernels: list[tuple[str, float, float]]) -> list[tuple[str, int, float]]:
    """(name, calls, total time) per kernel name, largest total first."""
    totals: dict[str, list] = {}
    for name, s, e in kernels:
        row = totals.setdefault(name, [0, 0.0])
        row[0] += 1
        row[1] += e - s
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda r: -r[2])


# Scopes a kernel's launch is charged to, innermost first: an autograd node, a compiled graph's call, a named
# range of ours (titan_k3/optim/muon.py, orthogonalise.py).
SCOPES = ("autograd::engine::evaluate_function: ", "## Call CompiledFxGraph", "muon.", "Optimizer.step#")


def launch_scope(event) -> str:
    """The scope a CPU event's kernels are charged to: its innermost ancestor (itself included) that is an
    autograd node, a compiled graph's call or one of our named ranges, else its outermost ancestor (the top-level
    op). Compiled graphs are named by their kind alone (their hash differs per graph)."""
    outer, e = event, event
    while e is not None:
        name = e.name
        for scope in SCOPES:
            if name.startswith(scope):
                if scope.startswith("## Call"):
                    return "compiled graph"
                return name.removeprefix("autograd::engine::evaluate_function: ")
        outer, e = e, e.cpu_parent
    return outer.name


def gpu_time_by_scope(events) -> list[tuple[str, str, int, float]]:
    """(scope, kernel name, launches, total GPU time) from profiler events whose `kernels` were launched by them,
    largest first; `events` are FunctionEvents (a CPU op with its kernels, `cpu_parent` up to the top level)."""
    totals: dict[tuple[str, str], list] = {}
    for e in events:
        kernels = getattr(e, "kernels", None)
        if e.device_type != DeviceType.CPU or not kernels:
            continue
        scope = launch_scope(e)
        for k in kernels:
            row = totals.setdefault((scope, k.name), [0, 0.0])
            row[0] += 1
            row[1] += k.duration
    return sorted(((s, n, c, t) for (s, n), (c, t) in totals.items()), key=lambda r: -r[3])


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def kernel_tables(kernels: list[tuple[str, float, float]], events, rows: int = 80) -> list[str]:
    """The report's two attribution tables, times in ms (profiler times are in us)."""
    by_name = kernels_by_name(kernels)
    total = sum(t for *_, t in by_name) or 1.0
    lines = ["", f"Every kernel by GPU time ({len(by_name)} names, the first {rows}):"]
    lines += [f"{t / 1e3:10.3f} ms {100 * t / total:5.1f}% {c:6d} calls {t / c:9.1f} us  {_short(n)}"
              for n, c, t in by_name[:rows]]
    rest = sum(t for *_, t in by_name[rows:])
    lines.append(f"{rest / 1e3:10.3f} ms in the other {max(0, len(by_name) - rows)} names")
    scoped = gpu_time_by_scope(events)
    launched = sum(t for *_, t in scoped)
    lines += ["", f"GPU time by launching scope and kernel (the first {rows}; {launched / 1e3:.3f} ms launched by an "
              f"op, {max(0.0, total - launched) / 1e3:.3f} ms from CUDA graph replays or without a launching op):"]
    lines += [f"{t / 1e3:10.3f} ms {c:6d} calls  {_short(s, 50):50s}  {_short(n, 70)}" for s, n, c, t in scoped[:rows]]
    return lines


def idle_gaps(kernels: list[tuple[str, float, float]]) -> list[tuple[float, float, str, str]]:
    """(start, end, kernel before, kernel after) of each stretch between the first kernel's start and the last
    kernel's end that no kernel covers, in time order: the complement of the union of the (name, start, end)
    intervals, on all streams. The kernel before is the one whose end opens the gap, the one after the one whose
    start closes it."""
    gaps = []
    end, before = float("-inf"), None
    for name, s, e in sorted(kernels, key=lambda k: (k[1], k[2])):
        if before is not None and s > end:
            gaps.append((end, s, before, name))
        if e > end:
            end, before = e, name
    return gaps


# Gap sizes in us: the exclusive upper bounds of all but the last bucket, and every bucket's label.
GAP_BOUNDS = (5.0, 20.0, 100.0, 1e3)
GAP_LABELS = ("< 5 us", "5-20 us", "20-100 us", "100 us-1 ms", ">= 1 ms")


def gap_buckets(gaps: list[tuple[float, float, str, str]]) -> list[tuple[str, int, float]]:
    """(label, gaps, total idle us) per size bucket of GAP_LABELS, smallest first; gap times in us."""
    rows = [[label, 0, 0.0] for label in GAP_LABELS]
    for s, e, *_ in gaps:
        row = rows[bisect.bisect_right(GAP_BOUNDS, e - s)]
        row[1] += 1
        row[2] += e - s
    return [tuple(r) for r in rows]


def largest_gaps(gaps: list[tuple[float, float, str, str]], n: int = 15) -> list[tuple[float, float, str, str]]:
    """The `n` longest gaps, longest first (the earlier first among equals)."""
    return sorted(gaps, key=lambda g: (-(g[1] - g[0]), g[0]))[:n]


NO_HOST = "(no host event)"


def host_context(gaps: list[tuple[float, float, str, str]], host_events: list[tuple[str, float, float]]) -> list[str]:
    """Per gap, the name of the innermost (name, start, end) host event that covers the gap's midpoint, else
    NO_HOST; one time unit throughout. Scans every event per gap: meant for the largest few gaps.

    NOTE: innermost is the shortest (the later start among equals). Within a thread nested ranges shrink inward;
    across threads (autograd runs CUDA backward ops on its own thread while the main thread waits in `backward`)
    the shortest covering event is the most specific thing the host was doing: launching, synchronising, Python.
    """
    names = []
    for s, e, *_ in gaps:
        mid = (s + e) / 2
        covering = [(end - start, -start, name) for name, start, end in host_events if start <= mid <= end]
        names.append(min(covering)[2] if covering else NO_HOST)
    return names


def gap_report(kernels: list[tuple[str, float, float]], host_events: list[tuple[str, float, float]], wall: float,
               largest: int = 15) -> list[str]:
    """The report's "GPU idle gaps" section from (name, start_us, end_us) kernels and host events and the profiled
    wall time in us.

    NOTE: as in `timeline`, the wall window is a length: where it starts on the trace's clock is unknown, so the idle
    time before the first kernel and after the last is given together (wall minus the kernels' span). The host
    events' own span around the kernels splits it roughly: the host's lead before its first launch runs, its tail
    (the closing synchronise) after the last kernel.
    """
    if not kernels:
        return ["", "GPU idle gaps: no kernels"]
    gaps = idle_gaps(kernels)
    first, last = min(s for _, s, _ in kernels), max(e for *_, e in kernels)
    between = sum(e - s for s, e, *_ in gaps)
    outside = wall - (last - first)
    lines = ["", f"GPU idle gaps: {(between + outside) / 1e3:.3f} ms idle of {wall / 1e3:.3f} ms wall: "
             f"{between / 1e3:.3f} ms in {len(gaps)} gaps between kernels, {outside / 1e3:.3f} ms before the first "
             f"kernel and after the last together"]
    if host_events:
        lead = first - min(s for _, s, _ in host_events)
        tail = max(e for *_, e in host_events) - last
        lines[-1] += (f" (host events begin {lead / 1e3:.3f} ms before the first kernel, end {tail / 1e3:.3f} ms "
                      "after the last)")
    lines += [f"  {'gap size':12s} {'gaps':>7s} {'idle ms':>10s}"]
    lines += [f"  {label:12s} {count:7d} {total / 1e3:10.3f}" for label, count, total in gap_buckets(gaps)]
    top = largest_gaps(gaps, largest)
    lines += [f"The {len(top)} largest gaps: start (ms after the first kernel's start), length, the kernels before and "
              "after, the innermost host event over the gap's middle:"]
    lines += [f"  {(s - first) / 1e3:9.3f} ms {e - s:9.1f} us  {_short(before, 60):60s} -> {_short(after, 60):60s}  "
              f"host: {_short(host, 60)}" for (s, e, before, after), host in zip(top, host_context(top, host_events))]
    return lines


def profile_report(prof, wall_s: float, title: str = "") -> str:
    """The text summary of a finished torch.profiler run that covered `wall_s` seconds."""
    events = prof.key_averages()
    on_gpu = torch.cuda.is_available() and any(e.self_device_time_total > 0 for e in events)
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    lines = [title] if title else []
    if on_gpu:
        kernels = gpu_kernels(prof)
        shares = timeline(kernels, wall_s * 1e6)
        lines.append(f"GPU timeline over {wall_s * 1e3:.1f} ms of wall time: "
                     + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items() if k != "wall"))
        by_kind: dict[str, float] = {}
        for name, s, e in kernels:
            kind = kernel_kind(name)
            by_kind[kind] = by_kind.get(kind, 0.0) + (e - s)
        total = sum(by_kind.values()) or 1.0
        lines.append("GPU time by kind: " + ", ".join(
            f"{k} {v / 1e3:.1f} ms ({100 * v / total:.1f}%)" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        lines += gap_report(kernels, _host_events(prof), wall_s * 1e6)
    else:
        lines.append(f"no GPU activity recorded: host time only, over {wall_s * 1e3:.1f} ms of wall time")
    lines += ["", events.table(sort_by=sort, row_limit=30, max_name_column_width=70)]
    if on_gpu:
        # NOTE: where the host's time goes (a step the GPU waits for is host-bound: launches, guards, hooks).
        lines += ["Host time (events by self CPU time):",
                  events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)]
        ops = sorted((e for e in events if "::" in e.key), key=lambda e: e.self_device_time_total, reverse=True)
        total = sum(e.self_device_time_total for e in events if not _annotation(e)) or 1
        lines += ["Operators by self GPU time:"] + [
            f"{e.self_device_time_total / 1e3:10.2f} ms {100 * e.self_device_time_total / total:5.1f}%  "
            f"{e.count:6d} calls  {e.key}" for e in ops[:40]]
        lines += kernel_tables(kernels, prof.events())
    if getattr(prof, "record_shapes", False):
        lines += operators_by_shape(prof.key_averages(group_by_input_shape=True), on_gpu)
    # The optimizer's named ranges (titan_k3/optim/muon.py, orthogonalise.py): GPU time of the kernels each one
    # launched.
    ranges = sorted((e for e in events if e.key.startswith(("muon.", "Optimizer.step"))),
                    key=lambda e: e.device_time_total, reverse=True)
    lines += ["", "Optimizer ranges (GPU time of their kernels, host time):"] + [
        f"{e.device_time_total / 1e3:10.2f} ms GPU {e.cpu_time_total / 1e3:10.2f} ms host  {e.count:4d} calls  {e.key}"
        for e in ranges]
    return "\n".join(lines) + "\n"


def operators_by_shape(events, on_gpu: bool, rows: int = 40) -> list[str]:
    """The `rows` costliest (operator, input shapes) pairs by self GPU time (host time without a GPU)."""
    cost = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    ops = sorted((e for e in events if "::" in e.key and e.input_shapes and cost(e) > 0), key=cost, reverse=True)
    clock = "GPU" if on_gpu else "host"
    return ["", f"Operators by input shapes (self {clock} time):"] + [
        f"{cost(e) / 1e3:10.3f} ms {e.count:6d} calls  {e.key}  {_short(str(e.input_shapes), 120)}" for e in ops[:rows]]


def profile_activities() -> list:
    """CPU, plus CUDA where there is a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def synchronize() -> None:
    """Wait for the GPU (no-op without CUDA: CPU runs and tests take the same path)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfiler:
    """Profiles updates [start_step, start_step + steps) of a training run (`[profiling]`), then writes its files.

    Call `before(update)` before and `after(update)` after each update (1-based).
    """

    def __init__(self, cfg, run_dir: Path, rank: int, events=None):
        self.cfg, self.run_dir, self.rank, self.events = cfg, Path(run_dir), rank, events
        self.last = cfg.start_step + cfg.steps - 1
        self._prof = None
        self._t0 = 0.0

    def before(self, update: int) -> None:
        if self.cfg.enable and update == self.cfg.start_step:
            synchronize()  # the profiled window starts with an idle GPU: its timeline is this window's alone
            self._prof = torch.profiler.profile(activities=profile_activities(), record_shapes=False)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def after(self, update: int) -> Path | None:
        """Ends the profile after its last update; returns the summary's path then.

        If writing it fails, the run goes on: the failure is printed and logged as a "profile_failed" event.
        """
        if self._prof is None or update != self.last:
            return None
        synchronize()
        wall = time.perf_counter() - self._t0
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        first = self.cfg.start_step
        title = f"rank {self.rank}, updates {first}-{self.last} ({self.last - first + 1})"
        summary = self.run_dir / f"profile-rank{self.rank}.txt"
        try:
            summary.write_text(profile_report(prof, wall, title))
            if self.cfg.trace:
                raw = self.run_dir / f"trace-rank{self.rank}.json"
                prof.export_chrome_trace(str(raw))
                with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                raw.unlink()
        except Exception as e:  # noqa: BLE001 - a diagnostic must not end the training it observes
            message = f"updates {first}-{self.last}: writing the profile failed: {type(e).__name__}: {e}"
            print(f"[profile] {message}", flush=True)
            if self.events is not None:
                self.events.emit("profile_failed", message, step=update)
            return None
        if self.events is not None:
            self.events.emit("profile", f"updates {first}-{self.last} profiled: {summary}", step=update)
        return summary
