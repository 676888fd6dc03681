"""The GPU benchmark scripts, run end to end on CPU with the debug flavor: a crash should cost CI time, not GPU time."""

import json
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "benchmarks" / script), "--flavor", "debug", "--seq", "64", "--batch", "2",
           "--out", str(tmp_path / "out"), *args]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "BENCH_RUNS": str(tmp_path / "runs")})
    assert run.returncode == 0, run.stderr[-2000:]
    return run


def test_train_throughput_times_a_variant_and_writes_its_row(tmp_path):
    _run("train_throughput.py", tmp_path, "--variants", "ours", "--warmup", "2", "--steps", "2", "--profile", "ours")
    rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
    assert len(rows) == 1 and "error" not in rows[0], rows
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["ms_per_step"] > 0
    assert len(rows[0]["step_host_ms"]) == 2 and min(rows[0]["step_host_ms"]) > 0
    assert "peak_reserved_gib" in rows[0] and "peak GiB allocated / reserved" in (tmp_path / "out" / "train_throughput.md").read_text()
    profile = (tmp_path / "out" / rows[0]["profile"]).read_text()
    assert profile.startswith("ours, seq 64, one step") and "aten::mm" in profile
    shapes = profile.split("Operators by input shapes (self host time):")[1]  # the profiler recorded input shapes
    assert "aten::mm" in shapes and "[[" in shapes
    report = (tmp_path / "out" / "train_throughput.md").read_text()
    assert "| ours | B2 T64 |" in report
    # the machine is named under the table: the strong peer's host-bound step moves with the host
    assert f"Host: {platform.node()} (" in report and " cores)." in report


def test_train_throughput_names_the_timed_steps_that_stalled():
    """A step over twice the median host time (as the strong peer's at B32 T1024 in session 32, train_throughput.md)
    is named in the row's note; a steady window adds nothing."""
    from benchmarks.train_throughput import _note

    stalled = dict(round=2, step_host_ms=[157.9, 158.1, 661.0, 157.4, 158.0])
    assert _note(stalled, 2) == ("round 2 of 2; 1 of 5 timed steps stalled (661 ms host time against a median of "
                                 "158.0): ms/step carries their excess")
    assert _note(dict(round=1, step_host_ms=[157.9, 158.1, 300.0, 157.4]), 1) == ""
    assert _note(dict(round=1), 1) == ""  # rows from before the per-step times were kept


def test_train_throughput_isolate_runs_each_variant_in_its_own_process(tmp_path):
    run = _run("train_throughput.py", tmp_path, "--variants", "ours,ours-adamw", "--warmup", "1", "--steps", "1",
               "--profile", "none", "--isolate")
    rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["ours", "ours-adamw"] and not [r for r in rows if "error" in r], rows
    assert len({r["pid"] for r in rows}) == 2, rows
    table = (tmp_path / "out" / "train_throughput.md").read_text()
    assert "| ours | B2 T64 |" in table and "| ours-adamw | B2 T64 |" in table
    assert run.returncode == 0


def test_train_throughput_rounds_alternate_the_variants_and_summarise(tmp_path):
    _run("train_throughput.py", tmp_path, "--variants", "ours,ours-adamw", "--warmup", "1", "--steps", "1",
         "--profile", "ours", "--isolate", "--rounds", "2")
    rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
    assert [(r["variant"], r["round"]) for r in rows] == [("ours", 1), ("ours-adamw", 1), ("ours", 2), ("ours-adamw", 2)]
    assert not [r for r in rows if "error" in r], rows
    assert [bool(r.get("profile")) for r in rows] == [True, False, False, False]  # one profile per variant and shape
    table = (tmp_path / "out" / "train_throughput.md").read_text()
    assert "round 2 of 2" in table and "| ours-adamw | B2 T64 | 2 |" in table


def test_train_throughput_runs_again_on_a_machine_that_ran_it_before(tmp_path):
    """Found on the H200: a second call on a warm machine found the first call's run folder under the same name
    and the trainer refused to start the variant over."""
    for _ in range(2):
        _run("train_throughput.py", tmp_path, "--variants", "ours", "--warmup", "1", "--steps", "1", "--profile", "none")
        rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
        assert "error" not in rows[-1], rows


def test_train_throughput_isolate_kills_a_variant_past_the_deadline_and_keeps_going(tmp_path):
    _run("train_throughput.py", tmp_path, "--variants", "ours,ours-adamw", "--isolate", "--profile", "none",
         "--deadline-s", "3")
    rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
    assert [r.get("error", "")[:6] for r in rows] == ["killed", "skippe"], rows
    assert "killed after 3 s: deadline" in (tmp_path / "out" / "train_throughput.md").read_text()


def test_checkpoint_benchmark_saves_blocking_and_async(tmp_path):
    run = _run("checkpoint.py", tmp_path)
    table = (tmp_path / "out" / "checkpoint.md").read_text()
    assert "| blocking |" in table and "| async |" in table
    modes = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"mode"')]
    assert [m["mode"] for m in modes] == ["disabled", "async"] and all(m["size_gib"] > 0 for m in modes)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor's CPU backend needs a C++ compiler")
def test_compile_startup_builds_each_depth_in_a_fresh_cache(tmp_path):
    _run("compile_startup.py", tmp_path, "--layers", "1")
    rows = json.loads((tmp_path / "out" / "compile_startup.json").read_text())["rows"]
    assert [r["layers"] for r in rows] == [1] and "error" not in rows[0], rows
    # a fresh, empty cache: nothing reused, and every graph dynamo made was built
    assert rows[0]["reused"] == 0 and rows[0]["built"] == rows[0]["graphs"] > 0, rows
    assert "| debug | 1 | B2 T64 |" in (tmp_path / "out" / "compile_startup.md").read_text()


