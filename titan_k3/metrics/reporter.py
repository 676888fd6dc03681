"""The per-log-step report: one metrics.jsonl record, one stdout line, Prometheus, optional TensorBoard.

The trainer calls `log(...)` on every rank at each log step (the report
all-reduces a few small tensors over the data-parallel group: expert loads,
tokens per source, peak memory); rank 0 writes the sinks. Grad norms per
group are captured before clipping with `capture_grads(...)` on the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from titan_k3.config import ConfigError, JobConfig
from titan_k3.config.check import port_error
from titan_k3.invariants.checks import CHECKS
from titan_k3.metrics.clocks import TwoClocks
from titan_k3.metrics.events import EventLog, JsonLines
from titan_k3.metrics.grad_norms import grad_norms_by_group
from titan_k3.metrics.memory import GIB, memory_stats
from titan_k3.metrics.moe_stats import CollapseAlarm, expert_load_stats
from titan_k3.metrics.peaks import device_peak
from titan_k3.metrics.prometheus import PrometheusExporter
from titan_k3.parallel.distributed import all_reduce_small


def _tensorboard_writer_class():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            f"config key 'metrics.enable_tensorboard' = true: the tensorboard package is not installed ({e}); "
            "pip install tensorboard or set it to false"
        ) from None
    return SummaryWriter


class MetricsReporter:
    """Sinks for one run. Construct before the run directory exists (it checks TensorBoard and binds
    the Prometheus port, both start-up errors), then `start(run_dir, events)`.

    n_devices: accelerators sharing the work (MFU divides by n_devices x peak).
    group: the data-parallel process group (None for one process).
    """

    def __init__(self, cfg: JobConfig, *, rank: int, device: torch.device, flops_per_token: float,
                 n_devices: int = 1, group: dist.ProcessGroup | None = None):
        m = cfg.metrics
        self.cfg, self.rank, self.device, self.group = cfg, rank, device, group
        self.flops_per_token, self.n_devices = flops_per_token, n_devices
        self.peak_tflops, self.peak_source = device_peak(m.peak_tflops, device)
        self.alarm = CollapseAlarm(m.collapse_dead_fraction, m.collapse_patience)
        self._writer_cls = _tensorboard_writer_class() if m.enable_tensorboard and rank == 0 else None
        self.exporter: PrometheusExporter | None = None
        if m.prometheus_port and rank == 0:
            self.exporter = PrometheusExporter(cfg.job.name or "run")
            self.exporter.declare_checks(CHECKS)
            try:
                self.exporter.serve(m.prometheus_port, m.prometheus_host)
            except OSError as e:
                raise port_error(cfg, e) from None
        self.events: EventLog | None = None
        self.metrics_path: Path | None = None
        self.writer = None
        self.grad_norms: dict[str, float] = {}

    def start(self, run_dir: Path, events: EventLog) -> None:
        self.events = events
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        self._metrics_file = JsonLines(self.metrics_path)
        if self.rank == 0:
            print(f"metrics: MFU against {self.peak_tflops:g} TFLOP/s per device ({self.peak_source})", flush=True)
        if self._writer_cls is not None:
            self.writer = self._writer_cls(log_dir=str(Path(run_dir) / "tensorboard"))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.exporter is not None:
            self.exporter.close()

    def expose_counters(self, step: int, tokens_seen: int, skipped_updates: int) -> None:
        """The endpoint's run counters and update count at the session's starting values, before its first update
        (rank 0)."""
        if self.exporter is not None:
            self.exporter.expose_counters(step, tokens_seen, skipped_updates)

    def violation(self, check: str) -> None:
        """Count one invariant violation on the endpoint (rank 0 only serves one)."""
        if self.exporter is not None:
            self.exporter.violation(check)

    # ------------------------------------------------------------------ start-up
    def report_kernels(self, choices) -> None:
        """The kernel report: one line per op (a fallback's line is its `fallback` event's, printed once), a
        `kernel_report` event, the metric."""
        if self.rank != 0:
            return
        for c in choices:
            line = f"kernel {c.op}: {c.chosen}" + (f" (FALLBACK from '{c.requested}': {c.reason})" if c.fallback else "")
            if c.fallback:
                self.events.emit("fallback", line, step=0, **c.as_dict())
            else:
                print(line)
        self.events.emit("kernel_report", "kernels chosen", step=0, kernels=[c.as_dict() for c in choices])
        if self.exporter is not None:
            self.exporter.set_kernels(choices)

    def report_startup(self, step: int, build_seconds: float, first_update_seconds: float, origin: str) -> None:
        """The "startup" event and gauge: the seconds from `origin` (the process start) to the end of update `step`,
        split into building the trainer and the first update."""
        if self.rank != 0:
            return
        total = build_seconds + first_update_seconds
        self.events.emit("startup", f"update {step} done {total:.1f} s after the {origin} ({build_seconds:.1f} s to "
                         f"build the trainer: imports, model, optimizers, data; {first_update_seconds:.1f} s in the first "
                         "update: compilation, autotuning, the update)", step=step, seconds=round(total, 3),
                         origin=origin, build_seconds=round(build_seconds, 3),
                         first_update_seconds=round(first_update_seconds, 3))
        if self.exporter is not None:
            self.exporter.set_startup(build_seconds, first_update_seconds)

    # ------------------------------------------------------------------ per step
    def is_log_step(self, step: int) -> bool:
        return step % self.cfg.metrics.log_freq == 0 or step == self.cfg.training.steps

    def capture_grads(self, named_params: Iterable) -> None:
        """Per-group gradient norms before clipping (collective with DTensor gradients)."""
        self.grad_norms = grad_norms_by_group(named_params)

    def _moe(self, routers: dict, record: dict, step: int) -> None:
        if not routers:
            return
        layers = sorted(routers)
        counts_LE = all_reduce_small(torch.stack([routers[i].load_counts for i in layers]), self.group)
        for i, layer in enumerate(layers):
            router = routers[layer]
            stats = expert_load_stats(counts_LE[i], router.qb_bias)
            for key, value in stats.items():
                record[f"moe/{layer}/{key}"] = value
            router.load_counts.zero_()
            if self.alarm.update(layer, stats["dead_fraction"]) and self.rank == 0:
                m = self.cfg.metrics
                self.events.emit(
                    "expert_collapse",
                    f"EXPERT COLLAPSE in layer {layer}: {100 * stats['dead_fraction']:.1f}% of experts dead "
                    f"(> {100 * m.collapse_dead_fraction:.0f}%) for {m.collapse_patience} log steps in a row",
                    step=step, layer=layer, dead_fraction=stats["dead_fraction"],
                )

    def log(self, *, step: int, loss: float, grad_norm: float, lr: float, tokens_seen: int, skipped_updates: int,
            clocks: TwoClocks, window: dict, routers: dict, source_tokens: dict[str, int] | None = None,
            extra: dict[str, float] | None = None) -> dict:
        """window: {tokens, training_seconds, data_wait} since the last log step; extra: more keys for the
        record (the evaluation's val_loss, eval/<task>/acc...). Returns the record."""
        win_seconds = max(window["training_seconds"], 1e-9)
        session_seconds = clocks.session_seconds  # read once: the record's rate is its own tokens over its own seconds
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_seen": tokens_seen,
            "skipped_updates": skipped_updates,
            "nonfinite_events": self.events.counts.get("nonfinite", 0) if self.events else 0,
            "training_seconds": clocks.training_seconds,
            "session_seconds": session_seconds,
            "session_start": round(clocks.started_unix, 3),
            "session_tokens": clocks.session_tokens,
            "tokens_per_second_training": window["tokens"] / win_seconds,
            # NOTE: this session's tokens over this session's time; tokens_seen includes earlier sessions' (resume).
            "tokens_per_second_session": clocks.session_tokens / max(session_seconds, 1e-9),
            "data_wait_fraction": window["data_wait"] / win_seconds,
            # NOTE: this session's seconds in invariant checks, kept off the training clock (TwoClocks.outside_training).
            "invariant_seconds": clocks.own_seconds.get("invariants", 0.0),
        }
        peak = self.peak_tflops * 1e12 * self.n_devices
        record["mfu"] = record["tokens_per_second_training"] * self.flops_per_token / peak
        for group, value in self.grad_norms.items():
            if group != "global":
                record[f"grad_norm/{group}"] = value
        self.grad_norms = {}
        mem = memory_stats(self.device)
        kinds = sorted(mem)
        mem_max = all_reduce_small(torch.tensor([mem[k] for k in kinds], dtype=torch.float64), self.group,
                                   dist.ReduceOp.MAX)
        for kind, value in zip(kinds, mem_max.tolist()):
            record["host_rss_gib" if kind == "host_rss" else f"memory_{kind}_gib"] = value / GIB
        if source_tokens:
            names = sorted(source_tokens)
            totals = all_reduce_small(torch.tensor([source_tokens[n] for n in names], dtype=torch.float64), self.group)
            for name, value in zip(names, totals.tolist()):
                record[f"tokens_per_source/{name}"] = int(value)
        self._moe(routers, record, step)
        record.update(extra or {})
        if self.rank == 0:
            self._write(record)
            if self.exporter is not None:
                self.exporter.invariant_seconds(clocks.own_seconds.get("invariants", 0.0))
        return record

    def _write(self, record: dict) -> None:
        self._metrics_file.append(record)
        print(f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | "
              f"tok/s {record['tokens_per_second_training']:,.0f} (session {record['tokens_per_second_session']:,.0f}) | "
              f"mfu {100 * record['mfu']:.2f}% | wait {100 * record['data_wait_fraction']:.0f}%", flush=True)
        if self.exporter is not None:
            self.exporter.update(record)
        if self.writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()
