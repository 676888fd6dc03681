"""An update's forward and backward replayed as one CUDA graph (`compile.cuda_graph`, docs/cuda-graphs.md).

A compiled k3-mini update launches ~2,500 kernels, and issuing them (Python, dynamo's guards, autograd, the
launches) takes the host longer than the GPU takes to run many of them: the step is host-bound. A CUDA graph
records every launch of the update's forward and backward passes once (all micro-batches, and the routers'
Quantile-Balancing moves between them) and replays them with one call, so the host is free while the GPU runs.

What makes it possible:
- inputs of fixed shape: the model family's `graph_inputs` pads the document metadata to
  `compile.cuda_graph_max_documents` documents and writes each batch into the tensors the graph reads;
- a step that never reads a device value on the host (tests/gpu/test_no_host_sync_gpu.py checks it);
- gradients in the graph's memory: the captured backward allocated them; after each replay the parameters'
  `.grad` point at them again (the trainer's zero_grad(set_to_none) dropped them), and the optimizer reads them.

What stays outside the graph: the optimizer step, clipping, QK-Clip, metrics, invariant checks and evaluation.
The first `compile.cuda_graph_warmup` updates run eagerly through the same fixed-shape inputs, so that compilation,
autotuning and lazy initialisation are done before the capture. A micro-batch with more documents than the graph
holds doubles what it holds (an event says so), and a new batch shape (a context-length stage) drops the graph: in
both cases the warm-up and the capture run again.

`side_stream_choice` reports the other execution option that only one process on a GPU takes, optimizer.side_stream,
the same way: a reported fallback where the run lands without it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from titan_k3.config import ConfigError
from titan_k3.models.k3.impl import KernelChoice

GRAPH_TOKENS_PER_DOCUMENT = 256
"""compile.cuda_graph_max_documents = 0 starts with one document per row and one more per this many tokens."""


def check_capturable(cfg, device: torch.device, world_size: int, kernel_choices: Sequence,
                     graph_inputs) -> KernelChoice:
    """The kernel report's `cuda_graph` line for `compile.cuda_graph = true`, or one line refusing it, before any work.

    Where the run lands (no CUDA device, several processes) is not the config's to say, so a recipe can ask for
    the graph and still run there: the update then runs eagerly, as a reported fallback (job.strict refuses it).
    What the config itself chose against a capture (kernels that plan on the host, flex attention, a model family
    without fixed-shape inputs) stops the run.
    """
    key = "config key 'compile.cuda_graph' = true"
    if graph_inputs is None:
        raise ConfigError(f"{key}: model family '{cfg.model.name}' has no fixed-shape inputs (ModelSpec.graph_inputs)")
    chosen = {c.op: c.chosen for c in kernel_choices}
    off = None
    if device.type != "cuda":
        off = f"CUDA graphs need a CUDA device (this run trains on {device.type})"
    elif world_size > 1:
        off = (f"one process only; this run has {world_size} (the collectives of FSDP and expert parallelism are "
               "not captured)")
    if off is not None:
        if cfg.job.strict:
            raise ConfigError(f"job.strict = true and cuda_graph falls back to 'off': {off}")
        return KernelChoice("cuda_graph", "on", "off", True, off)
    for op, ok in (("kda", {"triton"}), ("experts", {"triton"})):
        if op in chosen and chosen[op] not in ok:
            raise ConfigError(f"{key}: needs our Triton {op} kernels (they read the batch's layout from the device); "
                              f"kernels.{op} runs '{chosen[op]}'")
    if chosen.get("attention") == "flex":
        raise ConfigError(f"{key}: flex attention builds its block mask on the host every forward; use "
                          "kernels.attention = 'varlen' or 'auto'")
    return KernelChoice("cuda_graph", "on", "on", False, "forward + backward of each update")


def side_stream_choice(cfg, device: torch.device, world_size: int) -> KernelChoice | None:
    """The kernel report's `optimizer_stream` line for optimizer.side_stream = true; job.strict refuses a fallback."""
    if not cfg.optimizer.side_stream:
        return None
    off = None
    if device.type != "cuda":
        off = f"a second stream needs a CUDA device (this run trains on {device.type})"
    elif world_size > 1:
        off = f"one process only; this run has {world_size} (measured on one GPU, not beside FSDP's own streams)"
    if off is None:
        return KernelChoice("optimizer_stream", "on", "on", False, "AdamW and Muon's update passes beside Newton-Schulz")
    if cfg.job.strict:
        raise ConfigError(f"job.strict = true and optimizer.side_stream falls back to 'off': {off}")
    return KernelChoice("optimizer_stream", "on", "off", True, off)


def max_documents(cfg_value: int, batch: int, seq_len: int) -> int:
    """Documents a captured micro-batch holds at first: the configured number, or one per row and one per 256 tokens.

    NOTE: the embedded corpus has ~840 tokens per document at T4096: 10-74 documents in micro-batches of 8 rows
    (136 held). Padding documents are not free: flash's and KDA's grids grow with the count, and 520 of them cost
    flash ~1.6 ms per k3-mini update (its kernels 8.3 ms against 6.8 unpadded, profiles of 400a93a and bf6501e).
    """
    return cfg_value if cfg_value > 0 else batch + batch * seq_len // GRAPH_TOKENS_PER_DOCUMENT