def test_attn_res_benchmark_checks_and_times_every_variant(tmp_path):
    _run("attn_res.py", tmp_path, "--sources", "2,3", "--backend", "aot_eager", "--sweep")
    rows = json.loads((tmp_path / "out" / "attn_res.json").read_text())["rows"]
    assert [r["n_sources"] for r in rows] == [2, 3]
    assert all(r[f"{v}_{k}"] > 0 for r in rows for v in ("eager", "compiled", "ours") for k in ("fwd_ms", "fwd_bwd_ms"))
    assert "| B2 T64 D64 float32 | 3 |" in (tmp_path / "out" / "attn_res.md").read_text()


def test_attn_res_stream_checks_and_times_the_mixes_with_and_without_gradient_sinks_and_norms(tmp_path):
    _run("attn_res.py", tmp_path, "--stream")
    rows = json.loads((tmp_path / "out" / "attn_res_stream.json").read_text())["rows"]
    norms_beside = "norms in sublayers (compiled), autograd sums"
    assert [r["variant"] for r in rows] == ["autograd sums", "sinks", norms_beside, "norms in mixes, autograd sums",
                                            "norms in sublayers (compiled), sinks", "norms in mixes, sinks"]
    assert [r["baseline"] for r in rows] == ["autograd sums"] * 2 + [norms_beside] * 4  # each against its own kind
    assert all(r["fwd_bwd_ms"] > 0 and r["rel_rms"] < 1e-5 for r in rows), rows  # float32 on the CPU interpreter
    assert "| debug | B2 T64 D64 float32 | 9 | sinks |" in (tmp_path / "out" / "attn_res_stream.md").read_text()


def test_attn_res_stream_sweep_checks_the_stream_then_times_every_backward_launch(tmp_path):
    from benchmarks.attn_res import STREAM_SWEEP

    run = _run("attn_res.py", tmp_path, "--stream", "--sweep")
    assert "stream check norms in mixes, sinks: embedding gradient" in run.stdout
    swept = [line for line in run.stdout.splitlines() if line.startswith("stream sweep bwd")]
    assert [line.split(":")[0] for line in swept] == [
        f"stream sweep bwd tile {tile} warps {warps} tiles {tiles} hold {hold}" for tile, warps, tiles, hold in STREAM_SWEEP]
    assert not (tmp_path / "out" / "attn_res_stream.json").exists()  # a sweep writes no table


def test_kda_candidates_change_the_launch_table_forward_and_backward_then_restore_it():
    from benchmarks.kda import launch_settings, parse_candidate
    from kernels.kda import ops

    before = {kernel: dict(opts) for kernel, opts in ops.LAUNCH.items()}
    changes = parse_candidate("dintra.BK=64;scores.BK=64;state.fill_sms=0")
    assert changes == {"dintra": {"BK": 64}, "scores": {"BK": 64}, "state": {"fill_sms": 0}}
    with launch_settings(changes):
        assert ops.LAUNCH["dintra"]["BK"] == 64 and ops.LAUNCH["scores"]["BK"] == 64
        assert ops.LAUNCH["state"]["fill_sms"] == 0 and ops.LAUNCH["state"]["BV"] == before["state"]["BV"]
    assert ops.LAUNCH == before
    with pytest.raises(SystemExit, match="no kernel 'dinrta'"):
        parse_candidate("dinrta.BK=64")


