"""Each [debug] fault injection, run for real in the Trainer on 2 gloo processes, is caught by name within one interval.

One spawn runs every scenario: the debug flavor trains 2 updates with
invariants.interval = 2, the fault present from the start, so the first (and
only) check, at update 2, must name it: in events.jsonl, in metrics.jsonl's
violation counts, in the run summary and on the Prometheus endpoint (whose
counters exist at 0 from the start). Clean runs under FSDP2, EP and HSDP
report zero violations, which proves the gradient-scale probe and the
replica checks quiet where nothing is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

from gloo_workers import spawn_gloo

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]

INTERVAL = 2
ARGS = [
    "--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "1",
    "--training.steps", str(INTERVAL), "--training.device", "cpu", "--training.compute_dtype", "float32",
    "--kernels.kda", "torch", "--kernels.experts", "torch", "--kernels.loss", "torch", "--kernels.attn_res", "torch",
    "--kernels.attention", "math", "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
    "--invariants.interval", str(INTERVAL),
]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2"]
SCENARIOS = {
    "clean": [],
    "clean_ep2": EP2,
    "clean_hsdp": HSDP,
    "same_data": ["--debug.inject_same_data", "true"],
    "replica_drift": ["--debug.inject_replica_drift", "1e-3"],
    "replica_drift_hsdp": HSDP + ["--debug.inject_replica_drift", "1e-3"],
    "fsdp_average": ["--debug.inject_grad_scale", "fsdp_average"],
    "fsdp_average_ep2": EP2 + ["--debug.inject_grad_scale", "fsdp_average"],
    "local_normaliser": ["--debug.inject_grad_scale", "local_normaliser"],
}


def _run(rank: int, world: int, dump: str, port: int) -> dict:
    from prometheus_client import generate_latest

    from titan_k3.config import load_job_config
    from titan_k3.train import Trainer

    out = {}
    for name, extra in SCENARIOS.items():
        argv = ARGS + extra + ["--job.dump_folder", dump, "--job.name", name]
        if name == "clean":
            argv += ["--metrics.prometheus_port", str(port)]
        trainer = Trainer(load_job_config(argv))
        try:
            exporter = trainer.reporter.exporter
            before = generate_latest(exporter.registry).decode() if exporter is not None else ""
            results = trainer.train()
            after = generate_latest(exporter.registry).decode() if exporter is not None else ""
            out[name] = {"summary": trainer.summary(results), "prometheus_before": before, "prometheus_after": after,
                         "probe_rtol": trainer.invariants.probe_rtol}
        finally:
            trainer.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ports import free_port

    dump = tmp_path_factory.mktemp("faults")
    ranks = spawn_gloo(2, _run, str(dump), free_port(), result_file=dump / "results.pt")
    return dump, ranks[0]


def _violations(dump: Path, name: str) -> list[dict]:
    events = [json.loads(x) for x in (dump / name / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["kind"] == "invariant_violation"]


def _metrics(dump: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (dump / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["clean", "clean_ep2", "clean_hsdp"])
def test_clean_runs_report_zero_violations_everywhere(runs, name):
    dump, rank0 = runs
    assert _violations(dump, name) == []
    for record in _metrics(dump, name):
        assert record["invariant_violations"] == 0
        assert record["invariant_violations/gradient_scale.probe_reference"] == 0
    assert "invariant violations: 0 in 1 checked update(s) (every 2 updates and the last)" in rank0[name]["summary"]
    # The probe and the norm audit ran (their costs are in the check line) and found nothing.
    log = (dump / name / "stdout.log").read_text()
    assert "invariants at step 2:" in log and "gradient_scale.probe_reference" in log and "0 violation(s)" in log


def test_prometheus_counts_every_check_from_zero(runs):
    from titan_k3.invariants import CHECKS

    _, rank0 = runs
    for text in (rank0["clean"]["prometheus_before"], rank0["clean"]["prometheus_after"]):
        for check in CHECKS:
            assert f'titan_k3_invariant_violations_total{{check="{check}",run="clean"}} 0.0' in text, check


@pytest.mark.parametrize("name, check, words", [
    ("same_data", "data.disjoint_sequences", "more than one data-parallel rank"),
    ("replica_drift", "replicas.checksums", "router.weight"),
    ("replica_drift_hsdp", "replicas.checksums", "replicated shards differ"),
    ("fsdp_average", "gradient_scale.probe_reference", "0.5x the single-process gradient"),
    ("fsdp_average", "gradient_scale.expert_grad_scale", "1/2 of the right gradient: a reduction averages"),
    ("fsdp_average_ep2", "gradient_scale.probe_reference", "single-process gradient"),
    ("local_normaliser", "gradient_scale.loss_normaliser", "local count"),
])
def test_each_injection_is_caught_by_name_within_one_interval(runs, name, check, words):
    dump, rank0 = runs
    found = [e for e in _violations(dump, name) if e["check"] == check]
    assert found, f"{name}: {check} silent; got {[e['check'] for e in _violations(dump, name)]}"
    assert found[0]["step"] == INTERVAL and any(words in e["message"] for e in found), found
    records = _metrics(dump, name)
    assert records[0]["invariant_violations"] == 0  # update 1: no check yet, the count is there at 0
    assert records[-1][f"invariant_violations/{check}"] >= 1 and records[-1]["invariant_violations"] >= 1
    assert check in rank0[name]["summary"]
    events = [json.loads(x) for x in (dump / name / "events.jsonl").read_text().splitlines()]
    assert [e["key"] for e in events if e["kind"] == "fault_injection"], "the injection is not announced"


def test_fsdp_averaging_halves_the_probe_gradient(runs):
    dump, _ = runs
    (probe,) = [e for e in _violations(dump, "fsdp_average") if e["check"] == "gradient_scale.probe_reference"]
    assert probe["metric"] == pytest.approx(0.5, rel=1e-4)
    # Under EP 2 of 2 the experts stay out of FSDP: only the dense part is averaged.
    (ep,) = [e for e in _violations(dump, "fsdp_average_ep2") if e["check"] == "gradient_scale.probe_reference"]
    assert 0.5 < ep["metric"] < 1 and not [e for e in _violations(dump, "fsdp_average_ep2")
                                           if e["check"] == "gradient_scale.expert_grad_scale"]


def test_the_run_summarizer_names_the_violations(runs):
    from titan_k3.tools.summarize import summarize

    dump, _ = runs
    text, numbers = summarize(dump / "fsdp_average")
    assert numbers["invariant_violations"]["gradient_scale.probe_reference"] == 1
    assert ("| invariant violations | gradient_scale.expert_grad_scale: 1, gradient_scale.probe_reference: 1 in 1 checked "
            "updates |") in text
    assert "| invariant violations | 0 in 1 checked updates |" in summarize(dump / "clean")[0]
