"""The planner: its counts against the model, its calibration against the H200 measurements, its CLI and table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_k3.config import ConfigError, load_job_config
from titan_k3.models.k3.args import FLAVORS, count_params
from titan_k3.models.k3.impl import reference_impl
from titan_k3.models.k3.model import K3Model
from titan_k3.models.k3.moe import QB_BINS
from titan_k3.plan import constants as C
from titan_k3.plan.calibration import TOLERANCE, compare, fit_constants, format_comparison
from titan_k3.plan.cluster import Cluster
from titan_k3.plan.costs import CostTable
from titan_k3.plan.estimate import QB_BINS as PLAN_QB_BINS
from titan_k3.plan.estimate import Layout, estimate
from titan_k3.plan.shapes import param_groups
from titan_k3.tools.plan import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("flavor", ["debug", "k3-mini", "k3"])
def test_param_groups_match_the_model_and_its_optimizer_hints(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):
        model = K3Model(args, reference_impl())
    hints = model.optim_hints()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    g = param_groups(args)
    assert g.muon_experts == sum(sizes[n] for n, h in hints.items() if h["use_muon"] and h["per_expert"])
    assert g.muon_dense == sum(sizes[n] for n, h in hints.items() if h["use_muon"] and not h["per_expert"])
    assert g.routers == sum(sizes[n] for n, h in hints.items() if h.get("replicated"))
    assert g.adamw == sum(sizes[n] for n, h in hints.items() if not h["use_muon"] and not h.get("replicated"))
    assert g.embedding == model.tok_embeddings.weight.numel()


def test_histogram_bins_agree_with_the_router():
    assert PLAN_QB_BINS == QB_BINS


def test_constants_are_their_fit():
    for name, value in fit_constants().items():
        assert getattr(C, name) == pytest.approx(value, rel=0.01), name


def test_k3_mini_on_one_and_two_h200s_within_15_percent(capsys):
    rows = compare()
    with capsys.disabled():
        print("\n" + format_comparison(rows))
    checked = 0
    for r in rows:
        if r.step_error is not None:
            assert abs(r.step_error) <= TOLERANCE, (r.point.name, "step", r.step_ms, r.point.step_ms)
            checked += 1
        if r.peak_error is not None and r.point.peak_asserted:
            assert abs(r.peak_error) <= TOLERANCE, (r.point.name, "peak", r.peak_gib, r.point.peak_gib)
            checked += 1
    assert checked == 13  # 3 fitted numbers, 10 checks (one peak printed, not asserted: its why_not)


def _est(flavor="k3-mini", **kw):
    base = dict(dp_replicate=1, dp_shard=8, ep=1, local_batch=2, grad_accum=1, seq_len=4096)
    return estimate(FLAVORS[flavor], Layout(**{**base, **kw}), Cluster(nodes=4), CostTable.load())


def test_estimate_moves_the_way_the_trainer_does():
    none, full = _est(ac="none"), _est(ac="full")
    assert full.memory_gib["activations (one micro-batch)"] < none.memory_gib["activations (one micro-batch)"] / 3
    assert full.compute_s > none.compute_s
    assert _est(dp_shard=16).memory_gib["parameters (fp32)"] < _est().memory_gib["parameters (fp32)"]
    names = lambda e: {c.name for c in e.collectives}  # noqa: E731
    assert "HSDP all-reduce (fp32 gradient shards)" in names(_est(dp_replicate=2, dp_shard=8))
    assert any(c.name.startswith("EP all-gather") for c in _est(ep=8).collectives)
    assert any(c.name.startswith("EP all-to-all") for c in _est(ep=8, expert_dispatch="all_to_all").collectives)
    inside, across = _est(dp_shard=8), _est(dp_shard=16)
    assert not any(c.across_nodes for c in inside.collectives if c.group == "shard")
    assert all(c.across_nodes for c in across.collectives if c.group == "shard")


def test_resharding_after_forward_gathers_the_blocks_twice_and_the_root_once():
    """The trainer keeps the FSDP root (embedding, head) gathered from forward to backward whatever
    fsdp_reshard_after_forward says: resharding gathers every block twice per micro-batch and the root once, and
    keeps the root's bf16 copy beside the two blocks in flight."""
    from titan_k3.plan.shapes import largest_block_params, layer_expert_params, param_groups

    g, A, S = param_groups(FLAVORS["k3-mini"]), 2, 8
    on, off = (_est(grad_accum=A, defer_grad_reduce=False, reshard_after_forward=r) for r in (True, False))
    gather = lambda e: next(c for c in e.collectives if c.name == "FSDP all-gather (bf16 parameters)")  # noqa: E731
    assert (gather(on).calls, gather(off).calls) == (2 * A, A)
    per_gather = 2 * (S - 1) / S  # bf16 bytes each rank receives per parameter gathered
    assert gather(off).bytes_per_rank == pytest.approx(A * g.sharded * per_gather)
    assert gather(on).bytes_per_rank == pytest.approx(A * (2 * g.sharded - g.root) * per_gather)
    copies = "bf16 parameter copies (gathered / cast)"
    a = FLAVORS["k3-mini"]
    in_flight = 2 * largest_block_params(a) + 2 * layer_expert_params(a)  # the running block and the prefetched one
    assert on.memory_gib[copies] * 2**30 == pytest.approx(2 * (in_flight + g.root))
    assert g.root == 2 * FLAVORS["k3-mini"].vocab_size * FLAVORS["k3-mini"].dim