def test_muon_benchmark_times_both_passes(tmp_path):
    _run("muon.py", tmp_path, "--steps", "2", "--ns-chunk", "3")
    rows = json.loads((tmp_path / "out" / "muon.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fused", "torch passes", "fused, chunks of 3"]
    assert all(r["host_ms"] > 0 for r in rows)
    assert "| fused |" in (tmp_path / "out" / "muon.md").read_text()


def test_newton_schulz_benchmark_checks_both_polynomial_paths_on_every_block_shape(tmp_path):
    _run("newton_schulz.py", tmp_path)
    rows = json.loads((tmp_path / "out" / "newton_schulz.json").read_text())["rows"]
    shapes = {r["shape"] for r in rows}
    assert len(shapes) > 3 and {r["path"] for r in rows} == {"triton", "cublas"}
    by_shape = {}
    for r in rows:
        by_shape.setdefault(r["shape"], {})[r["path"]] = r["rel_err"]
    for errs in by_shape.values():  # on CPU both paths are the reference: bf16 rounding of the same math, equal
        assert errs["triton"] == errs["cublas"] and 0 < errs["triton"] < 1


def test_gram_newton_schulz_is_the_same_polynomial_in_float32():
    """In float32 the Gram iteration (any restarts, either orientation) gives what our Newton-Schulz gives: the same
    polynomial of G; only half precision tells them apart."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.newton_schulz import gram_newton_schulz
    from titan_k3.optim.orthogonalise import newton_schulz

    gen = torch.Generator().manual_seed(0)
    for shape in ((3, 24, 56), (2, 40, 17)):
        G = torch.randn(*shape, generator=gen)
        want = newton_schulz(G, 5, dtype=torch.float32, scale=1.7)
        for restarts in ((), (2,), (3,), (1, 3)):
            got = gram_newton_schulz(G, 5, restarts, torch.float32, scale=1.7)
            assert got.shape == G.shape
            assert ((got - want).norm() / want.norm()).item() < 1e-5, (shape, restarts)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU check runs in Triton's interpreter")
def test_one_kernel_newton_schulz_is_ours_in_float32_wide_tall_and_in_place():
    """The one-kernel iteration (benchmarks/ns_one_kernel.py) gives our Newton-Schulz in float32 for blocks in both
    orientations, over more blocks than programs (scratch reused), written over its input or into a new tensor."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.ns_one_kernel import newton_schulz_blocks
    from kernels.muon.reference import NS_COEFFS
    from titan_k3.optim.orthogonalise import newton_schulz

    gen = torch.Generator().manual_seed(0)
    small = dict(M_PAD=32, BLOCK_T=16, BLOCK_K=16, BLOCK_N=16)
    for shape, steps in (((5, 24, 40), 5), ((3, 40, 24), 5), ((2, 20, 45), 1)):
        G = torch.randn(*shape, generator=gen)
        want = newton_schulz(G, steps, dtype=torch.float32, scale=1.7)
        got = newton_schulz_blocks(G, steps, NS_COEFFS, scale=1.7, programs=2, config=small)
        assert ((got - want).norm() / want.norm()).item() < 1e-5, shape
        scratch = G.mT.contiguous().mT  # the other memory layout, overwritten
        assert newton_schulz_blocks(scratch, steps, NS_COEFFS, scale=1.7, out=scratch, programs=2,
                                    config=small) is scratch
        assert ((scratch - want).norm() / want.norm()).item() < 1e-5, shape
    with pytest.raises(ValueError, match="wider than 256"):
        newton_schulz_blocks(torch.zeros(1, 300, 300), 5, NS_COEFFS)


def test_padded_newton_schulz_is_ours_wide_tall_and_chunked():
    """The zero-padded iteration (newton_schulz.py --pad) is ours to float64 rounding, in both orientations, whole
    and in chunks that leave a ragged last one."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks.newton_schulz import padded_newton_schulz
    from titan_k3.optim.orthogonalise import newton_schulz

    gen = torch.Generator().manual_seed(0)
    for shape in ((5, 8, 20), (5, 20, 8)):
        G = torch.randn(*shape, generator=gen, dtype=torch.float64) * 1e-3
        want = newton_schulz(G, 5, dtype=torch.float64, scale=1.7)
        for width, chunk in ((20, 0), (32, 0), (32, 2)):
            got = padded_newton_schulz(G, 5, width=width, scale=1.7, chunk=chunk)
            assert got.shape == G.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_newton_schulz_benchmark_gram_rows(tmp_path):
    _run("newton_schulz.py", tmp_path, "--gram", "--chunk", "0")
    rows = json.loads((tmp_path / "out" / "newton_schulz.json").read_text())["rows"]
    gram = [r for r in rows if "variant" in r]
    assert len({r["shape"] for r in gram}) == 2 and len(gram) == 2 * 5
    assert all(0 < r["rel_err"] < 1 for r in gram if "no restart" not in r["variant"]), gram
    assert "Gram Newton-Schulz against ours" in (tmp_path / "out" / "newton_schulz.md").read_text()


def test_every_throughput_variant_is_a_valid_config():
    """A variant's overrides are checked here, not on the GPU after a minutes-long start."""
    sys.path.insert(0, str(REPO))
    from benchmarks.train_throughput import VARIANTS, base_args
    from titan_k3.config import load_job_config

    for name, overrides in VARIANTS.items():
        load_job_config([*base_args("k3-mini", 4096, 8, name), *overrides])


def test_kda_precision_smoke_measures_every_gradient(tmp_path):
    """One small float32 case on the CPU interpreter: every error column present and small (the interpreter is right)."""
    from benchmarks import kda_precision

    assert kda_precision.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "kda_precision.json").read_text())["rows"]
    assert len(rows) == 1 and all(rows[0][name] < 1e-4 for name in kda_precision.NAMES)
    assert "KDA gradients vs the float64 recurrence" in (tmp_path / "kda_precision.md").read_text()


def test_qb_histogram_smoke_checks_every_variant_and_times_none(tmp_path):
    """A tiny shape on the CPU: each copy count's results against eager's one-copy counts, the table written."""
    from benchmarks import qb_histogram

    assert qb_histogram.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "qb_histogram.json").read_text())["rows"]
    assert {(r["op"], r["replicas"]) for r in rows} == {(op, r) for op in ("margins", "counts")
                                                         for r in qb_histogram.REPLICAS}
    assert all(r["ms"] is None and r["bins_off"] == 0 for r in rows), rows
    table = (tmp_path / "qb_histogram.md").read_text()
    assert "| T64 E8 k2 NB1024 | counts | 16 (trainer) | — | — | 0 |" in table and "nothing timed" in table


def test_expert_tiles_smoke_pins_another_setting_and_checks_its_outputs(tmp_path):
    """A tiny shape on the CPU: every use runs the trainer's setting and one other, pinned through the trainer's own
    launchers, and the other's outputs agree; a pinned setting that computed something else would be a row's error."""
    from benchmarks import expert_tiles

    assert expert_tiles.main(["--smoke", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "expert_tiles.json").read_text())["rows"]
    assert [r["use"] for r in rows] == [u for u in expert_tiles.USES for _ in range(2)]
    assert all("error" not in r and max(r["rel_rms"], r["layer_rel_rms"]) < 1e-5 and "ms" not in r for r in rows), rows
    # really another setting: not the trainer's, nor the interpreter's one candidate
    assert {r["setting"] for r in rows[1::2]}.isdisjoint({"trainer's", "M32 N32 K32 w4 s1", "K32 N32 R32 w4 s1"})
    assert "K64 N64 R32 w4 s5" in {r["setting"] for r in rows}  # each block named: the weight gradients' K, N, R
    # another tile order of the same sums: the w2 GEMM's K (F = 48) is cut differently, so not bit-equal
    other_w2 = next(r for r in rows if r["use"] == "w2" and r["setting"] != "trainer's")
    assert other_w2["rel_rms"] > 0 and other_w2["layer_rel_rms"] > 0  # the pin reaches the whole layer too


