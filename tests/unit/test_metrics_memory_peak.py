"""The memory-peak report: the allocator's trace replayed to its peak, the blocks alive then grouped by stack."""

from titan_k3.metrics.memory_peak import REPO, peak_report, replay_to_peak, repo_frame

MIB = 2**20


def frame(path, line, name):
    return {"filename": str(path), "line": line, "name": name}


LOSS = frame(REPO / "kernels/fused_ce/ops.py", 10, "fused_loss")
LAYER = frame(REPO / "titan_k3/models/k3/moe.py", 20, "forward")
TORCH = frame("/usr/lib/python3/site-packages/torch/nn/modules/module.py", 5, "_call_impl")


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr, size, completed=True):
    return {"action": "free_completed" if completed else "free_requested", "addr": addr, "size": size}


def test_replay_finds_the_peak_and_the_blocks_alive_at_it():
    trace = [
        alloc(1, 10 * MIB, TORCH, LAYER),
        alloc(2, 30 * MIB, LOSS),
        free(2, 30 * MIB, completed=False),  # requested only: still allocated
        alloc(3, 5 * MIB, LAYER),  # 100 + 10 + 30 + 5 = 145: the peak
        free(2, 30 * MIB),
        free(99, 50 * MIB),  # a block from before the trace: lowers the count, never in the live set
        alloc(4, 40 * MIB, LOSS),  # 100 + 10 + 5 + 40 - 50 = 105
    ]
    peak, index, live = replay_to_peak(trace, 100 * MIB)
    assert peak == 145 * MIB and index == 3
    assert sorted(live) == [1, 2, 3]


def test_a_trace_that_never_passes_the_baseline_has_no_peak_allocation():
    peak, index, live = replay_to_peak([free(7, MIB), alloc(1, MIB)], 10 * MIB)
    assert (peak, index, live) == (10 * MIB, -1, {})


def test_a_peak_at_the_end_of_the_trace_keeps_its_blocks():
    peak, index, live = replay_to_peak([alloc(1, MIB), free(1, MIB), alloc(2, 3 * MIB), alloc(3, MIB)], 0)
    assert (peak, index, sorted(live)) == (4 * MIB, 3, [2, 3])


def test_repo_frame_is_the_innermost_frame_in_the_repository():
    assert repo_frame([TORCH, LAYER, LOSS]) == "titan_k3/models/k3/moe.py:20 forward"
    assert repo_frame([TORCH]) == "(outside the repository)"
    assert repo_frame([]) == "(outside the repository)"


def test_report_groups_the_peak_by_repository_frame_largest_first():
    trace = [alloc(1, 10 * MIB, TORCH, LAYER), alloc(2, 30 * MIB, LOSS), alloc(3, 5 * MIB, LAYER), free(2, 30 * MIB)]
    text = peak_report({"device_traces": [trace]}, 2**30, "demo")
    assert "Peak 1.044 GiB allocated: 0.044 GiB in 3 blocks" in text
    by_repo = text.split("By the innermost frame in the repository:")[1].split("By the innermost frame (")[0]
    rows = [line for line in by_repo.splitlines() if line.startswith("| 0.")]
    assert rows[0].endswith("kernels/fused_ce/ops.py:10 fused_loss |") and "| 1 | 30.0 |" in rows[0]
    assert rows[1].endswith("titan_k3/models/k3/moe.py:20 forward |") and "| 2 | 10.0 |" in rows[1]
    # the allocation that reached the peak, with its stack
    assert "The allocation that reached it (5.0 MiB)" in text and "moe.py:20 forward" in text.split("```")[1]


def test_a_trace_at_its_limit_says_it_undercounts(monkeypatch):
    import titan_k3.metrics.memory_peak as mp

    monkeypatch.setattr(mp, "MAX_ENTRIES", 3)
    text = peak_report({"device_traces": [[alloc(1, MIB), alloc(2, MIB), alloc(3, MIB)]]}, 0, "full")
    assert "reached its limit of 3 events" in text
    assert "limit" not in peak_report({"device_traces": [[alloc(1, MIB)]]}, 0, "short")


