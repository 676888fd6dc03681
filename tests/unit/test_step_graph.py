"""compile.cuda_graph on the CPU: the refusals, and the trainer's use of the graph with a stand-in for the capture.

The stand-in has a CUDA graph's semantics where the trainer can see them: the capture records the pass without
changing the model (the buffers it moved are restored), every replay runs it again on the current fixed-shape
inputs and writes into the tensors the capture made (the gradients, the loss). The real capture runs on a GPU in
tests/gpu/test_step_graph_gpu.py.
"""

import contextlib
import json

import pytest
import torch

from titan_k3.config import ConfigError, load_job_config
from titan_k3.models.k3.impl import KernelChoice
from titan_k3.step_graph import StepGraph, check_capturable, max_documents
from titan_k3.train import Trainer

FAST = ["--model.flavor", "debug", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "1"]


@pytest.fixture
def stand_in_capture(monkeypatch):
    """torch.cuda's graph capture replaced as described above; `owner[0]` is the StepGraph being captured."""
    owner, captured_grads = [], []

    class Graph:
        def pool(self):
            return ("stand-in pool", id(self))

        def replay(self):
            sg = owner[0]
            params = list(sg.model.parameters())
            held = [p.grad for p in params]  # a replay changes no Python attribute: put them back after the pass
            for p in params:
                p.grad = None
            loss = sg._run(sg._inputs, sg._normaliser)
            for p, grad in captured_grads:
                grad.copy_(p.grad)
            for p, grad in zip(params, held):
                p.grad = grad
            sg._loss_sum.copy_(loss)

    @contextlib.contextmanager
    def capture(graph, **kwargs):
        assert kwargs == {"stream": "capture stream", "capture_error_mode": "thread_local"}
        buffers = [(b, b.clone()) for b in owner[0].model.buffers()]
        yield
        for b, before in buffers:
            b.copy_(before)
        captured_grads[:] = [(p, p.grad) for p in owner[0].model.parameters() if p.grad is not None]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: "capture stream")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    return owner


def _trainer(tmp_path, name, *extra):
    return Trainer(load_job_config([*FAST, "--job.dump_folder", str(tmp_path), "--job.name", name, *extra]))


def _attach_graph(trainer, owner, **kwargs):
    sg = StepGraph(trainer.model, trainer._forward_backward, trainer.model_spec.graph_inputs, trainer.device,
                   **{"max_documents": 8, "warmup": 2, "emit": trainer.events.emit, **kwargs})
    trainer.step_graph = sg
    owner.append(sg)
    return sg


@pytest.mark.parametrize("accum", [1, 2])
def test_updates_through_the_graph_equal_the_eager_ones(tmp_path, stand_in_capture, accum):
    """Two warm-up updates, the capture, then replays: losses, grad norms and weights as without the graph."""
    flags = ["--training.steps", "5", "--training.grad_accum", str(accum)]
    eager, graphed = _trainer(tmp_path, "eager", *flags), _trainer(tmp_path, "graph", *flags)
    try:
        sg = _attach_graph(graphed, stand_in_capture)
        for update in range(1, 6):
            a, b = eager.train_step(), graphed.train_step()
            eager.step = graphed.step = update  # as train() counts them
            assert sg.captured == (update >= 3)
            assert b.loss == pytest.approx(a.loss, rel=1e-5) and b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5)
        assert sg.captures == 1 and len(sg._inputs) == accum
        for (name, p), q in zip(eager.model.named_parameters(), graphed.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
        for (name, b), c in zip(eager.model.named_buffers(), graphed.model.buffers()):
            torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6, msg=name)  # the routers' biases moved alike
    finally:
        eager.close()
        graphed.close()
    events = [json.loads(x) for x in (tmp_path / "graph" / "events.jsonl").read_text().splitlines()]
    captured = [e for e in events if e["kind"] == "cuda_graph"]
    assert len(captured) == 1 and captured[0]["step"] == 3 and captured[0]["max_documents"] == 8


def test_the_graph_names_its_pool_and_stream_once_captured(tmp_path, stand_in_capture):
    """compile.cuda_graph_share_pool's host: nothing before the capture, then the graph's pool and the stream it was
    captured on (the stream graphs joining the pool must capture on)."""
    trainer = _trainer(tmp_path, "g", "--training.steps", "3")
    try:
        sg = _attach_graph(trainer, stand_in_capture, warmup=1)
        trainer.train_step()
        assert sg.memory_pool() is None
        trainer.train_step()
        assert sg.memory_pool() == (("stand-in pool", id(sg._graph)), "capture stream")
    finally:
        trainer.close()


@pytest.mark.parametrize("share", [True, False])
def test_the_trainer_joins_muons_graphs_to_the_step_graphs_pool_when_asked(tmp_path, share):
    """On a CPU the graph falls back; built as on a GPU, Muon's Newton-Schulz graphs take their pool from it."""
    trainer = _trainer(tmp_path, "g", "--optimizer.ns_cuda_graphs", "true",
                       *(["--compile.cuda_graph", "true", "--compile.cuda_graph_share_pool", "true"] if share else []))
    try:
        assert trainer.step_graph is None
        trainer._graph_choice = KernelChoice("cuda_graph", "on", "on", False)
        graph = trainer._build_step_graph()
        ns_graphs = trainer.optimizers.optimizers["muon"].ns_graphs
        assert (ns_graphs._host == graph.memory_pool) is share
    finally:
        trainer.close()


