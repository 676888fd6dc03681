"""Per-Head Muon: momentum, then Newton–Schulz orthogonalisation per block (docs/k3.md §6.1).

Each Muon parameter's update is orthogonalised block by block (per head, per expert, or whole; the math and the
block layout live in titan_k3/optim/orthogonalise.py) and scaled so that its RMS roughly matches AdamW's, so that
both optimizers share one learning rate and weight decay. `muon_update` is the per-parameter step as a pure
function; `PerHeadMuon` owns the state and applies the update (batched per block shape, fused passes, Newton–Schulz
as CUDA graphs with `NewtonSchulzGraphs`, and the sharded path that gives each rank its blocks).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.profiler import record_function

from kernels.muon import decay_add_multi_, decay_add_table, momentum_table, nesterov_momentum_multi_, send_tables
from titan_k3.optim.ns_graphs import NewtonSchulzGraphs
from titan_k3.optim.orthogonalise import (blocks_of, by_block_shape, default_ns_dtype, largest_first, orthogonalise,
                                          orthogonalise_batched, orthogonalise_stacked)
from titan_k3.optim.spec import ParamSpec, check_spec


def muon_update(
    grad: torch.Tensor,
    momentum_buf: torch.Tensor,
    spec: ParamSpec,
    *,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    ns_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Advance the momentum buffer in place and return the update to subtract (times lr).

    buf <- momentum * buf + grad
    direction = grad + momentum * buf   (Nesterov)   or   buf
    update = 0.2 * sqrt(max(r, c)) * NS(direction) per [r, c] block
    """
    momentum_buf.mul_(momentum).add_(grad)
    direction = grad.add(momentum_buf, alpha=momentum) if nesterov else momentum_buf
    return orthogonalise(direction, spec, ns_steps=ns_steps, ns_dtype=ns_dtype)


