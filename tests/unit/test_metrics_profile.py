"""`[profiling]`: the timeline arithmetic by hand, and the trainer writing a profile of the chosen updates."""

import gzip
import json

import pytest

from titan_k3.config import load_job_config
from titan_k3.config.manager import ConfigError
from types import SimpleNamespace

from torch.autograd import DeviceType

from titan_k3.metrics.profile import (NO_HOST, gpu_kernels, exposed_length, gap_buckets, gap_report, gpu_time_by_scope,
                                      host_context, idle_gaps, kernel_kind, kernel_tables, kernels_by_name,
                                      largest_gaps, launch_scope, profile_report, timeline, union_length)
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
    kernels = gpu_kernels(prof)
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


def test_overlapping_kernels_on_two_streams_leave_no_gap():
    """A long kernel on one stream covers the short ones and the spaces between them on another."""
    assert idle_gaps([("long", 0, 100), ("a", 10, 20), ("b", 30, 40), ("c", 90, 110)]) == []
    assert idle_gaps([("a", 0, 10), ("b", 10, 20)]) == []  # back to back: no gap
    assert idle_gaps([]) == [] and idle_gaps([("a", 0, 10)]) == []


def test_gaps_are_the_complement_of_the_kernels_union():
    """The kernel before a gap is the one whose end opens it, even when another stream's kernel started later."""
    kernels = [("c", 50, 60), ("long", 0, 30), ("short", 5, 10), ("b", 32.5, 40), ("d", 60, 70), ("e", 71, 72)]
    assert idle_gaps(kernels) == [(30, 32.5, "long", "b"), (40, 50, "b", "c"), (70, 71, "d", "e")]
    gaps = idle_gaps(kernels)
    assert sum(e - s for s, e, *_ in gaps) == pytest.approx(72 - union_length([(s, e) for _, s, e in kernels]))


def test_gap_buckets_split_at_5_20_100_us_and_1_ms():
    lengths = [0.5, 4.999, 5, 19.9, 20, 99.9, 100, 999, 1000, 2500]
    gaps = [(0, x, "a", "b") for x in lengths]
    assert gap_buckets(gaps) == [("< 5 us", 2, pytest.approx(5.499)), ("5-20 us", 2, pytest.approx(24.9)),
                                 ("20-100 us", 2, pytest.approx(119.9)), ("100 us-1 ms", 2, pytest.approx(1099)),
                                 (">= 1 ms", 2, pytest.approx(3500))]
    assert [c for _, c, _ in gap_buckets([])] == [0] * 5


def test_largest_gaps_come_first_and_are_limited_to_n():
    gaps = [(0, 3, "a", "b"), (10, 30, "b", "c"), (40, 41, "c", "d"), (50, 70, "d", "e"), (80, 90, "e", "f")]
    assert largest_gaps(gaps, n=3) == [(10, 30, "b", "c"), (50, 70, "d", "e"), (80, 90, "e", "f")]
    assert len(largest_gaps(gaps * 10)) == 15


def test_host_context_is_the_innermost_host_event_over_the_gap():
    """The op launching inside an optimizer range names the gap, not the range; a gap no host event covers says so;
    a short event on another thread beats the main thread's long wait."""
    host = [("Optimizer.step#PerHeadMuon.step", 0, 100), ("aten::copy_", 20, 40), ("cudaMemcpyAsync", 25, 35),
            ("torch::autograd::backward", 200, 400), ("cudaLaunchKernel", 290, 310),
            ("cudaDeviceSynchronize", 500, 520)]
    gaps = [(28, 32, "a", "b"), (50, 60, "b", "c"), (150, 160, "c", "d"), (295, 305, "d", "e"), (510, 511, "e", "f")]
    assert host_context(gaps, host) == ["cudaMemcpyAsync", "Optimizer.step#PerHeadMuon.step", NO_HOST,
                                        "cudaLaunchKernel", "cudaDeviceSynchronize"]
    assert host_context(gaps[:1], []) == [NO_HOST]