def test_rows_launch_variants_run_the_named_launch_and_restore_the_default(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    import kernels.fused_ce.ce_rows as ce_rows_module
    from benchmarks.train_throughput import VARIANTS, rows_launch, variant_rows_launch

    assert "ours-recipe-rows-launch" in VARIANTS
    launch = ce_rows_module.RowsLaunch(8192, 16, 2, True, True, False)
    assert rows_launch("8192,16,2,1,1,0") == launch
    before = ce_rows_module.LAUNCH
    with variant_rows_launch("ours-recipe-rows-launch", "8192,16,2,1,1,0"):
        assert ce_rows_module.LAUNCH == launch
    assert ce_rows_module.LAUNCH is before
    with variant_rows_launch("ours-recipe", "8192,16,2,1,1,0"):
        assert ce_rows_module.LAUNCH is before
    # A one-pass variant sets the one-pass kernel's launch, not the two-pass one's.
    import kernels.fused_ce.ce_one_pass as ce_one_pass_module

    one_pass_before = ce_one_pass_module.LAUNCH
    from benchmarks.train_throughput import ROWS_LAUNCH_MODULES

    assert "--kernels.loss_one_pass" in VARIANTS["ours-recipe-loss-one-pass-rows-launch"]
    assert set(ROWS_LAUNCH_MODULES) <= {v for v in VARIANTS if v.endswith("-rows-launch")}
    with variant_rows_launch("ours-recipe-loss-one-pass-rows-launch", "8192,16,2,1,1,0"):
        assert ce_one_pass_module.LAUNCH == launch and ce_rows_module.LAUNCH is before
    assert ce_one_pass_module.LAUNCH is one_pass_before
    with pytest.raises(SystemExit, match="needs --rows-launch"), variant_rows_launch("ours-recipe-rows-launch", ""):
        pass
    with pytest.raises(SystemExit, match="6 comma-separated integers"):
        rows_launch("8192,16")
    assert ce_rows_module.LAUNCH is before

    # --isolate hands the launch to the variant's own process.
    from types import SimpleNamespace

    from benchmarks import train_throughput

    seen = {}
    monkeypatch.setattr(subprocess, "run", lambda cmd, timeout, env: seen.update(cmd=cmd) or SimpleNamespace(returncode=3))
    args = SimpleNamespace(flavor="debug", warmup=1, steps=1, out=tmp_path, memory_peak="none",
                           rows_launch="8192,16,2,1,1,0")
    train_throughput.run_isolated("ours-recipe-rows-launch", 64, 2, args, 60.0, "none")
    assert seen["cmd"][seen["cmd"].index("--rows-launch") + 1] == "8192,16,2,1,1,0"


def test_expert_tiles_run_once_runs_every_use_and_writes_nothing(tmp_path, monkeypatch):
    """--run-once is the workload for an outside profiler: each use twice at the trainer's setting, no results."""
    sys.path.insert(0, str(REPO))
    from benchmarks import expert_tiles

    ran = []
    real = expert_tiles.run_use
    monkeypatch.setattr(expert_tiles, "run_use", lambda use, t: ran.append(use) or real(use, t))
    assert expert_tiles.main(["--smoke", "--run-once", "--uses", "w2,glu_bwd", "--out", str(tmp_path)]) == 0
    assert ran == ["w2", "w2", "glu_bwd", "glu_bwd"]
    assert list(tmp_path.iterdir()) == []


def test_expert_tiles_pins_the_setting_and_restores_the_kernel():
    from benchmarks import expert_tiles
    from kernels.grouped_gemm import ops, triton_moe

    config = expert_tiles.EXTRA["mm"][0]
    before = ops.grouped_mm_kernel
    with expert_tiles.pinned("grouped_mm_kernel", config):
        assert ops.grouped_mm_kernel.kwargs["BLOCK_K"] == config.kwargs["BLOCK_K"]
        assert ops.grouped_mm_kernel.kwargs["num_stages"] == config.num_stages
    assert ops.grouped_mm_kernel is before
    with expert_tiles.pinned(None, (16, 128, 4)):
        assert triton_moe.GLU_BWD_LAUNCH == dict(rows=16, cols=128, num_warps=4)
    assert triton_moe.GLU_BWD_LAUNCH == dict(rows=32, cols=64, num_warps=8)


def test_short_conv_sweep_launches_each_setting_and_restores_the_default(tmp_path, monkeypatch):
    """The CPU interpreter at a tiny shape: the sweep's other setting really reaches the dz pass's launch (its own
    grid), computes the default's gradients, and the default launch is back afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from benchmarks import short_conv
    from kernels.short_conv import ops, triton_conv

    default = dict(triton_conv.DZ_LAUNCH)
    other = dict(BLOCK_T=2, BLOCK_C=16, TILES=3, num_warps=4)
    monkeypatch.setattr(short_conv, "SWEEP", [other])
    grids = []
    kernel = ops.conv_silu_bwd_dz_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(ops, "conv_silu_bwd_dz_kernel", Spy())
    monkeypatch.setattr(sys, "argv", ["short_conv.py", "--flavor", "debug", "--batch", "1", "--seq", "40",
                                      "--doc-len", "7", "--out", str(tmp_path), "--sweep"])
    assert short_conv.main() == 0
    rows = json.loads((tmp_path / "short_conv.json").read_text())["rows"]
    swept = [r for r in rows if "bwd_ms" in r]
    assert [r["TILES"] for r in swept] == [default["TILES"], 3]
    assert all(max(r["rel_rms_vs_default"]) < 1e-6 for r in swept), swept
    debug = short_conv.FLAVORS["debug"]
    channels = debug.kda_heads * debug.kda_head_dim
    assert (math.ceil(40 / 6), math.ceil(channels / 16)) in grids  # the other setting's own grid was launched
    assert triton_conv.DZ_LAUNCH == default


def test_startup_breakdown_buckets_the_threads_a_first_update_waits_on(tmp_path):
    """A synthetic py-spy raw recording: each stack lands in its first matching bucket, per critical thread."""
    sys.path.insert(0, str(REPO))
    from benchmarks.startup_breakdown import breakdown, critical_threads, first_call_compiles, read_raw

    main, grad, other = "thread (1): MainThread", "thread (2)", "thread (3): tqdm_monitor"
    compile_ = "compile (triton/compiler/compiler.py:300)"
    (tmp_path / "rec.txt").write_text("\n".join([
        f"{main};<module> (titan_k3/train.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 50",
        f"{main};train_step (titan_k3/train.py:9);kda_forward (kernels/kda/ops.py:146);run (triton/runtime/jit.py:1);{compile_} 25",
        f"{main};train_step (titan_k3/train.py:9);call (torch/_inductor/output_code.py:1);"
        f"kda_forward (kernels/kda/ops.py:149);{compile_} 10",
        f"{main};train_step (titan_k3/train.py:9);_precompile_config (torch/_inductor/runtime/triton_heuristics.py:872);"
        f"{compile_} 5",
        f"{main};train_step (titan_k3/train.py:9);_engine_run_backward (torch/autograd/graph.py:1) 40",
        f"{grad};apply (torch/autograd/function.py:317);_backward_impl (torch/_functorch/x.py:1);"
        f"mix_backward (kernels/attn_res/mix.py:195);{compile_} 20",
        f"{other};run (threading.py:1) 999",
    ]) + "\n")
    stacks = read_raw(tmp_path / "rec.txt")
    threads = critical_threads(stacks)
    assert threads == [main, grad]  # the busy monitor thread is not on the first update's path
    counts = breakdown(stacks, threads)
    assert counts[main]["imports"] == 50 and counts[main]["Triton compile (a kernel's first call)"] == 40
    assert counts[main]["waiting in backward() for the autograd thread"] == 40
    assert counts[grad]["Triton compile (a kernel's first call)"] == 20
    sites = first_call_compiles(stacks, set(threads))
    assert sites[(main, "kda_forward @ kernels/kda/ops.py:146")] == 25
    assert sites[(main, "kda_forward @ kernels/kda/ops.py:149")] == 10  # ours, though called from inductor's graph
    assert sites[(main, "inductor's generated kernels")] == 5
    assert sites[(grad, "mix_backward @ kernels/attn_res/mix.py:195")] == 20


@pytest.mark.parametrize("script", ["triton_compile_parallel.py", "host_syncs.py", "fp8_experts.py", "fp8_head.py"])
def test_gpu_only_diagnostics_refuse_in_one_line_without_cuda(script):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the refusal path is for machines without CUDA")
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / script)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "needs CUDA" in run.stderr, run.stderr


def test_host_syncs_names_the_call_site_of_each_synchronising_call():
    """CUDA's sync-debug warnings are counted by the innermost frame of ours; other warnings pass through."""
    import warnings

    sys.path.insert(0, str(REPO))
    from benchmarks.host_syncs import SyncRecorder

    # A function whose frames say titan_k3/, as the trainer's own code would, issuing the debug mode's warning.
    source = "import warnings\n\ndef settle():\n    warnings.warn('called a synchronizing CUDA operation')\n"
    scope: dict = {}
    exec(compile(source, "/repo/titan_k3/fake_trainer.py", "exec"), scope)
    with warnings.catch_warnings(record=True) as passed, SyncRecorder() as recorder:
        for _ in range(3):
            scope["settle"]()
        warnings.warn("an unrelated warning", UserWarning)
    assert recorder.sites == {"titan_k3/fake_trainer.py:4 settle": 3}, recorder.sites
    assert [str(w.message) for w in passed] == ["an unrelated warning"]


@pytest.mark.parametrize("flavor", ["debug", "tiny"])
def test_strong_peer_has_our_architecture_parameter_for_parameter(flavor):
    from benchmarks.peer_compiled import PeerModel
    from titan_k3.models.k3.args import count_params, get_flavor

    args = get_flavor(flavor)
    peer = PeerModel(args, "torch")
    assert sum(p.numel() for p in peer.parameters()) == count_params(args).total


def test_strong_peer_learns_a_fixed_batch():
    import torch

    from benchmarks.peer_compiled import PeerCompiledTrainer, PeerConfig
    from titan_k3.data.loader import Batch

    trainer = PeerCompiledTrainer(PeerConfig(flavor="debug", vocab_size=512, parts="torch", compile=False, lr=3e-3))
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    labels = ids[:, 1:].clone()
    labels[0, 5] = -100  # an ignored target (a document boundary) must not count
    batch = Batch(input_ids=ids[:, :-1], labels=labels, cu_seqlens=torch.tensor([0, 32, 64]), source_tokens={},
                  fingerprints=torch.zeros(2, dtype=torch.int64))
    losses = [float(trainer.train_step(batch)) for _ in range(25)]
    trainer.close()
    assert all(map(lambda x: x == x, losses)), losses
    assert losses[-1] < 0.5 * losses[0], losses


def test_strong_peer_schedules_the_garbage_collector_as_our_trainer_does(monkeypatch):
    """The peer, like TorchTitan and our trainer, turns Python's automatic collector off while it trains and runs a
    generation-1 pass every gc_every updates (an automatic pass pauses its host-bound step); close() restores it."""
    import gc

    import torch

    from benchmarks.peer_compiled import PeerCompiledTrainer, PeerConfig
    from titan_k3.data.loader import Batch

    passes = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: passes.append(generation) or real_collect(generation))
    was_enabled = gc.isenabled()
    gc.enable()  # as in a fresh process (a trainer another test left open may have turned it off)
    trainer = PeerCompiledTrainer(PeerConfig(flavor="debug", vocab_size=512, parts="torch", compile=False, gc_every=2))
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = Batch(input_ids=ids[:, :-1], labels=ids[:, 1:].clone(), cu_seqlens=torch.tensor([0, 32, 64]),
                  source_tokens={}, fingerprints=torch.zeros(2, dtype=torch.int64))
    try:
        assert not gc.isenabled() and passes == [1]  # one pass at the start
        for _ in range(5):
            trainer.train_step(batch)
        assert not gc.isenabled() and passes == [1, 1, 1]  # before updates 2 and 4
    finally:
        trainer.close()
        restored = gc.isenabled()
        if not was_enabled:
            gc.disable()
    assert restored


