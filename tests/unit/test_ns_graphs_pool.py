"""NewtonSchulzGraphs.join (compile.cuda_graph_share_pool): when the Newton-Schulz groups run eagerly, when they
capture, into which pool and on which stream, and what a host captured again does. CUDA graphs are stood in for by
a recording fake: the numbers of a real capture are checked on the GPU (tests/gpu/test_step_graph_gpu.py)."""

import contextlib

import pytest
import torch

from titan_k3.optim.muon import NewtonSchulzGraphs


class FakeGraph:
    """Records capture_begin's pool; its pool() is that pool (or a fresh one); replay counts."""

    made = []

    def __init__(self):
        self.begun_with, self.replays = "not begun", 0
        FakeGraph.made.append(self)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.begun_with = pool

    def capture_end(self):
        pass

    def pool(self):
        return self.begun_with if self.begun_with is not None else ("own", id(self))

    def replay(self):
        self.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeGraph.made = []
    streams = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "new stream")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: (streams.append(s), contextlib.nullcontext())[1])
    return streams


def test_groups_run_eagerly_until_the_host_is_captured_then_capture_into_its_pool_on_its_stream(fake_cuda):
    host = {"now": None}
    graphs = NewtonSchulzGraphs()
    graphs.join(lambda: host["now"])
    calls = []
    ns = lambda: (calls.append(1), torch.ones(2))[1]  # noqa: E731
    for _ in range(3):  # the update's graph is not captured yet: eager every time, nothing captured
        assert torch.equal(graphs.run("experts", ns), torch.ones(2))
    assert len(calls) == 3 and FakeGraph.made == [] and fake_cuda == []
    host["now"] = (("step pool", 1), "step stream")
    graphs.run("experts", ns)  # warm already (the eager runs): captured now, into the host's pool, on its stream
    graphs.run("dense", ns)    # a group first seen after the host's capture: its own warm-up, then its capture
    graphs.run("dense", ns)
    assert [g.begun_with for g in FakeGraph.made] == [("step pool", 1), ("step pool", 1)]
    assert fake_cuda == ["step stream", "step stream"]
    graphs.run("experts", ns)
    assert FakeGraph.made[0].replays == 2  # the capture's own replay, then this one
    assert len(calls) == 3 + 1 + 2  # eager: three before the host, the capture passes, dense's warm-up


def test_a_host_captured_again_drops_the_groups_and_they_join_its_new_pool(fake_cuda):
    host = {"now": (("pool", 1), "stream A")}
    graphs = NewtonSchulzGraphs()
    graphs.join(lambda: host["now"])
    ns = lambda: torch.zeros(1)  # noqa: E731
    graphs.run("g", ns)  # warm-up
    graphs.run("g", ns)  # captured into pool 1
    host["now"] = (("pool", 2), "stream B")  # e.g. a context-length stage: the update's graph captured again
    graphs.run("g", ns)
    assert [g.begun_with for g in FakeGraph.made] == [("pool", 1), ("pool", 2)]
    assert fake_cuda == ["stream A", "stream B"]
    graphs.run("g", ns)
    assert FakeGraph.made[1].replays == 2 and FakeGraph.made[0].replays == 1


def test_without_a_host_the_groups_share_a_pool_of_their_own(fake_cuda):
    graphs = NewtonSchulzGraphs()
    ns = lambda: torch.zeros(1)  # noqa: E731
    for key in ("a", "a", "b", "b"):
        graphs.run(key, ns)
    first, second = FakeGraph.made
    assert first.begun_with is None and second.begun_with == ("own", id(first))
    assert fake_cuda == ["new stream", "new stream"]
