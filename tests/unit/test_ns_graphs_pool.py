"""NewtonSchulzGraphs.join (compile.cuda_graph_share_pool): when the Newton-Schulz groups run eagerly, when they
capture, into which pool and on which stream, and what a host captured again does. CUDA graphs are stood in for by
a recording fake: the numbers of a real capture are checked on the GPU (tests/gpu/test_step_graph_gpu.py)."""

import contextlib

import pytest
import torch

from titan_k3.optim.ns_graphs import NewtonSchulzGraphs


class FakeGraph:
    """Records capture_begin's pool; its pool() is that pool (or a fresh one); replay counts."""

    made = []

    def __init__(self):
        self.begun_with, self.replays = "not begun", 0
        FakeGraph.made.append(self)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.begun_with = pool

    def capture_end(self):
        """Nothing to close: the stand-in records only the pool it was begun with."""

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


def test_inputs_are_temporaries_until_the_host_is_captured_and_persistent_otherwise(fake_cuda):
    """Joined to a host not yet captured, every run is eager: an input held from those updates would still be
    allocated during the host's capture (the update's peak), so none is held. Without a host, or once it is
    captured, a group's graph reads its input: one buffer for the group's life."""
    cpu = torch.device("cpu")
    host = {"now": None}
    joined = NewtonSchulzGraphs()
    joined.join(lambda: host["now"])
    first = joined.input("g", (2, 3), torch.float32, cpu)
    assert joined.input("g", (2, 3), torch.float32, cpu) is not first and not joined._inputs
    host["now"] = (("step pool", 1), "step stream")
    held = joined.input("g", (2, 3), torch.float32, cpu)
    assert joined.input("g", (2, 3), torch.float32, cpu) is held and joined._inputs
    alone = NewtonSchulzGraphs()
    mine = alone.input("g", (2, 3), torch.float32, cpu)
    assert alone.input("g", (2, 3), torch.float32, cpu) is mine
    assert alone.input("g", (4, 3), torch.float32, cpu) is not mine  # a new shape: a new buffer (and graph)


def _group(seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [torch.randn(2, 8, 12, generator=gen), torch.randn(3, 8, 12, generator=gen)]
    bufs = [torch.randn(2, 8, 12, generator=gen), torch.randn(3, 8, 12, generator=gen)]
    return grads, bufs


def _by_hand(grads, bufs, skip, scale):
    """The unfused path: the momentum pass into a stacked input, then the Newton-Schulz of the stack."""
    from kernels.muon import nesterov_momentum_multi_
    from titan_k3.optim.orthogonalise import orthogonalise_stacked

    stacked = torch.empty(5, 8, 12)
    nesterov_momentum_multi_(grads, bufs, stacked, 0.95, True, skip_if=skip, grad_scale=scale)
    return orthogonalise_stacked(stacked, 5, torch.float32)


def test_joined_groups_run_their_momentum_pass_in_the_graph_with_the_same_numbers(fake_cuda):
    """compile.cuda_graph_share_pool: the momentum pass goes into each group's graph (its stacked input becomes a
    temporary of the pool); its warm-up and its capture give the unfused path's update and buffers."""
    host = {"now": None}
    graphs = NewtonSchulzGraphs()
    graphs.join(lambda: host["now"])
    graphs.input("g", (5, 8, 12), torch.float32, torch.device("cpu"))  # an eager update's input, before the host
    assert not graphs.joined() and not graphs._inputs  # a temporary (test below)
    host["now"] = (("step pool", 1), "step stream")
    assert graphs.joined()
    grads, bufs = _group(0)
    ref_grads, ref_bufs = _group(0)
    scale = torch.tensor([0.5])
    for update in range(2):  # the warm-up (eager), then the capture (the stand-in runs it once, as a first replay)
        skip = torch.tensor(0)
        flags = graphs.step_flags(skip, scale)
        out = graphs.momentum_orthogonalise("g", grads, bufs, (5, 8, 12), 0.95, True, 5, torch.float32, flags)
        ref = _by_hand(ref_grads, ref_bufs, skip, scale)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for b, r in zip(bufs, ref_bufs):
            torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-6)
    assert [g.begun_with for g in FakeGraph.made] == [("step pool", 1)]
    assert not graphs._inputs  # the held input buffers went with the first joined run: the saving
    table = graphs._fused[("momentum", "g", True, True)][0]
    my_skip, my_scale = flags
    step = graphs.step_flags(torch.tensor(1), torch.tensor([0.25]))
    graphs.momentum_orthogonalise("g", grads, bufs, (5, 8, 12), 0.95, True, 5, torch.float32, step)
    assert FakeGraph.made[0].replays == 2  # replayed, not captured again
    assert step[0] is my_skip and step[1] is my_scale  # one pair of flag tensors for every step and group
    assert my_skip.item() == 1 and my_scale.item() == 0.25  # the graph reads the step's flags from its own tensors
    assert graphs._fused[("momentum", "g", True, True)][0] is table  # one table for the group's life


def test_a_joined_group_whose_tensors_moved_is_captured_again_never_replayed_on_stale_memory(fake_cuda):
    graphs = NewtonSchulzGraphs()
    graphs.join(lambda: (("step pool", 1), "step stream"))
    grads, bufs = _group(1)
    call = lambda g, b: graphs.momentum_orthogonalise("g", g, b, (5, 8, 12), 0.95, True, 5, torch.float32,  # noqa: E731
                                                      (None, None))
    call(grads, bufs)
    call(grads, bufs)
    assert len(FakeGraph.made) == 1
    moved = [b.clone() for b in bufs]  # e.g. the optimizer's state loaded anew: the buffers at other addresses
    call(grads, moved)  # a new group: its warm-up runs eagerly
    assert len(FakeGraph.made) == 1 and FakeGraph.made[0].replays == 1
    call(grads, moved)  # then its capture
    assert len(FakeGraph.made) == 2
