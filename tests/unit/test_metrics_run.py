"""One real CPU training run under a controlled clock, scraped over HTTP while it runs.

The fixture drives the trainer's clocks with a fake `now`: every update costs
exactly 2 s, every report 1 s and every checkpoint hook 5 s (standing in for
evaluation and checkpointing, which run outside the training clock), and the
invariant checks of every second update 3 s inside that update (their own time,
kept off the training clock). The records must show exactly that accounting,
and the summarizer's steady rate must be the exact arithmetic over the recorded
windows.
"""

import json
import shutil
import subprocess

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from titan_k3.config import load_job_config
from titan_k3.metrics.clocks import TwoClocks
from titan_k3.metrics.moe_stats import expert_load_stats
from titan_k3.metrics.prometheus import NAMES
from titan_k3.tools.summarize import main as summarize_main
from titan_k3.tools.summarize import summarize

from ports import free_port

STEPS, LOG_FREQ, SEQ, STEP_S, REPORT_S, HOOK_S = 4, 2, 64, 2.0, 1.0, 5.0
CHECK_EVERY, CHECK_S = 2, 3.0


class FakeNow:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from titan_k3.train import Trainer

    root = tmp_path_factory.mktemp("runs")
    port = free_port()
    cfg = load_job_config([
        "--job.config_file", "tomls/smoke.toml", "--model.flavor", "debug", "--training.seq_len", str(SEQ),
        "--training.steps", str(STEPS), "--metrics.log_freq", str(LOG_FREQ), "--job.dump_folder", str(root),
        "--job.name", "clocked", "--metrics.prometheus_port", str(port), "--invariants.interval", str(CHECK_EVERY),
    ])
    trainer = Trainer(cfg)
    wired = trainer.invariants.clocks is trainer.clocks
    now = FakeNow()
    trainer.clocks = trainer.invariants.clocks = TwoClocks(now=now)
    scrapes = []
    step, log, hook = trainer.train_step, trainer._log, trainer.checkpointer.after_step

    def timed_step():
        out = step()
        now.t += STEP_S
        return out

    def timed_log(*a, **kw):
        log(*a, **kw)
        now.t += REPORT_S
        scrapes.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)

    def timed_hook(*a, **kw):
        now.t += HOOK_S
        return hook(*a, **kw)

    def timed_check(*a, **kw):  # one check of each check update, inside the update
        now.t += CHECK_S
        return check(*a, **kw)

    trainer.train_step, trainer._log, trainer.checkpointer.after_step = timed_step, timed_log, timed_hook
    scrapes.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)  # before the first update
    with pytest.MonkeyPatch.context() as patch:
        from titan_k3.invariants import checks

        check = checks.check_loss_normaliser
        patch.setattr(checks, "check_loss_normaliser", timed_check)
        try:
            trainer.train()
        finally:
            trainer.close()
    run_dir = root / "clocked"
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, records, scrapes, wired