def test_the_strong_peer_ratio_is_to_the_faster_strong_peer_of_the_same_slot():
    """peer-compiled and peer-compiled-graphs (torch.compile's CUDA graphs): a row's strong ratio is to whichever
    ran faster at its shape and round, never to a peer of another slot."""
    from benchmarks.train_throughput import STRONG_PEERS, _ratio, rounds_summary

    def row(variant, tps, rnd=1, seq=64):
        return {"variant": variant, "seq": seq, "batch": 2, "round": rnd, "tokens_per_s": tps, "ms_per_step": 1e3 / tps}

    rows = [row("peer-compiled", 100.0), row("peer-compiled-graphs", 125.0), row("ours", 150.0),
            row("peer-compiled", 120.0, rnd=2), row("ours", 150.0, rnd=2), row("peer-compiled-graphs", 300.0, seq=128)]
    assert _ratio(rows[2], rows, STRONG_PEERS) == "1.20x"  # 150 / 125: the graphs peer was faster in round 1
    assert _ratio(rows[4], rows, STRONG_PEERS) == "1.25x"  # round 2 ran only peer-compiled
    assert _ratio(rows[2], rows, ("peer",)) == "—"
    assert "| ours | B2 T64 | 2 | 6.7 | 6.7 | 6.7 | 1.23x (1.20-1.25) |" in rounds_summary(rows)


