"""Prometheus export: service metrics and each run's latest trainer metrics.

This module is the one place that says which names the service emits (the
Grafana dashboard test imports it).

Service metrics
  titan_k3_service_runs{state}                    runs in each state
  titan_k3_service_queue_length                   runs waiting for GPUs / a slot
  titan_k3_service_restarts_total                 automatic relaunches after crashes, all runs (deleted ones too)
  titan_k3_service_gpus                           GPUs the queue schedules
  titan_k3_service_gpus_used                      GPUs assigned to active runs
  titan_k3_service_run_state{run,state}           1 for the run's current state
  titan_k3_service_run_restarts_total{run}        relaunches of this run
  titan_k3_service_run_attempts{run}              attempts launched
  titan_k3_service_runs_unsettled                 runs whose last change the registry refused to record (retried;
                                                  GET /v1/runs/{id} registry_error says what failed)

Per-run trainer metrics, read from the latest line of <run>/metrics.jsonl
  titan_k3_run_<key>{run}                         every numeric key; '/' and any other character
                                                  outside [a-zA-Z0-9_] become '_'
                                                  (loss -> titan_k3_run_loss,
                                                   grad_norm/muon -> titan_k3_run_grad_norm_muon)
  plus labelled families for the dashboard (LABELLED below):
  titan_k3_run_tokens_per_second_by_clock{run,clock}   tokens_per_second_{training,session}
  titan_k3_run_grad_norm_by_group{run,group}           grad_norm/<group>
  titan_k3_run_moe_dead_fraction_by_layer{run,layer}   moe/<layer>/dead_fraction
  titan_k3_run_moe_maxvio_by_layer{run,layer}          moe/<layer>/maxvio
  titan_k3_run_moe_load_cv_by_layer{run,layer}         moe/<layer>/load_cv
  titan_k3_run_moe_entropy_by_layer{run,layer}         moe/<layer>/entropy
  titan_k3_run_tokens_by_source{run,source}            tokens_per_source/<source>
  titan_k3_run_moe_expert_load{run,layer,expert}       moe/<layer>/load (a list: each expert's share)
From <run>/events.jsonl, plus the counts of earlier attempts' events.jsonl that a start over moved to
<run>/service/attempt-<n>/ (kept in the registry: service/registry.py)
  titan_k3_run_events_total{run,kind}             events by kind
  titan_k3_run_invariant_violations_total{run,check}

Every counter above is read from the registry or counts every attempt: none goes down while its run is in the
registry, whether an attempt starts over or the service restarts.

The registry's part comes from its last committed write (`Registry.snapshot()`, one for the whole scrape), never
waiting for its lock: a scrape during a supervisor pass that waits on SQLite's lock (up to 30 s; Prometheus gives up
after 10 s by default) is answered at once.

Which runs appear
  titan_k3_service_run_state, _run_restarts_total, _run_attempts: every queued or active run and the
      RECENT_FINISHED_RUNS most recently updated others, for as long as the registry holds them
      (DELETE /v1/runs/{id} drops them at the next scrape);
  every titan_k3_run_* series: queued and active runs, and an ended run for `finished_series_seconds`
      after it ended (then its series leave /metrics, so alerts on them resolve).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.registry import ACTIVE, STATES, Registry
from service.rundir import RunFilesCache

RUN_PREFIX = "titan_k3_run_"
RECENT_FINISHED_RUNS = 50
"""Runs not queued or active are exported only while among the most recently updated (bounded series)."""

# Numeric keys of the trainer's metrics.jsonl lines ('<layer>', '<group>', '<source>', '<check>', '<task>' stand
# for any name without '/'); memory_peak_*_gib appear on CUDA only, val_* and eval/* on evaluation steps.
TRAINER_KEYS = (
    "step", "loss", "lr", "grad_norm", "tokens_per_second_training", "tokens_per_second_session", "mfu",
    "memory_peak_allocated_gib", "memory_peak_reserved_gib", "tokens_seen", "skipped_updates", "grad_norm/<group>",
    "moe/<layer>/dead_fraction", "moe/<layer>/maxvio", "moe/<layer>/load_cv", "moe/<layer>/entropy",
    "moe/<layer>/qb_range", "tokens_per_source/<source>", "host_rss_gib", "data_wait_fraction",
    "nonfinite_events", "training_seconds", "invariant_seconds", "session_seconds", "session_start", "session_tokens",
    "session_first_step", "session_first_loss", "invariant_violations", "invariant_checked_updates",
    "invariant_violations/<check>", "val_loss", "val_tokens", "eval/<task>/acc", "eval/<task>/acc_norm",
)
# List-valued keys the trainer writes (one number per expert).
TRAINER_LIST_KEYS = ("moe/<layer>/load",)
_TRAINER_KEY = re.compile("|".join(re.sub(r"<[a-z]+>", "[^/]+", re.escape(k)) for k in TRAINER_KEYS))


def is_trainer_key(key: str) -> bool:
    """Whether `key` is one of TRAINER_KEYS (a numeric key the trainer may write, whether or not it has yet)."""
    return _TRAINER_KEY.fullmatch(key) is not None
EXPERT_LOAD = "titan_k3_run_moe_expert_load"
_EXPERT_LOAD_KEY = re.compile(r"^moe/([^/]+)/load$")


@dataclass(frozen=True)
class Labelled:
    name: str
    pattern: re.Pattern[str]
    label: str
    doc: str


LABELLED = (
    Labelled("titan_k3_run_tokens_per_second_by_clock", re.compile(r"^tokens_per_second_(training|session)$"),
             "clock", "Tokens per second on the training-window clock and the whole-session clock"),
    Labelled("titan_k3_run_grad_norm_by_group", re.compile(r"^grad_norm/([^/]+)$"), "group",
             "Gradient norm per parameter group"),
    Labelled("titan_k3_run_moe_dead_fraction_by_layer", re.compile(r"^moe/([^/]+)/dead_fraction$"), "layer",
             "Fraction of routed experts whose load is under 10% of the uniform share 1/E (dead), per MoE layer"),
    Labelled("titan_k3_run_moe_maxvio_by_layer", re.compile(r"^moe/([^/]+)/maxvio$"), "layer",
             "Max load violation (max expert load / mean load - 1), per MoE layer"),
    Labelled("titan_k3_run_moe_load_cv_by_layer", re.compile(r"^moe/([^/]+)/load_cv$"), "layer",
             "Coefficient of variation of expert load, per MoE layer"),
    Labelled("titan_k3_run_moe_entropy_by_layer", re.compile(r"^moe/([^/]+)/entropy$"), "layer",
             "Entropy of the expert load distribution, per MoE layer"),
    Labelled("titan_k3_run_tokens_by_source", re.compile(r"^tokens_per_source/([^/]+)$"), "source",
             "Tokens trained on per data source"),
)

SERVICE_NAMES = (
    "titan_k3_service_runs", "titan_k3_service_queue_length", "titan_k3_service_restarts",
    "titan_k3_service_gpus", "titan_k3_service_gpus_used", "titan_k3_service_run_state",
    "titan_k3_service_run_restarts", "titan_k3_service_run_attempts", "titan_k3_service_runs_unsettled",
    "titan_k3_run_events", "titan_k3_run_invariant_violations",
)
_RESERVED = frozenset(SERVICE_NAMES) | {lab.name for lab in LABELLED} | {EXPERT_LOAD}


def generic_name(key: str) -> str:
    """The gauge name for a metrics.jsonl key: titan_k3_run_<key, non-[a-zA-Z0-9_] as '_'>."""
    return RUN_PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class ServiceCollector(Collector):
    """Builds every family from the registry and the run files at scrape time."""

    def __init__(self, registry: Registry, files: RunFilesCache, gpus_total: int, finished_series_seconds: float,
                 unsettled: Callable[[], dict[str, str]] = dict):
        self.registry = registry
        self.unsettled = unsettled
        self.files = files
        self.gpus_total = gpus_total
        self.finished_series_seconds = finished_series_seconds

    def collect(self) -> Iterator[Metric]:
        snapshot = self.registry.snapshot()
        runs = snapshot.runs
        by_state = GaugeMetricFamily("titan_k3_service_runs", "Runs in each state", labels=["state"])
        for state in STATES:
            by_state.add_metric([state], sum(r.state == state for r in runs))
        yield by_state
        yield GaugeMetricFamily("titan_k3_service_queue_length", "Runs waiting to start",
                                value=sum(r.state == "queued" for r in runs))
        yield CounterMetricFamily("titan_k3_service_restarts", "Automatic relaunches after a crash, all runs",
                                  value=sum(r.restarts_total for r in runs) + snapshot.deleted_restarts)
        yield GaugeMetricFamily("titan_k3_service_gpus", "GPUs the queue schedules", value=self.gpus_total)
        yield GaugeMetricFamily("titan_k3_service_gpus_used", "GPUs assigned to active runs",
                                value=sum(len(r.assigned_gpus) for r in runs if r.state in ACTIVE))
        yield GaugeMetricFamily("titan_k3_service_runs_unsettled", "Runs whose last change the registry refused to "
                                "record (being retried)", value=len(self.unsettled()))

        shown = [r for r in runs if r.state in ACTIVE or r.state == "queued"]
        rest = sorted((r for r in runs if r not in shown), key=lambda r: r.updated_at, reverse=True)
        shown += rest[:RECENT_FINISHED_RUNS]

        state = GaugeMetricFamily("titan_k3_service_run_state", "1 for the run's current state", labels=["run", "state"])
        restarts = CounterMetricFamily("titan_k3_service_run_restarts", "Relaunches of the run", labels=["run"])
        attempts = GaugeMetricFamily("titan_k3_service_run_attempts", "Attempts launched", labels=["run"])
        events = CounterMetricFamily("titan_k3_run_events", "Events in events.jsonl by kind", labels=["run", "kind"])
        violations = CounterMetricFamily("titan_k3_run_invariant_violations", "Invariant violations by check",
                                         labels=["run", "check"])
        labelled = {lab.name: GaugeMetricFamily(lab.name, lab.doc, labels=["run", lab.label]) for lab in LABELLED}
        expert_load = GaugeMetricFamily(EXPERT_LOAD, "Each expert's share of routed tokens in the last log window",
                                        labels=["run", "layer", "expert"])
        generic: dict[str, GaugeMetricFamily] = {}
        now = time.time()
        for run in shown:
            state.add_metric([run.id, run.state], 1)
            restarts.add_metric([run.id], run.restarts_total)
            attempts.add_metric([run.id], len(run.attempts))
            if run.state not in (*ACTIVE, "queued") and now - run.updated_at > self.finished_series_seconds:
                continue
            files = self.files.get(run.id)
            for kind, n in files.event_counts().items():
                events.add_metric([run.id, kind], n)
            for check, n in files.violations_by_check().items():
                violations.add_metric([run.id, check], n)
            self._add_trainer_metrics(run.id, files.latest_metrics(), generic, labelled)
            for key, loads in files.latest_vectors().items():
                m = _EXPERT_LOAD_KEY.match(key)
                if m:
                    for expert, share in enumerate(loads):
                        expert_load.add_metric([run.id, m.group(1), str(expert)], share)
        yield from (state, restarts, attempts, events, violations, expert_load)
        yield from labelled.values()
        yield from generic.values()

    @staticmethod
    def _add_trainer_metrics(run_id: str, latest: dict[str, float], generic: dict[str, GaugeMetricFamily],
                             labelled: dict[str, GaugeMetricFamily]) -> None:
        seen: set[str] = set()
        for key, value in latest.items():
            name = generic_name(key)
            # NOTE: two keys can sanitise to one name ('a/b', 'a_b'); the first wins so the output stays valid.
            if name not in _RESERVED and name not in seen:
                seen.add(name)
                fam = generic.get(name)
                if fam is None:
                    fam = generic[name] = GaugeMetricFamily(name, f"Trainer metric '{key}' (latest logged step)",
                                                            labels=["run"])
                fam.add_metric([run_id], value)
            for lab in LABELLED:
                m = lab.pattern.match(key)
                if m:
                    labelled[lab.name].add_metric([run_id, m.group(1)], value)