def test_a_parameter_whose_gradient_is_not_handed_back_does_not_train(tmp_path, stand_in_capture):
    """The check above can fail: after a replay the optimizer reads only the gradients handed back to .grad."""
    trainer = _trainer(tmp_path, "g", "--training.steps", "4")
    try:
        sg = _attach_graph(trainer, stand_in_capture, warmup=1)
        trainer.train_step()
        trainer.train_step()  # captured here
        handed_back = sg._grads
        (first, _), sg._grads = handed_back[0], handed_back[1:]  # the replay still writes it; .grad stays None
        before = [p.detach().clone() for p in trainer.model.parameters()]
        trainer.train_step()
        moved = {id(p) for a, p in zip(before, trainer.model.parameters()) if not torch.equal(a, p)}
        assert id(first) not in moved and len(moved) > len(before) // 2
        sg._grads = handed_back
        trainer.train_step()
        assert not torch.equal(before[0], first)
    finally:
        trainer.close()


def test_a_micro_batch_over_the_capacity_doubles_it_and_captures_again(tmp_path, stand_in_capture):
    """Holding 1 document, the first update (2 rows: 2 documents at least) grows the graph, which then warms up,
    captures and replays as before; updates stay equal to eager ones."""
    flags = ["--training.steps", "8"]
    eager, graphed = _trainer(tmp_path, "eager", *flags), _trainer(tmp_path, "grow", *flags)
    try:
        sg = _attach_graph(graphed, stand_in_capture, max_documents=1, warmup=1)
        for update in range(1, 9):
            a, b = eager.train_step(), graphed.train_step()
            eager.step = graphed.step = update
            assert b.loss == pytest.approx(a.loss, rel=1e-5)
        assert sg._max_documents >= 2 and sg.captured and sg.captures >= 1
    finally:
        eager.close()
        graphed.close()
    events = [json.loads(x) for x in (tmp_path / "grow" / "events.jsonl").read_text().splitlines()]
    grown = [e for e in events if e["kind"] == "cuda_graph" and "now holds" in e["message"]]
    assert grown and grown[0]["step"] == 1 and grown[0]["max_documents"] >= 2
    assert all(later["max_documents"] >= 2 * earlier["max_documents"] for earlier, later in zip(grown, grown[1:]))


def test_a_new_batch_shape_captures_again(tmp_path, stand_in_capture):
    """A context-length stage changes the batch shape: warm-up and capture again, with new fixed-shape inputs."""
    trainer = _trainer(tmp_path, "stage", "--training.steps", "8")
    try:
        sg = _attach_graph(trainer, stand_in_capture, warmup=1)
        trainer.train_step()
        trainer.train_step()
        first_inputs = sg._inputs
        assert sg.captured and sg.captures == 1
        trainer.loader.set_seq_len(128)
        trainer.train_step()
        assert not sg.captured and sg._inputs is not first_inputs and sg._inputs[0][0].shape == (2, 128)
        trainer.train_step()
        assert sg.captured and sg.captures == 2
    finally:
        trainer.close()


def test_the_default_capacity_is_a_document_per_row_and_per_256_tokens():
    assert max_documents(0, 8, 4096) == 136 and max_documents(0, 2, 64) == 2 and max_documents(300, 8, 4096) == 300