def test_report_reads_the_device_it_is_given():
    traces = {"device_traces": [[alloc(1, MIB)], [alloc(1, 7 * MIB, LOSS)]]}
    assert "Peak 0.007 GiB allocated" in peak_report(traces, 0, "rank 1", device=1)


def test_report_without_a_trace_says_so():
    text = peak_report({"device_traces": []}, 3 * 2**30, "empty")
    assert "Peak 3.000 GiB allocated: 0.000 GiB in 0 blocks" in text and "Trace: 0 events" in text


def test_memory_peak_updates_is_checked_before_any_work():
    import pytest

    from titan_k3.config import ConfigError, load_job_config
    from titan_k3.train import Trainer

    with pytest.raises(ConfigError, match="'profiling.memory_peak_updates' = 9: must be at most training.steps = 5"):
        load_job_config(["--training.steps", "5", "--profiling.memory_peak_updates", "9"])
    with pytest.raises(ConfigError, match="'profiling.memory_peak_updates' = -1: must be >= 0"):
        load_job_config(["--profiling.memory_peak_updates", "-1"])
    cfg = load_job_config(["--model.flavor", "debug", "--training.steps", "2", "--profiling.memory_peak_updates", "1"])
    with pytest.raises(ConfigError, match="'profiling.memory_peak_updates' = 1: the allocator's trace needs a CUDA "
                                          "device; this run is on cpu"):
        Trainer(cfg)


class Events:
    def __init__(self):
        self.seen = []

    def emit(self, kind, message, step=None):
        self.seen.append((kind, step, message))


def fake_trace(monkeypatch, snapshot):
    """The allocator's trace calls stood in for: `started` / `stopped` count them, `_snapshot` returns `snapshot`."""
    import torch

    import titan_k3.metrics.memory_peak as mp

    calls = {"started": 0, "stopped": 0}
    monkeypatch.setattr(mp, "start_recording",
                        lambda device: (calls.__setitem__("started", calls["started"] + 1), 5 * MIB)[1])
    monkeypatch.setattr(mp, "stop_recording", lambda: calls.__setitem__("stopped", calls["stopped"] + 1))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)
    return calls


def test_the_recorder_writes_the_report_after_its_last_update_and_stops(tmp_path, monkeypatch):
    import torch

    from titan_k3.metrics.memory_peak import PeakRecorder

    calls = fake_trace(monkeypatch, lambda: {"device_traces": [[alloc(1, 3 * MIB, LOSS)]]})
    assert PeakRecorder(0, torch.device("cpu")).after(1, tmp_path, 0) is None and calls["started"] == 0  # off
    recorder, events = PeakRecorder(2, torch.device("cuda", 0)), Events()
    assert calls == {"started": 1, "stopped": 0}
    assert recorder.after(1, tmp_path, 3, events) is None and events.seen == []
    path = recorder.after(2, tmp_path, 3, events)
    assert path == tmp_path / "memory-peak-rank3.md" and calls["stopped"] == 1
    text = path.read_text()
    assert text.startswith("# rank 3, the model's build and updates 1-2: what is allocated at the peak")
    assert "Peak 0.008 GiB allocated" in text and "kernels/fused_ce/ops.py:10 fused_loss" in text
    assert [(kind, step) for kind, step, _ in events.seen] == [("memory_peak", 2)]
    assert recorder.after(2, tmp_path, 3, events) is None  # once


def test_a_failing_report_is_loud_stops_the_trace_and_does_not_raise(tmp_path, monkeypatch, capsys):
    import torch

    from titan_k3.metrics.memory_peak import PeakRecorder

    def broken():
        raise RuntimeError("no snapshot")

    calls = fake_trace(monkeypatch, broken)
    events = Events()
    assert PeakRecorder(1, torch.device("cuda", 0)).after(1, tmp_path, 0, events) is None
    assert calls["stopped"] == 1 and not (tmp_path / "memory-peak-rank0.md").exists()
    assert "writing the memory-peak report failed: RuntimeError: no snapshot" in capsys.readouterr().out
    assert [(kind, step) for kind, step, _ in events.seen] == [("memory_peak_failed", 1)]
