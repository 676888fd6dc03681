"""Rank 0's Prometheus endpoint: the metric names (one place, the dashboards rely on them) and the exporter.

Every metric carries a `run` label. The exporter owns a dedicated
CollectorRegistry, so several trainers (or tests) in one process never share
state, and it serves that registry over HTTP from a daemon thread.
"""

from __future__ import annotations

import re
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

GIB = 2**30

# name as exposed -> (type, labels besides `run`, help)
NAMES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "titan_k3_step": ("gauge", (), "Optimizer updates done."),
    "titan_k3_loss": ("gauge", (), "Training loss (mean over valid targets) at the last log step."),
    "titan_k3_learning_rate": ("gauge", (), "Learning rate of the last update."),
    "titan_k3_tokens_per_second": ("gauge", ("clock",), "Tokens/s: clock=training (last window) or session (since start)."),
    "titan_k3_mfu": ("gauge", (), "Model FLOP utilisation of the last window against the device's dense bf16 peak (metrics.peak_tflops, or its datasheet figure)."),
    "titan_k3_grad_norm": ("gauge", ("group",), "Gradient L2 norm before clipping; group=global or a parameter group."),
    "titan_k3_memory_bytes": ("gauge", ("kind",), "Memory, the largest over the ranks: kind=peak_allocated, peak_reserved (accelerator, since the process started) or host_rss (now)."),
    "titan_k3_tokens_total": ("counter", (), "Tokens trained on (all data-parallel ranks)."),
    "titan_k3_skipped_updates_total": ("counter", (), "Updates skipped for a non-finite loss or grad norm."),
    "titan_k3_tokens_by_source_total": ("counter", ("source",), "Tokens trained on from each data source (all data-parallel ranks)."),
    "titan_k3_expert_load_fraction": ("gauge", ("layer", "expert"), "Share of routed selections per expert in the last window."),
    "titan_k3_dead_expert_fraction": ("gauge", ("layer",), "Fraction of experts under 10% of the uniform share."),
    "titan_k3_expert_maxvio": ("gauge", ("layer",), "Max expert load over the mean load, minus 1."),
    "titan_k3_expert_load_cv": ("gauge", ("layer",),
                                "Coefficient of variation of the experts' loads (std / mean; 0 = balanced) in the last window."),
    "titan_k3_expert_load_entropy": ("gauge", ("layer",),
                                     "Entropy of the experts' load shares over log(experts) (1 = balanced) in the last window."),
    "titan_k3_invariant_violations_total": ("counter", ("check",), "Invariant violations by check."),
    "titan_k3_invariant_seconds_total": ("counter", (), "Seconds this session spent in invariant checks (their own time, "
                                         "kept off the training clock), as of the last log step."),
    "titan_k3_kernel_fallback": ("gauge", ("op",), "1 when the op runs a fallback instead of the fast path asked for."),
    "titan_k3_data_wait_fraction": ("gauge", (), "Share of the training clock spent waiting for batches."),
    "titan_k3_startup_seconds": ("gauge", ("phase",), "Seconds from the process start to the end of its first update: "
                                 "phase=build (imports, model, optimizers, data), first_update (compilation, "
                                 "autotuning, the update) or total."),
    "titan_k3_expert_relative_load": ("histogram", ("layer",),
                                      "Each expert's load over the uniform share, observed every log step (1 = balanced)."),
}

# NOTE: a collapse shows as mass below 0.1 (dead experts) and a tail above 2; balance as a peak at 1.
RELATIVE_LOAD_BUCKETS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0, float("inf"))

# metrics.jsonl's per-layer statistic (moe_stats.expert_load_stats) -> its gauge; the list-valued `load` feeds
# titan_k3_expert_load_fraction and the relative-load histogram.
_MOE_GAUGES = {"dead_fraction": "titan_k3_dead_expert_fraction", "maxvio": "titan_k3_expert_maxvio",
               "load_cv": "titan_k3_expert_load_cv", "entropy": "titan_k3_expert_load_entropy"}
_MOE_KEY = re.compile(rf"^moe/(\d+)/(load|{'|'.join(_MOE_GAUGES)})$")


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """Drop per-request access lines: every scrape would print one into the trainer's stdout.log."""