@pytest.mark.parametrize("args, message", [
    (["--training.device", "cpu"], "need a CUDA device"),
    (["--kernels.kda", "fla"], "needs our Triton kda kernels"),
    (["--kernels.experts", "grouped_mm"], "needs our Triton experts kernels"),
    (["--kernels.attention", "flex", "--training.compute_dtype", "bfloat16"], "flex attention builds its block mask"),
])
def test_the_config_refuses_what_cannot_be_captured(args, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--compile.cuda_graph", "true", *args])


@pytest.mark.parametrize("args, message", [
    ([], "needs compile.cuda_graph = true"),
    (["--compile.cuda_graph", "true"], "needs optimizer.name = 'muon' and optimizer.ns_cuda_graphs = true"),
    (["--compile.cuda_graph", "true", "--optimizer.name", "adamw", "--optimizer.ns_cuda_graphs", "true"],
     "got 'adamw'"),
])
def test_sharing_the_pool_needs_both_graphs(args, message):
    with pytest.raises(ConfigError, match=message):
        load_job_config(["--compile.cuda_graph_share_pool", "true", *args])
    load_job_config(["--compile.cuda_graph_share_pool", "true", "--compile.cuda_graph", "true",
                     "--optimizer.ns_cuda_graphs", "true"])


@pytest.mark.parametrize("key, value", [("cuda_graph_max_documents", "-1"), ("cuda_graph_warmup", "0")])
def test_graph_counts_are_checked(key, value):
    with pytest.raises(ConfigError, match=f"compile.{key}"):
        load_job_config([f"--compile.{key}", value])


def test_the_trainer_refuses_a_graph_it_cannot_capture_before_any_work():
    cfg = load_job_config(["--compile.cuda_graph", "true"])
    ok = [KernelChoice("kda", "auto", "triton", False), KernelChoice("experts", "auto", "triton", False),
          KernelChoice("attention", "auto", "varlen+cudnn", False)]
    cuda = torch.device("cuda", 0)
    assert check_capturable(cfg, cuda, 1, ok, object()) == KernelChoice("cuda_graph", "on", "on", False,
                                                                          "forward + backward of each update")
    with pytest.raises(ConfigError, match="no fixed-shape inputs"):
        check_capturable(cfg, cuda, 1, ok, None)
    fallen = [KernelChoice("kda", "auto", "torch", True, "no kernel"), *ok[1:]]
    with pytest.raises(ConfigError, match="kernels.kda runs 'torch'"):
        check_capturable(cfg, cuda, 1, fallen, object())
    flex = [*ok[:2], KernelChoice("attention", "auto", "flex", False)]
    with pytest.raises(ConfigError, match="flex attention builds its block mask"):
        check_capturable(cfg, cuda, 1, flex, object())


@pytest.mark.parametrize("device, world, reason", [
    ("cpu", 1, "CUDA graphs need a CUDA device (this run trains on cpu)"),
    ("cuda", 2, "one process only; this run has 2"),
])
def test_a_recipe_asking_for_the_graph_runs_eagerly_where_it_lands_without_one(device, world, reason):
    """A recipe (tomls/pretrain.toml) asks for the graph and still runs under torchrun or on a CPU-only machine:
    the update runs eagerly and the kernel report says so, as a fallback that job.strict refuses."""
    cfg = load_job_config(["--compile.cuda_graph", "true"])
    choice = check_capturable(cfg, torch.device(device), world, [], object())
    assert (choice.op, choice.chosen, choice.fallback) == ("cuda_graph", "off", True)
    assert choice.reason.startswith(reason)


def test_strict_refuses_a_graph_that_falls_back():
    cfg = load_job_config(["--compile.cuda_graph", "true", "--job.strict", "true"])
    with pytest.raises(ConfigError, match="job.strict = true and cuda_graph falls back to 'off': one process only"):
        check_capturable(cfg, torch.device("cuda", 0), 2, [], object())


def test_a_cpu_run_of_a_recipe_that_asks_for_the_graph_trains_eagerly_and_says_so(tmp_path):
    trainer = _trainer(tmp_path, "cpu", "--compile.cuda_graph", "true", "--training.steps", "2")
    try:
        assert trainer.step_graph is None
        assert [c for c in trainer.impl.choices if c.op == "cuda_graph"] == [
            KernelChoice("cuda_graph", "on", "off", True, "CUDA graphs need a CUDA device (this run trains on cpu)")]
        trainer.train()
        kernels = json.loads((tmp_path / "cpu" / "manifest.json").read_text())["kernels"]
        assert {"op": "cuda_graph", "requested": "on", "chosen": "off", "fallback": True,
                "reason": "CUDA graphs need a CUDA device (this run trains on cpu)"} in kernels
    finally:
        trainer.close()


def test_a_graphs_inputs_never_write_into_a_layout_other_batches_share():
    """Found on the H200: the graph's Documents held the KDA chunk layout `build` caches per set of documents, so
    writing the next batch into it changed that cached layout, and a later batch with the first one's documents
    replayed another batch's layout (losses off from the 4th update). The graph's inputs own their tensors."""
    from types import SimpleNamespace

    from titan_k3.models.k3.bundle import k3_graph_inputs
    from titan_k3.models.k3.documents import Documents

    cpu = torch.device("cpu")

    def batch(cu):
        return SimpleNamespace(input_ids=torch.zeros(2, 64, dtype=torch.long), labels=torch.zeros(2, 64, dtype=torch.long),
                               cu_seqlens=torch.tensor(cu))

    first, second = [0, 64, 128], [0, 10, 64, 100, 128]
    static = k3_graph_inputs(batch(first), cpu, 8)
    k3_graph_inputs(batch(second), cpu, 8, static)
    cu, chunks, offsets = Documents.build(2, 64, torch.tensor(first), cpu, capacity=9).kda_chunks  # from the cache
    assert cu.tolist() == [0, 64, 128] + [128] * 7
    assert chunks[:2].tolist() == [[0, 0], [1, 0]] and chunks[2:].tolist() == [[8, 0]] * (len(chunks) - 2)
    assert offsets.tolist() == [0, 1] + [2] * 8
    assert static[2].kda_chunks[0][:5].tolist() == second
    k3_graph_inputs(batch(first), cpu, 8, static)
    assert static[2].kda_chunks[0][:3].tolist() == first and static[2].kda_chunks[0][3:].unique().tolist() == [128]