def test_bf16_momentum_halves_the_muon_state_and_nothing_else():
    fp32, bf16 = _est(dp_shard=1), _est(dp_shard=1, momentum_dtype="bfloat16")
    muon = fp32.memory_gib["optimizer: Muon momentum (fp32)"]
    assert bf16.memory_gib["optimizer: Muon momentum (bf16)"] == pytest.approx(muon / 2)
    # k3-mini's 0.84B Muon parameters: ~1.6 GiB less on one GPU, at the forward-backward peak and the step's
    assert muon / 2 == pytest.approx(1.57, abs=0.05)
    assert fp32.peak_gib - bf16.peak_gib == pytest.approx(muon / 2)
    assert fp32.optimizer_peak_gib - bf16.optimizer_peak_gib == pytest.approx(muon / 2)
    assert bf16.optimizer_s < fp32.optimizer_s and bf16.compute_s == fp32.compute_s


def test_full_k3_layers_use_the_measured_costs():
    sources = _est("k3", dp_shard=32, ep=8, local_batch=1).compute_sources
    assert sources["kda"].startswith("measured 38.125 ms")
    assert sources["mla"].startswith("measured 15.876 ms")
    assert sources["moe"].startswith("measured 51.422 ms")
    assert sources["head"].startswith("measured 51.759 ms")


def test_cost_table_scales_with_tokens_and_refuses_bad_files(tmp_path):
    table, a = CostTable.load(), FLAVORS["k3"]
    one = table.cost(a, "kda", 4096, 4096, 112, False, 1e15).seconds
    assert table.cost(a, "kda", 8192, 4096, 112, False, 1e15).seconds == pytest.approx(2 * one)
    assert one == pytest.approx(38.125e-3)
    # The recorded full-width entries were timed eager: a compiled run does not use them.
    assert table.cost(a, "kda", 4096, 4096, 112, True, 1e15).source.startswith("analytic")
    with pytest.raises(ValueError, match="no such file"):
        CostTable.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"entries": [{"kind": "kda", "shape": {}}]}))
    with pytest.raises(ValueError, match="entry 0 lacks"):
        CostTable.load(bad)
    # each was a traceback (AttributeError, TypeError, UnicodeDecodeError), or "no such file" for a folder
    good = {"kind": "kda", "shape": {}, "tokens": 1, "seq_len": 1, "fwd_bwd_ms": 1.0}
    for entries, why in [([1], "entry 0 is int, not an object"),
                         ([{**good, "fwd_bwd_ms": "1"}], "entry 0 needs fwd_bwd_ms, tokens, seq_len: numbers > 0"),
                         ([{**good, "shape": []}], "entry 0 lacks a known kind and a shape")]:
        bad.write_text(json.dumps({"entries": entries}))
        with pytest.raises(ValueError, match=why):
            CostTable.load(bad)
    bad.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostTable.load(bad)
    with pytest.raises(ValueError, match="a folder, not a file"):
        CostTable.load(tmp_path)


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