def test_the_eager_peer_ratio_is_to_the_faster_eager_model_of_the_same_slot():
    """`peer` (our model run eagerly, ~99 GiB: more than an H100 holds) and `peer-public-eager`: a row's eager ratio
    is to whichever ran faster in its slot, and to the public-parts one alone where `peer` did not run."""
    from benchmarks.train_throughput import EAGER_PEERS, _ratio

    def row(variant, tps, rnd=1):
        return {"variant": variant, "seq": 64, "batch": 2, "round": rnd, "tokens_per_s": tps}

    rows = [row("peer", 80.0), row("peer-public-eager", 100.0), row("ours", 150.0),
            row("peer-public-eager", 75.0, rnd=2), row("ours", 150.0, rnd=2), row("peer-compiled", 140.0, rnd=2)]
    assert _ratio(rows[2], rows, EAGER_PEERS) == "1.50x"  # 150 / 100: the public-parts eager model was faster
    assert _ratio(rows[4], rows, EAGER_PEERS) == "2.00x"  # round 2: peer-public-eager alone, never a strong peer


def test_strong_peer_with_compile_graphs_compiles_each_block_so_and_marks_each_step(monkeypatch):
    """peer-compiled-graphs' wiring: every block compiled with mode "reduce-overhead" (torch.compile's CUDA graphs),
    each step marked as a new cudagraph-trees step before its forward. The compile itself is stubbed (CPU CI): what
    the mode does is measured on the GPU."""
    import torch

    from benchmarks.peer_compiled import PeerCompiledTrainer, PeerConfig
    from titan_k3.data.loader import Batch

    modes, marks = [], []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: modes.append(kw.get("mode")))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    trainer = PeerCompiledTrainer(PeerConfig(flavor="debug", vocab_size=512, parts="torch", compile=True,
                                             compile_mode="reduce-overhead", lr=3e-3))
    assert modes == ["reduce-overhead"] * len(trainer.model.layers)
    ids = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = Batch(input_ids=ids[:, :-1], labels=ids[:, 1:].clone(), cu_seqlens=torch.tensor([0, 32, 64]),
                  source_tokens={}, fingerprints=torch.zeros(2, dtype=torch.int64))
    losses = [float(trainer.train_step(batch)) for _ in range(3)]
    trainer.close()
    assert len(marks) == 3 and all(math.isfinite(x) for x in losses), (marks, losses)
    plain = PeerCompiledTrainer(PeerConfig(flavor="debug", vocab_size=512, parts="torch", compile=True))
    plain.close()
    assert modes[-len(plain.model.layers):] == [None] * len(plain.model.layers) and not plain.graphs


