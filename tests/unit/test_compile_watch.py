"""Compile reporting: graph breaks reach the event log, and dynamo never silently runs a block eager."""

import json

import torch
import torch._dynamo
import torch._dynamo.config as dynamo_config
from torch import nn

from titan_k3.metrics.events import EventLog
from titan_k3.parallel.distributed import CompileWatch
from titan_k3.parallel.parallelize import apply_compile


def test_graph_breaks_and_compiled_frames_are_reported_once_per_change(tmp_path):
    torch._dynamo.reset()
    events = EventLog(tmp_path / "events.jsonl")
    watch = CompileWatch(events)

    @torch.compile(backend="eager")
    def with_break(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    with_break(torch.ones(3))
    watch.check(step=1)
    watch.check(step=2)  # nothing changed: no second event
    reports = [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())
               if e["kind"] == "compile"]
    assert len(reports) == 1
    assert reports[0]["graph_breaks"] >= 1 and reports[0]["frames_compiled"] >= 2  # the code after the break is a frame too
    assert "graph breaks" in reports[0]["message"]


class _Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(n)})


def test_compile_covers_every_block_and_refuses_a_silent_eager_fallback(monkeypatch):
    monkeypatch.setattr(dynamo_config, "recompile_limit", 8)
    monkeypatch.setattr(dynamo_config, "fail_on_recompile_limit_hit", False)
    model = _Blocks(12)
    apply_compile(model, "eager")
    assert dynamo_config.recompile_limit >= 2 * 12 + 8
    assert dynamo_config.fail_on_recompile_limit_hit
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in model.layers.values())