def test_training_clock_excludes_reporting_and_hooks_session_clock_includes_them(run):
    _, records, _, _ = run
    assert [r["step"] for r in records] == [2, 4]
    tokens_per_step = SEQ
    for r in records:
        s = r["step"]
        assert r["training_seconds"] == pytest.approx(STEP_S * s)
        # At the report of step s: s updates, the s-1 hooks before it, the earlier reports and the checks so far.
        session = STEP_S * s + HOOK_S * (s - 1) + REPORT_S * (s // LOG_FREQ - 1) + CHECK_S * (s // CHECK_EVERY)
        assert r["session_seconds"] == pytest.approx(session)
        assert r["tokens_per_second_training"] == pytest.approx(tokens_per_step / STEP_S)
        assert r["tokens_per_second_session"] == pytest.approx(tokens_per_step * s / session)


def test_invariant_checks_time_is_their_own_not_the_training_clocks(run):
    """Every window here holds a check update: its tokens/s is the updates' own (the check's seconds used to land on
    the training clock and dip it), and the checks' seconds are reported apart (counter, cost line)."""
    run_dir, records, scrapes, _ = run
    assert [r["invariant_checked_updates"] for r in records] == [1, 2]
    samples = {s.name: s.value for f in text_string_to_metric_families(scrapes[-1]) for s in f.samples}
    assert samples["titan_k3_invariant_seconds_total"] == pytest.approx(CHECK_S * STEPS // CHECK_EVERY)
    # ... and in the run directory: every number the endpoint serves is in metrics.jsonl too.
    assert [r["invariant_seconds"] for r in records] == pytest.approx([CHECK_S * r["step"] // CHECK_EVERY for r in records])
    lines = [x for x in (run_dir / "stdout.log").read_text().splitlines() if x.startswith("invariants at step ")]
    assert [x.split(":")[0] for x in lines] == ["invariants at step 2", "invariants at step 4"]
    # The yardstick is the update before the check on the training clock (2 s), not the wall time between updates.
    assert all(", off the training clock (" in x and f"% of a {1e3 * STEP_S:.0f} ms update, " in x for x in lines), lines


def test_the_trainer_hands_its_clocks_to_the_invariant_checks(run):
    assert run[3], "Trainer builds its InvariantRunner without clocks=self.clocks: check time stays on the training clock"


def test_records_hold_every_promised_key(run):
    _, records, _, _ = run
    r = records[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_seen", "skipped_updates", "training_seconds", "session_seconds",
                "tokens_per_second_training", "tokens_per_second_session", "data_wait_fraction", "mfu", "host_rss_gib",
                "nonfinite_events", "grad_norm/embedding", "grad_norm/attention", "grad_norm/experts", "grad_norm/router",
                "grad_norm/head", "grad_norm/other"):
        assert key in r, key
    assert any(k.startswith("tokens_per_source/") for k in r)
    assert sum(v for k, v in r.items() if k.startswith("tokens_per_source/")) == r["tokens_seen"]
    groups = sum(r[f"grad_norm/{g}"] ** 2 for g in ("embedding", "attention", "experts", "router", "head", "other"))
    assert groups ** 0.5 == pytest.approx(r["grad_norm"], rel=1e-4)
    for layer in (1, 2, 3):
        load = r[f"moe/{layer}/load"]
        assert len(load) == 8 and sum(load) == pytest.approx(1.0)
        for stat in ("dead_fraction", "maxvio", "load_cv", "entropy", "qb_range"):
            assert f"moe/{layer}/{stat}" in r


def test_summarizer_steady_rate_is_the_window_arithmetic(run, tmp_path):
    run_dir, records, _, _ = run
    _, numbers = summarize(run_dir, warmup_step=2)
    # Only the window 2 -> 4 starts at or after step 2.
    expected = (records[1]["tokens_seen"] - records[0]["tokens_seen"]) / (records[1]["training_seconds"] - records[0]["training_seconds"])
    assert numbers["steady_windows"] == 1
    assert numbers["steady_tokens_per_second_training"] == pytest.approx(expected)
    assert numbers["tokens_per_second_session"] == pytest.approx(records[-1]["tokens_seen"] / records[-1]["session_seconds"])
    assert numbers["probe"] == "smoke"
    assert summarize_main([str(run_dir), "--out", str(tmp_path / "s")]) == 0
    assert {"summary.md", "loss.png", "throughput.png", "grad_norm.png", "expert_load.png"} <= {p.name for p in (tmp_path / "s").iterdir()}
    assert "**Probe:** smoke" in (tmp_path / "s" / "summary.md").read_text()


def test_run_counters_are_exposed_at_zero_before_the_first_update(run):
    """A skip before the first log step must show as an increase (K3SkippedUpdates), not as a series born at 1; the
    update count is there from the start too."""
    _, _, scrapes, _ = run
    samples = {s.name: s.value for f in text_string_to_metric_families(scrapes[0]) for s in f.samples}
    assert samples["titan_k3_skipped_updates_total"] == 0
    assert samples["titan_k3_tokens_total"] == 0
    assert samples["titan_k3_step"] == 0  # the dashboard lists the run (label_values of titan_k3_step) from its start


def test_endpoint_serves_parseable_exposition_during_the_run(run):
    _, records, scrapes, _ = run
    scrapes = scrapes[1:]
    assert len(scrapes) == 2
    families = {f.name: f for f in text_string_to_metric_families(scrapes[-1])}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}

    def value(name, **labels):
        return samples[(name, tuple(sorted({"run": "clocked", **labels}.items())))]

    assert value("titan_k3_tokens_per_second", clock="training") == pytest.approx(records[-1]["tokens_per_second_training"])
    assert value("titan_k3_tokens_per_second", clock="session") == pytest.approx(records[-1]["tokens_per_second_session"])
    assert value("titan_k3_mfu") == pytest.approx(records[-1]["mfu"])
    assert value("titan_k3_grad_norm", group="global") == pytest.approx(records[-1]["grad_norm"])
    assert value("titan_k3_grad_norm", group="experts") == pytest.approx(records[-1]["grad_norm/experts"])
    assert value("titan_k3_expert_load_fraction", layer="1", expert="0") == pytest.approx(records[-1]["moe/1/load"][0])
    assert value("titan_k3_tokens_total") == records[-1]["tokens_seen"]
    per_source = {k.split("/", 1)[1]: v for k, v in records[-1].items() if k.startswith("tokens_per_source/")}
    assert per_source and all(value("titan_k3_tokens_by_source_total", source=s) == n for s, n in per_source.items())
    assert value("titan_k3_step") == STEPS
    assert value("titan_k3_kernel_fallback", op="kda") == 1.0  # auto on a CPU falls back to the torch reference
    assert value("titan_k3_memory_bytes", kind="host_rss") > 0
    build, first = value("titan_k3_startup_seconds", phase="build"), value("titan_k3_startup_seconds", phase="first_update")
    assert build > 0 and first > 0 and value("titan_k3_startup_seconds", phase="total") == pytest.approx(build + first)
    exposed = {s[0] for s in samples}
    for name, (kind, _, _) in NAMES.items():
        if name != "titan_k3_invariant_violations_total":
            assert (name + "_count" if kind == "histogram" else name) in exposed, name
    # Each layer's load statistics are the ones moe_stats computes from that layer's loads (the record's shares
    # give the same CV and entropy as the counts they came from).
    layers = sorted(int(k.split("/")[1]) for k in records[-1] if k.startswith("moe/") and k.endswith("/load"))
    assert layers
    for layer in layers:
        stats = expert_load_stats(torch.tensor(records[-1][f"moe/{layer}/load"]), torch.zeros(1))
        for name, stat in (("titan_k3_expert_load_cv", "load_cv"), ("titan_k3_expert_load_entropy", "entropy"),
                           ("titan_k3_expert_maxvio", "maxvio"), ("titan_k3_dead_expert_fraction", "dead_fraction")):
            assert value(name, layer=str(layer)) == pytest.approx(records[-1][f"moe/{layer}/{stat}"], abs=1e-12), name
            assert value(name, layer=str(layer)) == pytest.approx(stats[stat], rel=1e-6, abs=1e-9), name
    # Every expert of a layer is observed once per log step, relative to the uniform share.
    n_experts = len(records[-1]["moe/1/load"])
    assert value("titan_k3_expert_relative_load_count", layer="1") == n_experts * len(scrapes_logged(records))
    assert value("titan_k3_expert_relative_load_sum", layer="1") == pytest.approx(n_experts * len(scrapes_logged(records)))


def scrapes_logged(records):
    return [r for r in records if "moe/1/load" in r]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (system dependency)")
def test_promtool_accepts_the_exposition(run):
    _, _, scrapes, _ = run
    assert subprocess.run(["promtool", "check", "metrics"], input=scrapes[0], capture_output=True, text=True,
                          timeout=60).returncode == 0
    out = subprocess.run(["promtool", "check", "metrics"], input=scrapes[-1], capture_output=True, text=True, timeout=60)
    # No lint finding either (promtool prints them, and exits 3 for them alone).
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr
    assert "titan_k3_expert_load_cv{" in scrapes[-1] and "titan_k3_expert_load_entropy{" in scrapes[-1]