def test_the_bf16_head_peer_is_the_graphs_peer_with_the_head_gradient_added_up_in_bf16(monkeypatch, tmp_path):
    """peer-compiled-graphs-bf16-head: a strong peer (its ratio competes for the strongest), built as
    peer-compiled-graphs with `head_grad_fp32=False` (fla's `accumulate_grad_in_fp32=False`); the others keep float32."""
    import benchmarks.peer_compiled as peer_compiled
    from benchmarks.train_throughput import STRONG_PEERS, run_variant

    seen = set()

    class Stop(Exception):
        """Raised by the stub trainer once it has seen its config: nothing is built."""

    def capture(cfg):
        seen.add((cfg.compile_mode, cfg.head_grad_fp32))
        raise Stop

    monkeypatch.setattr(peer_compiled, "PeerCompiledTrainer", capture)
    assert "peer-compiled-graphs-bf16-head" in STRONG_PEERS
    for name in ("peer-compiled-graphs", "peer-compiled-graphs-bf16-head", "peer-compiled"):
        with pytest.raises(Stop):
            run_variant(name, "k3-mini", 64, 2, 0, 1, tmp_path, False)
    assert seen == {("reduce-overhead", True), ("reduce-overhead", False), (None, True)}


def test_the_headline_variant_is_the_pretraining_recipe():
    """ours-recipe (tomls/pretrain.toml, the headline) and ours-compile-step-graph-lean-memory (every flag spelled
    out) resolve to one step.

    Every section that shapes an update must agree; a lever turned on in the recipe and not in the headline's
    variant (or the reverse) would make the headline measure something users do not run.
    """
    sys.path.insert(0, str(REPO))
    from dataclasses import asdict

    from benchmarks.train_throughput import VARIANTS, base_args
    from titan_k3.config import load_job_config

    def resolved(name: str) -> dict:
        cfg = asdict(load_job_config(base_args("k3-mini", 1024, 32, name) + VARIANTS[name]))
        # NOTE: lr_scheduler too: the learning rate steers routing, and routing the experts' load and speed.
        return {k: cfg[k] for k in ("model", "training", "optimizer", "lr_scheduler", "compile", "kernels", "float8",
                                    "activation_checkpoint", "parallelism")}

    recipe, headline = resolved("ours-recipe"), resolved("ours-compile-step-graph-lean-memory")
    differing = {f"{section}.{key}": (recipe[section][key], headline[section][key])
                 for section in recipe for key in recipe[section] if recipe[section][key] != headline[section][key]}
    # One process on one GPU runs without FSDP, so the recipe's multi-GPU setting changes nothing there.
    assert set(differing) <= {"parallelism.fsdp_reshard_after_forward"}, differing
    assert recipe["optimizer"]["momentum_dtype"] == "bfloat16" and recipe["compile"]["cuda_graph_share_pool"]
    assert recipe["training"]["expandable_segments"] and recipe["kernels"]["loss_chunk_rows"] == 0
    assert recipe["optimizer"]["ns_chunk"] == 512