PILOT = ("--job.config_file", "tomls/pilot.toml")  # no data.dataset: a plan reads no data, the trainer would refuse


def test_cli_plans_the_pilot_on_one_gpu_and_reports_the_trainer_counts(capsys):
    code, out, _ = _cli(capsys, *PILOT, "--cluster.gpus_per_node", "1", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["configured_fits"] and plan["fits"]
    pc = count_params(FLAVORS["k3-mini"])
    assert (plan["params_total"], plan["params_active"]) == (pc.total, pc.active)
    assert round(pc.total / 1e9, 3) == 1.009 and round(pc.active / 1e6, 1) == 144.3
    code, text, _ = _cli(capsys, *PILOT, "--cluster.gpus_per_node", "1")
    assert code == 0 and "Verdict: FITS" in text and "memory per rank" in text
    with pytest.raises(ConfigError, match="'data.dataset' is empty"):
        load_job_config(list(PILOT))


def test_cli_says_full_k3_does_not_fit_one_node(capsys):
    code, out, _ = _cli(capsys, "--model.flavor", "k3", "--training.seq_len", "4096", "--json")
    plan = json.loads(out)
    assert code == 0 and not plan["configured_fits"] and not plan["fits"]
    assert plan["params_total"] == count_params(FLAVORS["k3"]).total
    assert round(plan["params_total"] / 1e12, 2) == 2.65 and round(plan["params_active"] / 1e9, 1) == 104.2
    assert plan["others"][0]["why"].startswith("does not fit")


@pytest.mark.parametrize("argv, message", [
    (["--cluster.nodez", "2"], "unknown cluster key 'cluster.nodez'"),
    (["--cluster.nodes", "two"], "cluster key 'cluster.nodes' = 'two': expected an integer"),
    (["--training.stepz", "2"], "unknown config key 'training.stepz'"),
    (["--parallelism.expert_parallel_degree", "3", "--model.flavor", "k3-mini"], "expert_parallel_degree"),
    (["--table"], "option '--table' needs a value"),
    # nan and inf planned ("peak 2.7 GiB > nan GiB usable"); a negative reserve was told "must be > 0" (0 is allowed)
    (["--cluster.gpu_memory_gib", "nan"], "cluster key 'cluster.gpu_memory_gib' = 'nan': expected a finite number"),
    (["--cluster.inter_node_gbps", "inf"], "cluster key 'cluster.inter_node_gbps' = 'inf': expected a finite number"),
    (["--cluster.reserve_gib", "-1"], "cluster key 'cluster.reserve_gib' = '-1': must be >= 0"),
])
def test_cli_bad_input_is_one_line_and_status_2(capsys, argv, message):
    code, out, err = _cli(capsys, *argv)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


def test_planner_imports_no_torch():
    code = ("import sys, titan_k3.tools.plan as p; p.main(['--model.flavor', 'k3-mini', '--json']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_layer_cost_script_on_cpu_writes_a_table_the_planner_reads(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import layer_cost

    out = tmp_path / "costs.json"
    out.write_text(json.dumps({"entries": [{"kind": "head", "shape": {"dim": 64, "vocab_size": 512}, "tokens": 64,
                                            "seq_len": 64, "fwd_bwd_ms": 999.0}]}))
    monkeypatch.setattr(sys, "argv", ["layer_cost.py", "--flavors", "debug", "--seq", "64", "--out", str(out)])
    assert layer_cost.main() == 0
    entries = json.loads(out.read_text())["entries"]
    assert sorted(e["kind"] for e in entries) == ["dense_ffn", "head", "kda", "mla", "moe"]
    assert all(e["fwd_bwd_ms"] > 0 and e["tokens"] == 64 for e in entries)
    assert next(e for e in entries if e["kind"] == "head")["fwd_bwd_ms"] != 999.0   # replaced, not duplicated
    est = estimate(FLAVORS["debug"], Layout(1, 1, 1, 1, 1, 64), Cluster(), CostTable.load(out))
    assert all(s.startswith("measured") for s in est.compute_sources.values()), est.compute_sources


def test_smallest_full_k3_cluster_is_the_one_docs_scaling_k3_names():
    from titan_k3.config import load_job_config
    from titan_k3.plan.search import plan, smallest_cluster

    cfg = load_job_config(["--model.flavor", "k3", "--training.seq_len", "4096", "--training.compute_dtype", "bfloat16"])
    nodes, verdict = smallest_cluster(FLAVORS["k3"], cfg, Cluster(), CostTable.load())
    assert nodes == 56 and "**56 nodes (448 H200s)**" in (REPO / "docs" / "scaling-k3.md").read_text()
    assert verdict.best.layout.ac == "full" and verdict.best.peak_gib <= Cluster().budget_gib
    assert not plan(FLAVORS["k3"], cfg, Cluster(nodes=55), CostTable.load()).fits


def test_refusal_names_what_cannot_fit_and_accepts_what_may():
    from titan_k3.config import load_job_config
    from titan_k3.plan.search import refusal

    mini = ["--model.flavor", "k3-mini", "--training.seq_len", "4096"]
    assert refusal(load_job_config(mini + ["--training.local_batch_size", "8"]), 1) is None
    assert refusal(load_job_config(["--model.flavor", "k3"]), 0) is None          # no GPU: not planned
    line = refusal(load_job_config(mini + ["--training.local_batch_size", "64"]), 1)
    assert line.startswith("the planner says this run does not fit its 1 GPU(s): peak ")
    assert "this batch fits as 1 GPU, B32 x T4096 x accum 2" in line and "\n" not in line
    # Within the calibration tolerance of the usable memory: accepted (the planner may over-count by that much).
    est = estimate(FLAVORS["k3-mini"], Layout(1, 1, 1, 46, 1, 4096), Cluster(), CostTable.load())
    assert Cluster().budget_gib < est.peak_gib < Cluster().budget_gib / (1 - TOLERANCE)
    assert refusal(load_job_config(mini + ["--training.local_batch_size", "46"]), 1) is None
    bad = refusal(load_job_config(["--model.flavor", "debug", "--parallelism.data_parallel_shard_degree", "3"]), 2)
    assert bad.startswith("the planner says this run cannot start on its 2 GPU(s): config key "
                          "'parallelism.data_parallel_shard_degree' = 3")


def test_the_table_names_every_collective_in_full(capsys):
    """The collectives' names were cut at 34 characters ("Quantile Balancing histograms all-")."""
    assert main(["--job.config_file", "tomls/pretrain.toml", "--parallelism.expert_parallel_degree", "8",
                 "--parallelism.expert_dispatch", "all_gather", "--cluster.nodes", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("FSDP reduce-scatter (fp32 gradients)", "EP all-gather + reduce-scatter (dispatch, combine)",
                 "Quantile Balancing histograms all-reduce (fp64)", "loss, token count, grad-norm all-reduces",
                 "HSDP all-reduce (fp32 gradient shards)"):
        assert f"    {name} " in out, name


def test_a_true_or_false_key_alone_means_true_as_for_the_trainer(capsys):
    """`--compile.enable` alone is `--compile.enable true` on the trainer's command line; the planner said it needs
    a value."""
    alone = main(["--model.flavor", "debug", "--compile.enable", "--json"])
    plain = capsys.readouterr().out
    spelled = main(["--model.flavor", "debug", "--compile.enable", "true", "--json"])
    assert alone == spelled == 0 and plain == capsys.readouterr().out
