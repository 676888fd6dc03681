"""`[profiling]`: the timeline arithmetic by hand, and the trainer writing a profile of the chosen updates."""

import gzip
import json

import pytest

from titan_k3.config import load_job_config
from titan_k3.config.manager import ConfigError
from types import SimpleNamespace

from torch.autograd import DeviceType

from titan_k3.metrics.profile import (_gpu_kernels, exposed_length, gpu_time_by_scope, kernel_kind, kernel_tables,
                                      kernels_by_name, launch_scope, timeline, union_length)
from titan_k3.train import main


def test_union_counts_overlaps_once():
    assert union_length([]) == 0
    assert union_length([(0, 10), (5, 15), (20, 25)]) == 20
    assert union_length([(5, 15), (0, 10), (6, 7)]) == 15  # unsorted, nested


def test_exposed_communication_is_what_no_compute_covers():
    comm = [(0, 10), (30, 40)]
    compute = [(5, 35)]
    assert exposed_length(comm, compute) == 5 + 5
    assert exposed_length(comm, [(0, 50)]) == 0


def test_timeline_shares_of_the_wall():
    kernels = [("ncclDevKernel_AllGather_RING_LL", 0, 10), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN", 5, 20),
               ("_dintra_kernel", 40, 50)]
    shares = timeline(kernels, wall=100)
    assert shares["busy"] == pytest.approx(0.30) and shares["idle"] == pytest.approx(0.70)
    assert shares["compute"] == pytest.approx(0.25)
    assert shares["communication"] == pytest.approx(0.10)
    assert shares["exposed communication"] == pytest.approx(0.05)


def test_gpu_annotations_are_not_kernels():
    """A record_function range mirrored on the GPU spans its kernels and the gaps: neither busy time nor a kernel."""
    def event(name, start, end, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    prof = SimpleNamespace(events=lambda: [
        event("muon.orthogonalise", 0, 100, annotation=True), event("nvjet_tst_a", 0, 10), event("nvjet_tst_b", 90, 100),
        event("aten::mm", 0, 5, device=DeviceType.CPU), event("empty", 7, 7),
    ])
    kernels = _gpu_kernels(prof)
    assert [k[0] for k in kernels] == ["nvjet_tst_a", "nvjet_tst_b"]
    assert timeline(kernels, wall=100)["busy"] == pytest.approx(0.20)


def test_kernels_by_name_sum_calls_and_time():
    kernels = [("add", 0, 2), ("gemm", 2, 12), ("add", 12, 15)]
    assert kernels_by_name(kernels) == [("gemm", 1, 10.0), ("add", 2, 5.0)]


def _op(name, parent=None, kernels=()):
    return SimpleNamespace(name=name, cpu_parent=parent, device_type=DeviceType.CPU,
                           kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels])


def test_kernels_are_charged_to_the_innermost_scope_that_launched_them():
    """An add inside a mix's backward node belongs to that node; inside a compiled graph to the graph (whatever its
    hash); a bare top-level op to itself; a CUDA-graph replay's kernels to no op."""
    node = _op("autograd::engine::evaluate_function: MixBackward")
    add = _op("aten::add_", parent=node, kernels=[("add_kernel", 25.0)])
    graph = _op("## Call CompiledFxGraph f2ha7e64vsipdu5", parent=_op("CompiledFunction"))
    fused = _op("triton_poi_fused_0", parent=graph, kernels=[("triton_poi_fused_0", 10.0)])
    ns = _op("aten::baddbmm", parent=_op("muon.orthogonalise", parent=_op("Optimizer.step#PerHeadMuon.step")),
             kernels=[("nvjet", 7.0), ("nvjet", 3.0)])
    top = _op("aten::copy_", kernels=[("copy_kernel", 1.0)])
    idle = _op("aten::view", parent=node)
    assert launch_scope(add) == "MixBackward" and launch_scope(fused) == "compiled graph"
    assert launch_scope(ns) == "muon.orthogonalise" and launch_scope(top) == "aten::copy_"
    device = SimpleNamespace(name="add_kernel", device_type=DeviceType.CUDA, kernels=[])
    rows = gpu_time_by_scope([add, fused, ns, top, idle, device])
    assert rows == [("MixBackward", "add_kernel", 1, 25.0), ("compiled graph", "triton_poi_fused_0", 1, 10.0),
                    ("muon.orthogonalise", "nvjet", 2, 10.0), ("aten::copy_", "copy_kernel", 1, 1.0)]
    # 50 us of kernels ran, 46 launched by an op: 4 us came from a graph replay.
    lines = kernel_tables([("add_kernel", 0, 25), ("graph_kernel", 25, 29), ("triton_poi_fused_0", 29, 39),
                           ("nvjet", 39, 49), ("copy_kernel", 49, 50)], [add, fused, ns, top], rows=2)
    text = "\n".join(lines)
    assert "5 names, the first 2" in text and "0.015 ms in the other 3 names" in text
    assert "0.046 ms launched by an op, 0.004 ms from CUDA graph replays" in text


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "communication"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
    ("nvjet_tst_256x128_64x4_2x1_v_bz_TNN", "matmul"),
    ("triton_poi_fused_add_mul_0", "triton"),
    ("_dchunk_kernel", "triton"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
])
def test_kernel_kinds(name, kind):
    assert kernel_kind(name) == kind


def test_trainer_profiles_the_chosen_updates(tmp_path):
    assert main(["--model.flavor", "debug", "--training.seq_len", "64", "--training.steps", "4",
                 "--lr_scheduler.warmup_steps", "1", "--profiling.enable", "true", "--profiling.start_step", "2",
                 "--profiling.steps", "2", "--job.dump_folder", str(tmp_path), "--job.name", "p"]) == 0
    run = tmp_path / "p"
    summary = (run / "profile-rank0.txt").read_text()
    assert summary.startswith("rank 0, updates 2-3 (2)")
    assert "aten::mm" in summary and "muon.orthogonalise" in summary  # the model's matmuls and the optimizer range
    trace = json.loads(gzip.open(run / "trace-rank0.json.gz").read())
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "profile"] == [3]


def test_profiling_window_must_end_within_the_run():
    with pytest.raises(ConfigError, match="profiling updates 9-10 must end by training.steps = 5"):
        load_job_config(["--training.steps", "5", "--profiling.enable", "true", "--profiling.start_step", "9",
                         "--profiling.steps", "2"])


def test_a_failing_profile_summary_is_loud_and_does_not_end_the_run(tmp_path, monkeypatch, capsys):
    import titan_k3.metrics.profile as profile

    def broken(*_args, **_kwargs):
        raise RuntimeError("no kernels table")

    monkeypatch.setattr(profile, "profile_report", broken)
    assert main(["--model.flavor", "debug", "--training.seq_len", "64", "--training.steps", "3",
                 "--lr_scheduler.warmup_steps", "1", "--profiling.enable", "true", "--profiling.start_step", "2",
                 "--job.dump_folder", str(tmp_path), "--job.name", "p"]) == 0
    assert "writing the profile failed: RuntimeError: no kernels table" in capsys.readouterr().out
    events = [json.loads(line) for line in (tmp_path / "p" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "profile_failed"] == [2]
    last = json.loads((tmp_path / "p" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3  # the run went on to its last update