def documents_in(batch) -> int:
    """Documents of a loader batch (its rows when the rows are whole documents)."""
    return batch.input_ids.shape[0] if batch.cu_seqlens is None else batch.cu_seqlens.numel() - 1


class StepGraph:
    """Runs the trainer's forward + backward over an update's micro-batches, replayed from a CUDA graph.

    run(inputs, normaliser) -> loss_sum is the trainer's own pass (`Trainer._forward_backward`): micro-batch
    forward, backward of its loss over `normaliser`, the model's hooks between micro-batches; it returns the summed
    loss (float32 scalar). `inputs` here are the family's fixed-shape `graph_inputs`.
    """

    def __init__(self, model: torch.nn.Module, run: Callable, graph_inputs: Callable, device: torch.device, *,
                 max_documents: int, warmup: int, emit: Callable):
        self.model, self._run, self._graph_inputs, self.device = model, run, graph_inputs, device
        self.max_documents_cfg, self.warmup, self._emit = max_documents, warmup, emit
        self.captures = 0
        self._stream: torch.cuda.Stream | None = None
        self._reset(None)

    def _reset(self, shape: tuple | None, documents: int | None = None) -> None:
        """Drop the graph and its inputs; the next updates warm up and capture for `shape` and `documents`."""
        self._shape, self._graph, self._inputs, self._grads, self._loss_sum = shape, None, None, [], None
        self._warm = 0
        if documents is None and shape is not None:
            documents = max_documents(self.max_documents_cfg, shape[1], shape[2])
        self._max_documents = documents
        self._normaliser = torch.ones((), device=self.device)

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def memory_pool(self) -> tuple[tuple[int, int], torch.cuda.Stream] | None:
        """(the graph's memory pool, the stream it was captured on), or None while no graph is captured: what
        Muon's Newton-Schulz graphs join under compile.cuda_graph_share_pool (`NewtonSchulzGraphs.join`)."""
        return None if self._graph is None else (self._graph.pool(), self._stream)

    def forward_backward(self, batches: list, normaliser: torch.Tensor, update: int) -> torch.Tensor:
        """This update's summed loss (float32 scalar), with the parameters' .grad holding its gradients."""
        shape = (len(batches), *batches[0].input_ids.shape)
        if shape != self._shape:
            if self._shape is not None:
                self._emit("cuda_graph", f"update {update}: batches of {shape[1:]} (was {self._shape[1:]}): the "
                                         "step's CUDA graph is captured again after its warm-up", step=update)
            self._reset(shape)
        most = max(documents_in(b) for b in batches)
        if most > self._max_documents:
            grown = max(2 * self._max_documents, most)
            self._emit("cuda_graph", f"update {update}: a micro-batch holds {most} documents, more than the "
                                     f"{self._max_documents} the step's CUDA graph holds: it now holds {grown}, "
                                     "captured again after its warm-up", step=update, documents=most, max_documents=grown)
            self._reset(shape, grown)
        if self._inputs is None:
            self._inputs = [self._graph_inputs(b, self.device, self._max_documents) for b in batches]
        else:
            for b, into in zip(batches, self._inputs):
                self._graph_inputs(b, self.device, self._max_documents, into)
        self._normaliser.copy_(normaliser)
        if self._warm < self.warmup:
            self._warm += 1
            return self._run(self._inputs, self._normaliser)
        if self._graph is None:
            self._capture(update)
        self._graph.replay()
        for p, grad in self._grads:
            p.grad = grad
        return self._loss_sum.clone()

    def _capture(self, update: int) -> None:
        held = [name for name, p in self.model.named_parameters() if p.grad is not None]
        if held:
            raise RuntimeError(f"StepGraph: {len(held)} gradients (first {held[0]}) exist before the capture; the "
                               "captured backward must allocate them (zero_grad(set_to_none=True) first)")
        # NOTE: the capture empties the allocator's cache first; emptied here, the change in reserved memory is the
        # graph's own pool, not that minus the cache the warm-up left.
        torch.cuda.empty_cache()
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        # NOTE: a stream of our own, named so that graphs joining this one's pool capture on it too: the allocator
        # hands a pool's freed blocks only to allocations on the stream that freed them.
        self._stream = self._stream or torch.cuda.Stream(self.device)
        # NOTE: thread_local: the loader's prefetch thread may use CUDA during the capture without invalidating it.
        with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
            self._loss_sum = self._run(self._inputs, self._normaliser)
        self._graph = graph
        self._grads = [(p, p.grad) for p in self.model.parameters() if p.grad is not None]
        self.captures += 1
        seconds = time.perf_counter() - start
        pool = (torch.cuda.memory_reserved(self.device) - reserved) / 2**30
        self._emit("cuda_graph", f"update {update}: the forward and backward of {len(self._inputs)} micro-batch(es) "
                                 f"captured as one CUDA graph in {seconds:.1f} s (up to {self._max_documents} documents "
                                 f"per micro-batch, {pool:+.1f} GiB reserved)", step=update,
                   seconds=round(seconds, 3), max_documents=self._max_documents)
