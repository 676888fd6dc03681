"""Per-Head Muon's Newton-Schulz as CUDA graphs: one replay per block-shape group and step
(`optimizer.ns_cuda_graphs`), captured into the update graph's memory pool when joined
(`compile.cuda_graph_share_pool`, docs/cuda-graphs.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from kernels.muon import momentum_table, nesterov_momentum_multi_, send_tables
from titan_k3.optim.orthogonalise import orthogonalise_stacked


class NewtonSchulzGraphs:
    """Each block-shape group's Newton–Schulz replayed as a CUDA graph: one launch instead of ~25 per step.

    A group's directions go into a persistent input buffer (`input`); `run` computes the group's NS the
    first time eagerly (a warm-up: cuBLAS picks its kernels outside a capture), captures it the second time
    and replays it from then on. Graph outputs are persistent too: an update is read (by the update pass)
    before the group's next replay. A group is keyed by its call site, its members' identities, steps and
    dtype: a different membership (a parameter without a gradient) is another group.
    NOTE: the buffers stay reserved (inputs and outputs: about twice the Muon parameters this rank
    orthogonalises, in the NS dtype), and the kernels are those of the eager NS. It pays where the host is
    the bottleneck: under FSDP2 the sharded step's NS calls took ~25 ms of host for ~10 ms of GPU work
    (benchmarks/results/scaling.md); on one GPU the step's host launches overlap the backward's tail.
    """

    def __init__(self):
        self._inputs: dict = {}
        self._graphs: dict = {}
        self._warm: set = set()
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._host: Callable[[], tuple | None] | None = None
        self._fused: dict = {}  # key -> (momentum table on the device, the addresses it was built for)
        self._flags: dict = {}  # (name, dtype, shape) -> the flag tensor every fused graph reads

    def join(self, host: Callable[[], tuple | None]) -> None:
        """Capture into another graph's memory pool, on the stream that graph was captured on.

        host() -> (pool, stream) of the other graph, or None while it is not captured; until then the Newton-Schulz
        runs eagerly. Captured after that graph, each group's outputs and temporaries may take the blocks its
        capture freed (the update's activations, dead while the optimizer runs) instead of a pool of their own.
        NOTE: safe because the replays keep the captures' order (the update's graph, then each group in turn, every
        update) and nothing reads a group's output after the next update's replay. A host captured again (a new
        pool) drops these graphs; they are captured again into the new pool at their next run.
        """
        self._host = host

    def input(self, key, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The group's input buffer: persistent (its graph reads it), except while joined to a host that is not
        captured yet, when every run is eager and the buffer is a temporary of the update.
        NOTE: buffers kept from those warm-up updates were still allocated during the host's capture, the
        update's peak (1.6 GiB of k3-mini's 28.0 at B32 T1024, benchmarks/results/train_throughput.md, session
        29); once joined, the fused groups write their input into the pool instead (`momentum_orthogonalise`)."""
        if self._host is not None and self._host() is None:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self._inputs.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = self._inputs[key] = torch.empty(shape, dtype=dtype, device=device)
            self._graphs.pop(key, None)
            self._warm.discard(key)
        return buf

    def run(self, key, ns: Callable[[], torch.Tensor]) -> torch.Tensor:
        """ns() reads only `input(key)`'s buffer; returns its result (the graph's persistent output)."""
        if self._host is not None:
            host = self._host()
            if host is None:
                self._warm.add(key)
                return ns()
            if host[0] != self._pool:
                # NOTE: the input buffers of the eager runs before go too (joined, each group's graph makes its
                # own); the fused groups' tables stay: `momentum_orthogonalise` checks their addresses.
                self._graphs.clear()
                self._inputs.clear()
                self._pool, self._stream = host
        entry = self._graphs.get(key)
        if entry is not None:
            entry[0].replay()
            return entry[1]
        if key not in self._warm:
            self._warm.add(key)
            return ns()
        graph = torch.cuda.CUDAGraph()
        # NOTE: captured by hand rather than with torch.cuda.graph, which synchronises the device, runs a full
        # gc.collect and empties the cache per capture (seconds at start for ~15 groups). A capture records
        # without running anything, so it needs no wait on the work queued before it. thread_local: the data
        # prefetch thread may touch CUDA meanwhile without invalidating the capture.
        self._stream = self._stream or torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = ns()
            finally:
                graph.capture_end()
        self._pool = graph.pool()
        self._graphs[key] = (graph, out)
        graph.replay()  # a capture only records: this step's update comes from the first replay
        return out

    def joined(self) -> bool:
        """Whether captures go into a host graph's pool now: joined (`join`), and that graph captured."""
        return self._host is not None and self._host() is not None

    def step_flags(self, skip: torch.Tensor | None, scale: torch.Tensor | None) -> tuple:
        """(skip, scale) in tensors at fixed addresses that the fused graphs read, this step's values copied in:
        one pair for every group, so two small copies per step (None stays None)."""
        out = []
        for name, given in (("skip", skip), ("scale", scale)):
            if given is not None:
                mine = self._flags.setdefault((name, given.dtype, tuple(given.shape)), torch.empty_like(given))
                given = mine.copy_(given)
            out.append(given)
        return tuple(out)

    def momentum_orthogonalise(self, key, grads: list[torch.Tensor], bufs: list[torch.Tensor],
                               shape: tuple[int, int, int], momentum: float, nesterov: bool, ns_steps: int,
                               ns_dtype: torch.dtype, flags: tuple, ns_chunk: int = 0) -> torch.Tensor:
        """A group's momentum pass and Newton-Schulz as one graph, when joined: blocks [b_i, r, c] of the gradients
        and momentum buffers -> the update [B, r, c] in the NS dtype (the buffers advanced in place).

        NOTE: in the update graph's pool the gradients are that graph's outputs, at fixed addresses, and the
        buffers are the optimizer's state, so the pass can be captured too: the stacked input it writes becomes a
        temporary of the pool instead of a buffer held between updates (~2 bytes per Muon parameter), and the
        group makes one launch fewer. flags: `step_flags`' (skip, scale), the tensors the graph reads. Tensors at
        other addresses than the capture's (a state loaded anew) make it a new group: warmed up and captured again,
        never replayed on stale memory.
        """
        fkey = ("momentum", key, *(f is not None for f in flags))
        addresses = tuple(t.data_ptr() for t in (*grads, *bufs, *(f for f in flags if f is not None)))
        entry = self._fused.get(fkey)
        if entry is None or entry[1] != addresses:
            self._graphs.pop(fkey, None)
            self._warm.discard(fkey)
            entry = self._fused[fkey] = (momentum_table(grads, bufs), addresses)
            send_tables([entry[0]], grads[0].device)
        table = entry[0]

        def run() -> torch.Tensor:
            stacked = torch.empty(shape, dtype=ns_dtype, device=grads[0].device)
            nesterov_momentum_multi_(grads, bufs, stacked, momentum, nesterov, skip_if=flags[0], grad_scale=flags[1],
                                     table=table)
            return orthogonalise_stacked(stacked, ns_steps, ns_dtype, ns_chunk, scratch=True)

        return self.run(fkey, run)

    def orthogonalise(self, key, blocks: list[torch.Tensor], shape: tuple[int, int, int], ns_steps: int,
                      ns_dtype: torch.dtype, ns_chunk: int = 0) -> torch.Tensor:
        """`orthogonalise_stacked` of the blocks [b_i, r, c] concatenated: one copy into the group's input,
        one replay."""
        stacked = self.input((key, ns_steps, ns_dtype), shape, ns_dtype, blocks[0].device)
        torch.cat(blocks, out=stacked)
        return self.run((key, ns_steps, ns_dtype),
                        lambda: orthogonalise_stacked(stacked, ns_steps, ns_dtype, ns_chunk, scratch=True))