def _gap_trace():
    """Kernels (us): 0-10, 12-20 and 520-600 on one stream, 15-30 on another (busy 108 of a 600 us span); host
    events around them."""
    kernels = [("nvjet_tst_a", 0, 10), ("triton_poi_fused_0", 12, 20), ("ncclDevKernel_AllGather", 15, 30),
               ("void at::native::vectorized_elementwise_kernel<4>", 520, 600)]
    host = [("ProfilerStep", -300, 700), ("aten::mm", -100, 5), ("cudaDeviceSynchronize", 100, 650)]
    return kernels, host


def test_gap_report_lists_sizes_and_the_largest_gaps():
    kernels, host = _gap_trace()
    text = "\n".join(gap_report(kernels, host, wall=1000, largest=1))
    assert ("GPU idle gaps: 0.892 ms idle of 1.000 ms wall: 0.492 ms in 2 gaps between kernels, 0.400 ms before the "
            "first kernel and after the last together (host events begin 0.300 ms before the first kernel, end "
            "0.100 ms after the last)") in text
    assert "  < 5 us             1      0.002" in text and "  100 us-1 ms        1      0.490" in text
    assert "The 1 largest gaps" in text and "triton_poi_fused_0" not in text.split("largest gaps")[1]
    assert "      0.030 ms     490.0 us  ncclDevKernel_AllGather" in text
    assert "-> void at::native::vectorized_elementwise_kernel<4>" in text and "host: cudaDeviceSynchronize" in text
    assert gap_report([], host, wall=1000) == ["", "GPU idle gaps: no kernels"]


def test_profile_report_has_the_idle_gaps_section(monkeypatch):
    """The report on a (faked) GPU run: kernels and host events from the profiler's events, wall time in seconds."""
    import titan_k3.metrics.profile as profile

    class Averages(list):
        def table(self, **_kwargs):
            return "(table)"

    def event(name, start, end, device):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=False, kernels=[], cpu_parent=None,
                               time_range=SimpleNamespace(start=start, end=end))

    kernels, host = _gap_trace()
    events = [event(*k, DeviceType.CUDA) for k in kernels] + [event(*h, DeviceType.CPU) for h in host]
    averages = Averages([SimpleNamespace(key="aten::mm", count=1, self_device_time_total=10.0, device_time_total=10.0,
                                         cpu_time_total=105.0)])
    prof = SimpleNamespace(events=lambda: events, key_averages=lambda: averages)
    monkeypatch.setattr(profile.torch.cuda, "is_available", lambda: True)
    text = profile_report(prof, wall_s=1e-3, title="faked")
    assert "GPU timeline over 1.0 ms of wall time: busy 10.8%, idle 89.2%" in text
    assert "GPU idle gaps: 0.892 ms idle of 1.000 ms wall: 0.492 ms in 2 gaps" in text
    assert "The 2 largest gaps" in text and "host: cudaDeviceSynchronize" in text and "host: ProfilerStep" in text


def test_operators_by_shape_ranks_each_shape_of_an_op_apart():
    """One op at two shapes is two rows, costliest first; ops without shapes or time, and annotations, are left out."""
    from titan_k3.metrics.profile import operators_by_shape

    def op(key, shapes, gpu_us, cpu_us=1.0):
        return SimpleNamespace(key=key, input_shapes=shapes, count=3, self_device_time_total=gpu_us,
                               self_cpu_time_total=cpu_us)

    events = [op("aten::sum", [[8192, 512]], 57.0), op("aten::sum", [[512, 8192]], 24.0),
              op("aten::add", [], 90.0), op("muon.orthogonalise", [[1]], 500.0), op("aten::mul", [[4]], 0.0)]
    lines = operators_by_shape(events, on_gpu=True)
    assert lines[1] == "Operators by input shapes (self GPU time):" and len(lines) == 4
    assert "aten::sum  [[8192, 512]]" in lines[2] and lines[2].lstrip().startswith("0.057 ms")
    assert "aten::sum  [[512, 8192]]" in lines[3]
    assert operators_by_shape(events, on_gpu=False)[1].endswith("(self host time):")


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