class PerHeadMuon(torch.optim.Optimizer):
    """Muon with per-head / per-expert blocks and decoupled weight decay.

    Each param group may set `num_heads` (default 1) and `per_expert` (default
    False); they apply to every parameter of the group (the builder groups
    parameters by spec). One step per parameter:
        p <- p * (1 - lr * weight_decay)
        p <- p - lr * muon_update(grad, buf, spec)
    `ns_dtype` is the Newton–Schulz compute dtype (None: bf16 on GPU, float32 on CPU).
    `ns_chunk` > 0 runs each block shape's Newton–Schulz over that many blocks at a time (`newton_schulz`'s chunk)
    and writes each update over the optimizer's own scratch input (no output buffer).
    `momentum_dtype` is the momentum buffer's storage dtype (None: the parameter's). Below float32 (bf16) it
    halves the optimizer's largest state; the arithmetic stays float32 and each update rounds the buffer once.

    `skip_if` (attribute, default None): a one-element tensor on the
    parameters' device, e.g. a trainer's found-inf flag. When it holds a
    nonzero value, `step` leaves every parameter and momentum buffer
    bit-identical, whatever the gradients hold (NaN, inf); the flag is read on
    the device inside the fused passes, never by the host, so a trainer can
    queue the step without a sync. Under sharding every rank must hold the
    same value (all collectives still run).
    `grad_scale` (attribute, default None): a one-element tensor on the
    parameters' device that multiplies every gradient as the momentum pass
    reads it, e.g. a trainer's clip coefficient, so clipping needs no pass
    over the gradients of its own.
    `apply_stream` (attribute, default None): a CUDA stream for the update
    passes (weight decay and add) of unsharded parameters: each group's pass
    runs there beside the next group's Newton-Schulz, and the step waits for
    it before returning. The same arithmetic on the same tensors: the result is
    bit-identical to running every pass on the current stream.
    """

    def __init__(
        self,
        params: Any,
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
        ns_cuda_graphs: bool = False,
        momentum_dtype: torch.dtype | None = None,
        ns_chunk: int = 0,
    ) -> None:
        if lr < 0:
            raise ValueError(f"PerHeadMuon: lr={lr}; must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"PerHeadMuon: momentum={momentum}; must be in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"PerHeadMuon: weight_decay={weight_decay}; must be >= 0")
        if ns_steps < 1:
            raise ValueError(f"PerHeadMuon: ns_steps={ns_steps}; must be >= 1")
        if momentum_dtype not in (None, torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"PerHeadMuon: momentum_dtype={momentum_dtype}; use float32, bfloat16 or float64 "
                             "(float16's range cannot hold a gradient's momentum)")
        if ns_chunk < 0:
            raise ValueError(f"PerHeadMuon: ns_chunk={ns_chunk}; must be >= 0 (0: every block of a shape at once)")
        self.ns_dtype = ns_dtype
        self.ns_chunk = ns_chunk
        self.momentum_dtype = momentum_dtype
        self.ns_graphs = NewtonSchulzGraphs() if ns_cuda_graphs else None
        self.skip_if: torch.Tensor | None = None
        self._layouts: dict[torch.Tensor, tuple[bool, ParamSpec | None]] = {}
        self.grad_scale: torch.Tensor | None = None
        self.apply_stream: torch.cuda.Stream | None = None
        self.shadows: dict[torch.Tensor, torch.Tensor] = {}
        """parameter -> its copy in a lower dtype that the update pass writes beside it (the experts' shadows:
        titan_k3/models/k3/expert_shadows.py); unsharded parameters only."""
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, num_heads=1, per_expert=False,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        spec = _spec_of_group(group)
        for i, p in enumerate(group["params"]):
            check_spec(f"param group {len(self.param_groups) - 1}, param {i}", p.shape, spec)

    def init_state(self) -> None:
        """Allocate every momentum buffer now, so that a state dict is complete before step 1."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = self._new_buffer(p)

    def _new_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(p, dtype=self.momentum_dtype or p.dtype)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        # NOTE: torch casts every floating-point state tensor to its parameter's dtype on load; the momentum
        # buffers go back to the configured storage (a checkpoint of either dtype resumes in this run's).
        if self.momentum_dtype is not None:
            for state in self.state.values():
                buf = state.get("momentum_buffer")
                if buf is not None and buf.dtype != self.momentum_dtype:
                    state["momentum_buffer"] = buf.to(self.momentum_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip, scale = self.skip_if, self.grad_scale
        for name, flag in (("skip_if", skip), ("grad_scale", scale)):
            if flag is not None and (not isinstance(flag, torch.Tensor) or flag.numel() != 1):
                raise ValueError(f"PerHeadMuon.{name} must be None or a one-element tensor; got {flag!r}")
        sharded, batches = [], {}
        for group in self.param_groups:
            spec = _spec_of_group(group)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = self._new_buffer(p)
                if self._layout(p, spec)[0]:
                    sharded.append((p, group, spec))
                    continue
                key = (p.device, p.dtype, group["lr"], group["weight_decay"], group["momentum"], group["nesterov"],
                       group["ns_steps"])
                batches.setdefault(key, []).append((p, spec))
        for key, members in batches.items():
            self._step_batch(members, *key[2:], skip, scale)
        if sharded:
            self._step_sharded(sharded, skip, scale)
        return loss

    def _layout(self, p: torch.Tensor, spec: ParamSpec) -> tuple[bool, ParamSpec | None]:
        """(row-sharded, the spec of its local blocks or None) of a parameter: fixed for its life, found once.

        NOTE: worked out per parameter and step, these placement and mesh queries were a few ms of host time
        per update in the sharded step, which bounds an FSDP2 update (benchmarks/results/scaling.md).
        """
        layout = self._layouts.get(p)
        if layout is None:
            sharded = _row_sharded(p)
            layout = self._layouts[p] = (sharded, _local_block_spec(p, spec) if sharded else None)
        return layout

    def _step_batch(self, members: list, lr: float, wd: float, momentum: float, nesterov: bool, ns_steps: int,
                    skip: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """One update of parameters that share a device, a dtype and the group settings.

        Same math as `muon_update` per parameter, with every block of one
        [r, c] shape, over all members, in one batched Newton–Schulz call, and
        per block shape one launch of each fused pass: the momentum pass
        advances every member's buffer and writes its Nesterov direction
        straight into its place in that call's input, in the NS dtype; the
        update pass decays every member and adds its scaled update, still in
        the NS dtype. No float32 copies, concatenations or casts of ~1B values,
        and a few launches per block shape, not per parameter (a k3-mini step
        was host-bound on per-parameter launches). The largest block shapes go
        first: the host queues the long expert batches and then the many small
        ones while the GPU runs (after the step's host sync the queue is empty,
        and the small batches alone are launch-bound).
        """
        params = [p for p, _ in members]
        ns_dtype = self.ns_dtype or default_ns_dtype(params[0].device)
        views = [blocks_of(p, spec) for p, spec in members]
        grads = [blocks_of(p.grad, spec) for p, spec in members]
        bufs = [blocks_of(self.state[p]["momentum_buffer"], spec) for p, spec in members]
        shadows = [blocks_of(self.shadows[p], spec) if p in self.shadows else None for p, spec in members]
        # NOTE: within a block shape the shadowed members go first, so each kind's update slots are one slice of
        # the stacked update and each kind's pass one launch.
        shapes = [(shape, sorted(idx, key=lambda i: shadows[i] is None))
                  for shape, idx in largest_first(by_block_shape(views), views)]
        graphs = self.ns_graphs if params[0].is_cuda else None
        # NOTE: joined to the update graph's pool (compile.cuda_graph_share_pool), each group's graph runs its
        # momentum pass too (`NewtonSchulzGraphs.momentum_orthogonalise`, with tables of its own).
        fused = graphs is not None and graphs.joined()
        flags = graphs.step_flags(skip, scale) if fused else None
        passes = [_update_passes(views, shadows, idx) for _, idx in shapes]
        decay_tables = [table for group in passes for *_, table in group]
        momentum_tables = [] if fused else [momentum_table([grads[i] for i in idx], [bufs[i] for i in idx])
                                            for _, idx in shapes]
        send_tables(decay_tables + momentum_tables, params[0].device)  # NOTE: the step's tables in one copy
        with record_function("muon.orthogonalise"):
            for g, ((rows, cols), idx) in enumerate(shapes):
                shape = (sum(views[i].shape[0] for i in idx), rows, cols)
                key = (tuple(id(params[i]) for i in idx), ns_steps, ns_dtype)
                if fused:
                    update = graphs.momentum_orthogonalise(key, [grads[i] for i in idx], [bufs[i] for i in idx],
                                                           shape, momentum, nesterov, ns_steps, ns_dtype, flags,
                                                           self.ns_chunk)
                    self._apply(passes[g], update, 1.0 - lr * wd, -lr, skip)
                    continue
                if graphs is not None:
                    stacked = graphs.input(key, shape, ns_dtype, params[0].device)
                else:
                    stacked = views[idx[0]].new_empty(shape, dtype=ns_dtype)
                with record_function("muon.momentum"):
                    nesterov_momentum_multi_([grads[i] for i in idx], [bufs[i] for i in idx], stacked, momentum,
                                             nesterov, skip_if=skip, grad_scale=scale, table=momentum_tables[g])
                if graphs is not None:
                    update = graphs.run(key, lambda x=stacked: orthogonalise_stacked(x, ns_steps, ns_dtype,
                                                                                     self.ns_chunk, scratch=True))
                else:
                    update = orthogonalise_stacked(stacked, ns_steps, ns_dtype, self.ns_chunk, scratch=True)
                self._apply(passes[g], update, 1.0 - lr * wd, -lr, skip)
        if self.apply_stream is not None:
            # NOTE: joined before the tables and flags this call sent go out of scope (their blocks return to the
            # current stream's cache), and before anything after the step reads a parameter.
            torch.cuda.current_stream(self.apply_stream.device).wait_stream(self.apply_stream)

    def _apply(self, passes: list, update: torch.Tensor, decay: float, alpha: float,
               skip: torch.Tensor | None) -> None:
        """One group's update pass (params <- decay * params + alpha * update, and their shadows), on
        `apply_stream` when set. passes: `_update_passes` of the group, each of a slice of the stacked update.

        On the apply stream the pass starts once the work queued so far (this group's Newton-Schulz) is done and
        runs beside the next group's momentum pass and Newton-Schulz, which read and write other tensors.
        """
        stream = self.apply_stream

        def run():
            for first, end, params, shadows, table in passes:
                decay_add_multi_(params, update[first:end], decay, alpha, shadows=shadows, skip_if=skip, table=table)

        with record_function("muon.apply"):
            if stream is None:
                run()
                return
            stream.wait_stream(torch.cuda.current_stream(stream.device))
            # NOTE: an eager group's update is a temporary freed when the loop moves on; its block must not be
            # handed to the next group's Newton-Schulz before this pass has read it.
            update.record_stream(stream)
            with torch.cuda.stream(stream):
                run()

    def _step_sharded(self, items: list, skip: torch.Tensor | None, scale: torch.Tensor | None) -> None:
        """Muon on dim-0-sharded DTensors (FSDP2, EP), working on local shards only.

        Momentum and weight decay are elementwise, so they run on the local
        shards, one fused launch per group setting and dtype. A parameter whose
        blocks (heads, experts) each lie whole on one shard is orthogonalised
        locally with no communication. Every other parameter goes to one owner
        rank of its shard group (`_owner_orthogonalise`: one gather and one
        scatter per owner, however many parameters), is orthogonalised there
        while the other owners work on theirs, and its update comes back.
        """
        shadowed = next((p for p, _, _ in items if p in self.shadows), None)
        if shadowed is not None:
            raise ValueError(f"PerHeadMuon: a sharded parameter of shape {tuple(shadowed.shape)} has a shadow; the "
                             "sharded update pass writes none (shadows are for unsharded parameters)")
        directions = {}
        by_momentum: dict[tuple, list] = {}
        for p, group, _ in items:
            by_momentum.setdefault((group["momentum"], group["nesterov"], p.dtype), []).append(p)
        with record_function("muon.momentum"):
            for (momentum, nesterov, _), params in by_momentum.items():
                grads = [p.grad.to_local() for p in params]
                flat = grads[0].new_empty(sum(g.numel() for g in grads))
                nesterov_momentum_multi_(grads, [self.state[p]["momentum_buffer"].to_local() for p in params], flat,
                                         momentum, nesterov, skip_if=skip, grad_scale=scale)
                for p, g, d in zip(params, grads, flat.split([g.numel() for g in grads])):
                    directions[p] = d.view(g.shape)
        local, remote = {}, []
        for p, group, spec in items:
            local_spec = self._layout(p, spec)[1]
            if local_spec is None:
                remote.append((p, group, spec, directions[p]))
            elif directions[p].numel() > 0:
                local.setdefault(group["ns_steps"], []).append((p, directions[p], local_spec))
        local_updates = {p: torch.zeros_like(p.to_local()) for p, _, _ in items if p.to_local().numel() == 0}
        graphs = self.ns_graphs if items[0][0].is_cuda else None
        with record_function("muon.orthogonalise"):
            for ns_steps, members in local.items():
                updates = orthogonalise_batched([d for _, d, _ in members], [s for _, _, s in members],
                                                ns_steps=ns_steps, ns_dtype=self.ns_dtype, cast=False, graphs=graphs,
                                                key=("local", *(id(p) for p, _, _ in members)), ns_chunk=self.ns_chunk)
                local_updates.update((p, u) for (p, _, _), u in zip(members, updates))
            local_updates.update(_owner_orthogonalise(remote, self.ns_dtype, graphs, self.ns_chunk))
        by_decay: dict[tuple, list] = {}
        for p, group, _ in items:
            by_decay.setdefault((group["lr"], group["weight_decay"], p.dtype, local_updates[p].dtype), []).append(p)
        with record_function("muon.apply"):
            for (lr, wd, _, _), params in by_decay.items():
                decay_add_multi_([p.to_local() for p in params], [local_updates[p] for p in params], 1.0 - lr * wd,
                                 -lr, skip_if=skip)


def _update_passes(views: list[torch.Tensor], shadows: list[torch.Tensor | None], idx: list[int]) -> list[tuple]:
    """A block-shape group's update passes: (first, end block of the stacked update, params, shadows or None, table),
    one for the members with shadows and one for those without (`idx` lists the shadowed first)."""
    passes, first = [], 0
    for has_shadow in (True, False):
        part = [i for i in idx if (shadows[i] is not None) == has_shadow]
        if not part:
            continue
        params = [views[i] for i in part]
        kept = [shadows[i] for i in part] if has_shadow else None
        end = first + sum(v.shape[0] for v in params)
        passes.append((first, end, params, kept, decay_add_table(params, None, kept)))
        first = end
    return passes


def _row_sharded(p: torch.Tensor) -> bool:
    """A DTensor whose only non-replicated placements shard dim 0 (FSDP2's layout, EP's expert split)."""
    if not isinstance(p, DTensor):
        return False
    placements = [pl for pl in p.placements if not isinstance(pl, Replicate)]
    return all(_is_shard(pl) and pl.dim == 0 for pl in placements)


def _is_shard(placement) -> bool:
    # NOTE: FSDP2 + EP puts a _StridedShard on the FSDP dim; it subclasses Shard in some torch versions only.
    return isinstance(placement, (Shard, _StridedShard))


def _shard_dim(p: DTensor) -> int | None:
    """The one mesh dim that shards p (None when several do: only whole experts can then stay local)."""
    dims = [i for i, pl in enumerate(p.placements) if _is_shard(pl)]
    return dims[0] if len(dims) == 1 else None


def _local_block_spec(p: DTensor, spec: ParamSpec) -> ParamSpec | None:
    """The spec of p's local shard if every block of it lies whole on one rank, else None."""
    if spec.per_expert:
        return spec  # dim 0 is the expert index: any row range holds whole experts
    dim = _shard_dim(p)
    if dim is None:
        return None
    rows, world = p.shape[0], p.device_mesh.size(dim)
    chunk, head_rows = -(-rows // world), rows // spec.num_heads
    if chunk % head_rows:
        return None
    local_rows = p.to_local().shape[0]
    return ParamSpec(use_muon=True, num_heads=max(local_rows // head_rows, 1))


class _Remote(NamedTuple):
    """One parameter orthogonalised by an owner rank: its rows travel as `chunk`-row shards from every rank."""

    p: torch.Tensor
    spec: ParamSpec
    ns_steps: int
    direction: torch.Tensor  # this rank's shard [rows_local, ...]
    chunk: int  # rows per rank, as FSDP2 splits dim 0 (torch.chunk): ceil(rows / world)

    @property
    def shard_numel(self) -> int:
        """Elements of one padded shard (`chunk` rows), the size it travels at."""
        return self.chunk * math.prod(self.p.shape[1:])


def _assign_owners(members: list[_Remote], world: int) -> list[list[_Remote]]:
    """Each parameter to one rank, largest first to the least-loaded rank (by elements), identically on every rank."""
    owned: list[list[_Remote]] = [[] for _ in range(world)]
    load = [0] * world
    for m in sorted(members, key=lambda m: -m.p.numel()):  # sorted() is stable: ties keep parameter order
        owner = load.index(min(load))
        owned[owner].append(m)
        load[owner] += m.p.numel()
    return owned


def _owner_orthogonalise(remote: list, ns_dtype, graphs: NewtonSchulzGraphs | None = None, ns_chunk: int = 0) -> dict:
    """Gather each direction to its owner, orthogonalise it there, scatter the update back.

    FSDP2 splits dim 0 like torch.chunk: rank i holds rows [i*c, min((i+1)*c, n)),
    c = ceil(n / world), possibly none; shards travel padded to c rows. Per
    shard group and dtype, everything one owner needs travels as one flat
    buffer per rank: one gather and one scatter per owner, not per parameter
    (a collective per matrix was latency-bound). All gathers are issued before
    any owner computes, so owners work in parallel, in batches of one block shape.
    """
    groups: dict[tuple, list[_Remote]] = {}
    for p, group, spec, direction in remote:
        dim = _shard_dim(p)
        assert dim is not None, f"cannot gather a parameter sharded on several mesh dims: {p.placements}"
        pg, world = p.device_mesh.get_group(dim), p.device_mesh.size(dim)
        member = _Remote(p, spec, group["ns_steps"], direction, -(-p.shape[0] // world))
        groups.setdefault((pg, world, p.device_mesh.get_local_rank(dim), direction.dtype), []).append(member)
    updates = {}
    for (pg, world, me, _), members in groups.items():
        updates.update(_exchange(pg, world, me, _assign_owners(members, world), ns_dtype, graphs, ns_chunk))
    return updates


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [r, ...] as [rows, ...] with zero rows appended (r <= rows)."""
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


def _exchange(pg, world: int, me: int, owned: list[list[_Remote]], ns_dtype,
              graphs: NewtonSchulzGraphs | None = None, ns_chunk: int = 0) -> dict:
    """One shard group: gather to each owner, orthogonalise what this rank owns, scatter the updates back."""
    gathered, works = [], []
    for owner, members in enumerate(owned):
        if not members:
            gathered.append(None)
            continue
        flat = torch.cat([_padded(m.direction, m.chunk).reshape(-1) for m in members])
        bufs = [torch.empty_like(flat) for _ in range(world)] if me == owner else None
        works.append(dist.gather(flat, bufs, dst=dist.get_global_rank(pg, owner), group=pg, async_op=True))
        gathered.append(bufs)
    for work in works:
        work.wait()
    mine = owned[me]
    full_updates: list[torch.Tensor] = []
    if mine:
        pieces = [buf.split([m.shard_numel for m in mine]) for buf in gathered[me]]  # [rank][member]
        fulls = [torch.cat([pieces[r][i].view(m.chunk, *m.p.shape[1:]) for r in range(world)])[: m.p.shape[0]]
                 for i, m in enumerate(mine)]
        by_steps: dict[int, list[int]] = {}
        for i, m in enumerate(mine):
            by_steps.setdefault(m.ns_steps, []).append(i)
        full_updates = [None] * len(mine)
        for ns_steps, idx in by_steps.items():
            outs = orthogonalise_batched([fulls[i] for i in idx], [mine[i].spec for i in idx], ns_steps=ns_steps,
                                         ns_dtype=ns_dtype, graphs=graphs, key=("owned", *(id(mine[i].p) for i in idx)),
                                         ns_chunk=ns_chunk)
            for i, u in zip(idx, outs):
                full_updates[i] = u
    results, works = [], []
    for owner, members in enumerate(owned):
        if not members:
            continue
        sizes = [m.shard_numel for m in members]
        out = members[0].direction.new_empty(sum(sizes))
        send = None
        if me == owner:
            padded = [_padded(u, m.chunk * world).reshape(world, -1) for u, m in zip(full_updates, members)]
            send = [torch.cat([x[r] for x in padded]) for r in range(world)]
        works.append(dist.scatter(out, send, src=dist.get_global_rank(pg, owner), group=pg, async_op=True))
        results.append((members, out, sizes))
    for work in works:
        work.wait()
    updates = {}
    for members, out, sizes in results:
        for m, piece in zip(members, out.split(sizes)):
            updates[m.p] = piece.view(m.chunk, *m.p.shape[1:])[: m.direction.shape[0]]
    return updates


def _spec_of_group(group: dict[str, Any]) -> ParamSpec:
    return ParamSpec(use_muon=True, num_heads=group["num_heads"], per_expert=group["per_expert"])