def test_reserved_by_pool_splits_the_reserve_between_the_default_allocator_and_graph_pools():
    sys.path.insert(0, str(REPO))
    from benchmarks.common import pools_table, reserved_by_pool

    gib = 2**30
    segments = [  # the shape of torch.cuda.memory_snapshot()'s segments, the fields used
        {"segment_pool_id": (0, 0), "stream": 0, "total_size": 2 * gib, "allocated_size": gib,
         "blocks": [{"size": gib, "state": "active_allocated"}, {"size": gib, "state": "inactive"}]},
        {"segment_pool_id": (1, 3), "stream": 7, "total_size": 6 * gib, "allocated_size": 2 * gib,
         "blocks": [{"size": 2 * gib, "state": "active_allocated"}, {"size": 3 * gib, "state": "inactive"},
                    {"size": gib, "state": "inactive"}]},
        {"segment_pool_id": (0, 0), "stream": 0, "total_size": gib // 2, "allocated_size": gib // 2,
         "blocks": [{"size": gib // 2, "state": "active_allocated"}]},
    ]
    rows = reserved_by_pool(segments)
    assert [(r["pool"], r["stream"], r["segments"]) for r in rows] == [("graph pool 1.3", 7, 1), ("default", 0, 2)]
    assert (rows[0]["reserved_gib"], rows[0]["allocated_gib"], rows[0]["free_gib"], rows[0]["largest_free_gib"]) \
        == (6.0, 2.0, 4.0, 3.0)
    assert (rows[1]["reserved_gib"], rows[1]["allocated_gib"], rows[1]["largest_free_gib"]) == (2.5, 1.5, 1.0)
    assert "| graph pool 1.3 | 7 | 1 | 6.00 | 2.00 | 4.00 | 3.00 |" in pools_table(rows)
    assert reserved_by_pool([]) == []


def test_a_variant_that_needs_an_allocator_setting_runs_only_in_its_own_process(tmp_path, monkeypatch):
    """ours-recipe-expandable sets PYTORCH_CUDA_ALLOC_CONF for its child; in this process it is refused by name."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    _run("train_throughput.py", tmp_path, "--variants", "ours-recipe-expandable", "--profile", "none")
    rows = json.loads((tmp_path / "out" / "train_throughput.json").read_text())["rows"]
    assert rows[0]["error"] == "needs --isolate: sets PYTORCH_CUDA_ALLOC_CONF before CUDA starts", rows

    sys.path.insert(0, str(REPO))
    from types import SimpleNamespace

    from benchmarks import train_throughput

    seen = {}
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, timeout, env: seen.update(env=env, cmd=cmd) or SimpleNamespace(returncode=3))
    args = SimpleNamespace(flavor="debug", warmup=1, steps=1, out=tmp_path, memory_peak="ours-recipe-expandable",
                           rows_launch="")
    row = train_throughput.run_isolated("ours-recipe-expandable", 64, 2, args, 60.0, "none")
    assert seen["env"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "PATH" in seen["env"]
    flag = seen["cmd"].index("--memory-peak")  # the child traces the allocator when the parent was asked to
    assert seen["cmd"][flag + 1] == "ours-recipe-expandable"
    assert row["error"] == "child process exited 3"
    train_throughput.run_isolated("ours-recipe", 64, 2, args, 60.0, "none")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in seen["env"]


def test_ab_commits_times_each_prepared_tree_in_alternating_rounds(tmp_path):
    """prepare writes HEAD's tree once (named twice) without the results; run times it with its own code, round after
    round, and names the commit in every row and in the summary."""
    if not (REPO / ".git").exists():
        pytest.skip("needs the repository's git history")
    script, trees = str(REPO / "benchmarks" / "ab_commits.py"), tmp_path / "ab"
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    prep = subprocess.run([sys.executable, script, "prepare", "--dir", str(trees), "HEAD", head], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr[-2000:]
    manifest = json.loads((trees / "trees.json").read_text())
    assert [t["commit"] for t in manifest] == [head]
    tree = trees / head / "benchmarks"
    assert (tree / "train_throughput.py").is_file() and not (tree / "results").exists()
    bad = subprocess.run([sys.executable, script, "prepare", "--dir", str(trees), "no-such-rev"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "'no-such-rev' names no commit" in bad.stderr
    # relative folders, as a GPU machine's command line gives them
    go = subprocess.run([sys.executable, script, "run", "--dir", "ab", "--out", "out",
                         "--rounds", "2", "--", "--flavor", "debug", "--seq", "64", "--batch", "2", "--variants", "ours",
                         "--warmup", "1", "--steps", "1", "--profile", "none"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600, env={**os.environ, "BENCH_RUNS": str(tmp_path / "runs")})
    assert go.returncode == 0, go.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "ab_commits.json").read_text())["rows"]
    assert [(r["commit"], r["round"], r["variant"]) for r in rows] == [(head, 1, "ours"), (head, 2, "ours")], rows
    assert all(r["ms_per_step"] > 0 for r in rows)
    row = json.loads((tmp_path / "out" / head / "round1" / "train_throughput.json").read_text())["env"]
    assert row["commit"] == head  # BENCH_COMMIT, not whatever repository the run finds
    assert f"| {head} | ours | B2 T64 | 2 |" in (tmp_path / "out" / "ab_commits.md").read_text()


def test_ab_commits_summary_compares_medians_with_the_first_commit():
    sys.path.insert(0, str(REPO))
    from benchmarks.ab_commits import summary

    def row(commit, ms, variant="ours-recipe"):
        return {"commit": commit, "round": 1, "variant": variant, "seq": 4096, "batch": 8, "ms_per_step": ms}

    rows = [row("aaa", 157.4), row("aaa", 157.8), row("bbb", 154.6), row("bbb", 155.0), row("bbb", 154.2),
            {"commit": "ccc", "round": 1, "error": "exit 1, no rows"}]
    table = summary(rows, ["aaa", "bbb", "ccc"])
    assert "| aaa | ours-recipe | B8 T4096 | 2 | 157.6 | 157.4 | 157.8 | — |" in table
    assert "| bbb | ours-recipe | B8 T4096 | 3 | 154.6 | 154.2 | 155.0 | -3.0 ms |" in table
    assert "- ccc round 1: run failed: exit 1, no rows" in table


def test_fused_ce_launch_probes_check_every_launch_and_write_their_tables(tmp_path, monkeypatch, capsys):
    """benchmarks/fused_ce.py's --rows-launch and --one-pass probes on a small chunk in Triton's interpreter, with a
    stand-in timer: every launch's loss and gradient pass the probe's checks against the reference launch, and each
    probe appends its table and names its fastest launch in the form train_throughput's --rows-launch takes."""
    sys.path.insert(0, str(REPO))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import torch
    import triton.testing

    from benchmarks import fused_ce

    # NOTE: a launch's timed function is named run, the chunk's copy (subtracted from it) is a lambda.
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: (fn(), 1.5 if fn.__name__ == "run" else 1.0)[1])
    small = {"per row": fused_ce.RowsLaunch(32), "one per SM": fused_ce.RowsLaunch(32, 4, 1, False, True)}
    monkeypatch.setattr(fused_ce, "L2_LAUNCHES", {"two per SM, backwards": fused_ce.RowsLaunch(32, 4, 2, True)})
    monkeypatch.setattr(fused_ce, "ONE_PASS_LAUNCHES", small)
    monkeypatch.setattr(fused_ce.ce_rows_module, "LAUNCH", fused_ce.RowsLaunch(32, 4, 1, True, True, True))
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 77, generator=gen) * 3
    targets = torch.randint(0, 77, (9,), generator=gen)
    targets[4] = fused_ce.IGNORE
    out = tmp_path / "fused_ce.md"
    fused_ce.rows_launch_probe(logits, targets, str(out))
    fused_ce.one_pass_probe(logits, targets, torch.randn(9, 8, generator=gen), str(out))
    text = out.read_text()
    assert "`benchmarks/fused_ce.py --rows-launch`" in text and "`benchmarks/fused_ce.py --one-pass`" in text
    assert text.count("| 0.500 / 0.500 |") == 2 + 3, text  # every launch timed twice by the stand-in
    from benchmarks.train_throughput import rows_launch

    fastest = [line.split(": ")[1] for line in capsys.readouterr().out.splitlines() if line.startswith("fastest launch")]
    assert len(fastest) == 2 and all(isinstance(rows_launch(spec), fused_ce.RowsLaunch) for spec in fastest)