class PrometheusExporter:
    """Gauges and counters in a private registry; `serve(port)` exposes them (port 0: any free port)."""

    def __init__(self, run: str):
        self.run = run
        self.registry = CollectorRegistry()
        self.metrics: dict[str, Gauge | Counter | Histogram] = {}
        for name, (kind, labels, doc) in NAMES.items():
            if kind == "histogram":
                self.metrics[name] = Histogram(name, doc, ("run", *labels), registry=self.registry,
                                               buckets=RELATIVE_LOAD_BUCKETS)
                continue
            cls = Counter if kind == "counter" else Gauge
            # NOTE: prometheus_client appends '_total' to counters itself.
            base = name[: -len("_total")] if kind == "counter" else name
            self.metrics[name] = cls(base, doc, ("run", *labels), registry=self.registry)
        self._counted: dict[tuple, float] = {}  # (counter, labels) -> the running total it was advanced to
        self._server: WSGIServer | None = None
        self.port: int | None = None

    def _m(self, name: str, **labels):
        return self.metrics[name].labels(run=self.run, **labels)

    def _advance(self, name: str, total: float, **labels) -> None:
        """Counter `name` up to the run's running `total` (the records carry totals, a counter takes increments).
        NOTE: creating the child exposes the series, at 0 or its value, from the first call."""
        key = (name, tuple(sorted(labels.items())))
        counter = self._m(name, **labels)
        delta = total - self._counted.get(key, 0.0)
        if delta > 0:
            counter.inc(delta)
            self._counted[key] = total

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the HTTP endpoint on `addr` (loopback unless asked: metrics.prometheus_host) on a daemon thread;
        returns the bound port."""
        self._server = make_server(addr, port, make_wsgi_app(self.registry), _ThreadingWSGIServer, handler_class=_QuietHandler)
        self.port = self._server.server_port
        threading.Thread(target=self._server.serve_forever, name="prometheus", daemon=True).start()
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def set_kernels(self, choices) -> None:
        """choices: KernelChoice-like objects with .op and .fallback."""
        for c in choices:
            self._m("titan_k3_kernel_fallback", op=c.op).set(1.0 if c.fallback else 0.0)

    def set_startup(self, build_seconds: float, first_update_seconds: float) -> None:
        for phase, seconds in (("build", build_seconds), ("first_update", first_update_seconds),
                               ("total", build_seconds + first_update_seconds)):
            self._m("titan_k3_startup_seconds", phase=phase).set(seconds)

    def expose_counters(self, step: int, tokens_seen: int, skipped_updates: int) -> None:
        """Expose the run's counters, and its update count, at their values before this session's first update (0,
        or a resumed run's): the run is on the endpoint (and in the dashboard's run list) from its start.

        NOTE: a series that first appears above its start hides that step from increase() (K3SkippedUpdates):
        a skip before the first log step would never alert.
        """
        self._advance("titan_k3_tokens_total", tokens_seen)
        self._advance("titan_k3_skipped_updates_total", skipped_updates)
        self._advance("titan_k3_invariant_seconds_total", 0.0)
        self._m("titan_k3_step").set(step)

    def declare_checks(self, checks) -> None:
        """Expose every invariant's counter at 0 from the start."""
        for check in checks:
            self._m("titan_k3_invariant_violations_total", check=check)

    def violation(self, check: str) -> None:
        self._m("titan_k3_invariant_violations_total", check=check).inc()

    def invariant_seconds(self, total: float) -> None:
        """The session's seconds in invariant checks so far (TwoClocks.own_seconds["invariants"])."""
        self._advance("titan_k3_invariant_seconds_total", total)

    def update(self, record: dict) -> None:
        """Set every metric from one metrics.jsonl record (the keys MetricsReporter writes)."""
        self._m("titan_k3_step").set(record["step"])
        self._m("titan_k3_loss").set(record["loss"])
        self._m("titan_k3_learning_rate").set(record["lr"])
        self._m("titan_k3_tokens_per_second", clock="training").set(record["tokens_per_second_training"])
        self._m("titan_k3_tokens_per_second", clock="session").set(record["tokens_per_second_session"])
        self._m("titan_k3_mfu").set(record["mfu"])
        self._m("titan_k3_data_wait_fraction").set(record["data_wait_fraction"])
        self._m("titan_k3_grad_norm", group="global").set(record["grad_norm"])
        for key, value in record.items():
            if key.startswith("grad_norm/"):
                self._m("titan_k3_grad_norm", group=key.split("/", 1)[1]).set(value)
        for kind in ("peak_allocated", "peak_reserved", "host_rss"):
            gib = record.get(f"memory_{kind}_gib", record.get(f"{kind}_gib"))
            if gib is not None:
                self._m("titan_k3_memory_bytes", kind=kind).set(gib * GIB)
        self._advance("titan_k3_tokens_total", record["tokens_seen"])
        self._advance("titan_k3_skipped_updates_total", record["skipped_updates"])
        for key, value in record.items():
            if key.startswith("tokens_per_source/"):
                self._advance("titan_k3_tokens_by_source_total", value, source=key.split("/", 1)[1])
        for key, value in record.items():
            match = _MOE_KEY.match(key)
            if not match:
                continue
            layer, stat = match.groups()
            if stat == "load":
                histogram = self._m("titan_k3_expert_relative_load", layer=layer)
                for expert, share in enumerate(value):
                    self._m("titan_k3_expert_load_fraction", layer=layer, expert=str(expert)).set(share)
                    histogram.observe(share * len(value))
            else:
                self._m(_MOE_GAUGES[stat], layer=layer).set(value)
