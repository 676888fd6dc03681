"""Run the invariant checks every `invariants.interval` updates, and at the last, from inside the trainer's step.

Three calls per step, all no-ops off the interval: `probe(...)` (before the
update's first forward: the gradient-scale probe of probe.py), `before_clip(...)`
(after backward, before clipping: data, loss normaliser, replicas, and the
norm recomputed from the shards' layout for the audit) and `after_clip(grad_norm)`
(norm agreement, audit, then the report of everything found this update). Each check is timed; the cost line says how much of
an update the whole set took, so "well under 1%" is something one reads in the
log rather than assumes.

The checks' time is their own, not training: given the trainer's clocks, each
call runs under `clocks.outside_training("invariants")`, so a check update's
tokens/s counts only the update's own work, and the session's seconds spent in
checks are `clocks.own_seconds["invariants"]` (the Prometheus counter
titan_k3_invariant_seconds_total).

A violation is written to events.jsonl as `invariant_violation` (with the
check's name and metric), counted in the Prometheus counter, printed loudly,
and with `invariants.abort` raises InvariantViolationError.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
import torch.distributed as dist

from titan_k3.invariants import checks as C
from titan_k3.metrics.clocks import TwoClocks


class InvariantViolationError(RuntimeError):
    """invariants.abort = true and a check failed; the message names the check."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InvariantRunner:
    """cfg: the `invariants` config section (enable, interval, abort).

    group: the data-parallel process group (None: one process; cross-rank checks are skipped).
    on_violation: called with each check name (the Prometheus counter).
    probe_rtol: the probe's tolerance on a tensor's relative gradient error (float32 steps agree to ~1e-6;
    bf16 autocast differs between the sharded model and its float32 copy by a few percent).
    last_step: the run's last update, checked whatever the interval (a run's end state is always checked, and a run
    shorter than the interval is checked once); None: only the interval.
    clocks: the trainer's clocks; the checks' time runs outside their training clock (None: nothing to keep it off,
    and the cost line's yardstick is the wall time between updates).
    """

    def __init__(self, cfg, events, *, group: dist.ProcessGroup | None, rank: int, device: torch.device,
                 on_violation: Callable[[str], None] | None = None, probe_rtol: float = 1e-3,
                 last_step: int | None = None, clocks: TwoClocks | None = None):
        self.cfg, self.events, self.group, self.rank, self.device = cfg, events, group, rank, device
        self.last_step = last_step
        self.clocks = clocks
        self.on_violation = on_violation
        self.probe_rtol = probe_rtol
        self.total_violations = 0
        self.checked_updates = 0
        """Updates whose checks ran to their report (the summary says how many, so "0 violations" is never
        said of a run too short for its interval)."""
        self.counts: dict[str, int] = dict.fromkeys(C.CHECKS, 0)
        """Violations so far by check name (every check present from the start)."""
        self._pending: dict | None = None
        self._probed: tuple[int, list[C.Violation]] | None = None
        self._last_call: float | None = None
        self.step_seconds = 0.0
        """The previous update's seconds on the training clock (the cost line's yardstick; 0 before one is known)."""
        self.last_costs: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return bool(self.cfg.enable) and (step % self.cfg.interval == 0 or step == self.last_step)

    @property
    def pending(self) -> bool:
        """Whether `before_clip` ran checks this update that `after_clip` must finish (with the clipped norm)."""
        return self._pending is not None

    @contextmanager
    def _own_time(self):
        """The checks' own time: outside the trainer's training clock, after the update's work so far has finished."""
        _sync(self.device)  # the update's GPU work up to here is training: it stays on the training clock
        with self.clocks.outside_training("invariants") if self.clocks is not None else nullcontext():
            yield
            _sync(self.device)

    def _timed(self, name: str, fn, *args, **kwargs) -> list[C.Violation]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(self.device)
        self.last_costs[name] = self.last_costs.get(name, 0.0) + time.perf_counter() - t0
        return out

    def probe(self, step: int, batch, *, model: torch.nn.Module, build_copy: Callable[[], torch.nn.Module],
              autocast: Callable) -> None:
        """Before the update's first forward: the gradient-scale probe (probe.py) on `batch`, data-parallel rank 0's."""
        if not self.due(step) or self.group is None:
            return
        with self._own_time():
            self._probe(step, batch, model=model, build_copy=build_copy, autocast=autocast)

    def _probe(self, step: int, batch, *, model: torch.nn.Module, build_copy: Callable[[], torch.nn.Module],
               autocast: Callable) -> None:
        from titan_k3.invariants.probe import probe_gradients

        self.last_costs = {}
        _sync(self.device)
        t0 = time.perf_counter()
        grads, reference = probe_gradients(model, batch, build_copy=build_copy, group=self.group, device=self.device,
                                           autocast=autocast, dispatchers=expert_dispatchers(model))
        self.last_costs[PROBE_COST] = time.perf_counter() - t0
        found = self._timed("gradient_scale.probe_reference", C.check_probe_reference, grads, reference, self.group,
                            self.probe_rtol)
        experts = [n for n in reference if n.endswith((".ffn.w1", ".ffn.w3", ".ffn.w2")) and grads[n].dim() == 3]
        # NOTE: the gathered gradients are whole on every rank (no group to sum over); the advice still names the
        # data-parallel ranks they were reduced over (1/W: averaging).
        found += self._timed("gradient_scale.expert_grad_scale", C.check_expert_grad_scale,
                             {n: grads[n] for n in experts}, {n: reference[n] for n in experts}, None, self.probe_rtol,
                             world=dist.get_world_size(self.group))
        self._probed = (step, found)

    def before_clip(self, step: int, *, batches, model: torch.nn.Module, optimizers, normaliser: torch.Tensor,
                    local_valid: torch.Tensor, loader=None, qk_clip_max_logits: dict | None = None) -> None:
        """Called after backward, before clipping, with the update's microbatches and the loss divisor used."""
        # NOTE: the training clock has counted every update before this one: the difference between two calls is the
        # previous update's training time (its checks left out), whatever ran between the updates.
        now = self.clocks.training_seconds if self.clocks is not None else time.perf_counter()
        self.step_seconds, self._last_call = now - self._last_call if self._last_call is not None else 0.0, now
        if not self.due(step):
            return
        with self._own_time():
            self._before_clip(step, batches=batches, model=model, optimizers=optimizers, normaliser=normaliser,
                              local_valid=local_valid, loader=loader, qk_clip_max_logits=qk_clip_max_logits)

    def _before_clip(self, step: int, *, batches, model: torch.nn.Module, optimizers, normaliser: torch.Tensor,
                     local_valid: torch.Tensor, loader, qk_clip_max_logits: dict | None) -> None:
        probed, self._probed = self._probed, None
        found: list[C.Violation] = []
        if probed is not None and probed[0] == step:
            found += probed[1]
        else:
            self.last_costs = {}
        fingerprints = torch.cat([b.fingerprints.flatten() for b in batches])
        found += self._timed("data.disjoint_sequences", C.check_disjoint_sequences, fingerprints, self.group)
        weights = getattr(loader, "weights", None)
        if weights:
            world = 1 if self.group is None else dist.get_world_size(self.group)
            # NOTE: this update's own sequence length: a context curriculum changes it mid-run.
            window = batches[0].input_ids.shape[-1]
            found += self._timed("data.source_mix", C.check_source_mix, loader.source_tokens_total, weights, self.group,
                                 slack_tokens=4 * window * world)
        found += self._timed("gradient_scale.loss_normaliser", C.check_loss_normaliser,
                             float(normaliser), int(local_valid), self.group)
        found += self._timed("replicas.checksums", C.check_replicas,
                             replicated_state(model, optimizers, qk_clip_max_logits), self.group)
        # NOTE: the shards' half of the same check: its violations and its cost go under the check's one name.
        found += self._timed("replicas.checksums", C.check_replicated_shards, replicated_shards(model), self.group)
        for dispatcher in expert_dispatchers(model):
            found += self._timed("gradient_scale.ep_token_counts", C.check_ep_token_counts, dispatcher.sent_W,
                                 dispatcher.received_W, int(dispatcher.routed_tokens), dispatcher.top_k, dispatcher.group)
            dispatcher.reset_counts()
        shadowed = shadowed_modules(model)
        if shadowed:
            found += self._timed("weights.expert_shadows", lambda: C.check_expert_shadows(
                [f"{name}.{line}" for name, m in shadowed for line in m.shadow_mismatches()]))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        gathered = self._timed("gradient_scale.grad_norm_audit", C.layout_grad_norm, grads)
        self._pending = {"step": step, "found": blame_drift(found), "gathered": gathered}

    def after_clip(self, grad_norm: float) -> list[C.Violation]:
        """Called right after clipping with the norm the update was clipped with; reports and maybe aborts."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        with self._own_time():
            found = pending["found"]
            found += self._timed("gradient_scale.grad_norm_agreement", C.check_grad_norm_agreement, grad_norm, self.group)
            found += C.check_grad_norm_audit(grad_norm, pending["gathered"])
            self.report(pending["step"], found)
        return found

    def report(self, step: int, found: list[C.Violation]) -> None:
        """Events, counter and loud lines for `found` (any check's violations), the cost line, and the abort."""
        self.checked_updates += 1
        if self.rank == 0 and self.last_costs:
            total = sum(self.last_costs.values())
            parts = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in self.last_costs.items())
            share = (f"{100 * total / self.step_seconds:.2f}% of a {1e3 * self.step_seconds:.0f} ms update, "
                     f"{100 * total / self.step_seconds / self.cfg.interval:.3f}% amortised; ") if self.step_seconds else ""
            where = ", off the training clock" if self.clocks is not None else ""
            # NOTE: the probe's forwards and backwards are not a check: "9 checks" read as all of CHECKS having run.
            ran = sum(name in C.CHECKS for name in self.last_costs)
            what = f"{ran} checks" + (" and the probe" if PROBE_COST in self.last_costs else "")
            print(f"invariants at step {step}: {what} in {1e3 * total:.2f} ms{where} ({share}{parts}); "
                  f"{len(found)} violation(s)", flush=True)
        for v in found:
            self.total_violations += 1
            self.counts[v.check] = self.counts.get(v.check, 0) + 1
            if self.on_violation is not None:
                self.on_violation(v.check)
            if self.rank == 0:
                self.events.emit("invariant_violation", f"INVARIANT VIOLATED [{v.check}] {v.message}", step=step,
                                 check=v.check, metric=v.metric, **v.details)
        if found and self.cfg.abort:
            raise InvariantViolationError(
                f"invariant {found[0].check} violated at step {step} (invariants.abort = true): {found[0].message}")


PROBES = ("gradient_scale.probe_reference", "gradient_scale.expert_grad_scale")
PROBE_COST = "probe (two forwards and backwards)"
"""The cost line's name for the probe's own work (the gathered copy's and the parallel model's passes)."""


def blame_drift(found: list[C.Violation]) -> list[C.Violation]:
    """`found` with the probes' violations pointing at replicas.checksums when that check fired in the same update.

    NOTE: the probe compares the ranks' gradients with a single-process reference built from rank 0's weights;
    replicas that drifted apart give other gradients on the other ranks, so the probes fire too (at ~1.00x with a
    few percent error) and their own advice, a wrong reduction, would send the user after a bug that is not there.
    """
    if not any(v.check == "replicas.checksums" for v in found):
        return found
    why = (" (replicas.checksums fired in this update too: drifted replicas alone make the ranks' gradients differ "
           "from the reference; fix the drift first, then read this check again)")
    return [dataclasses.replace(v, message=v.message + why) if v.check in PROBES else v for v in found]


def shadowed_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each module of `model` that keeps weight shadows (`LatentMoE` under
    kernels.expert_weight_shadows)."""
    return [(name, m) for name, m in model.named_modules() if getattr(m, "shadowed", False)]


def expert_dispatchers(model: torch.nn.Module) -> list:
    """The expert-parallel dispatchers of `model`'s MoE layers (empty without EP)."""
    from titan_k3.parallel.expert_parallel import ExpertParallel

    return [m.experts_fn for m in model.modules() if isinstance(getattr(m, "experts_fn", None), ExpertParallel)]


def replicated_shards(model: torch.nn.Module) -> list[tuple[dist.ProcessGroup, dict[str, torch.Tensor]]]:
    """Local shards that other ranks hold replicas of (a DTensor's Replicate mesh dims of size > 1: HSDP).

    One entry per (mesh, dim), in parameter order (the same on every rank):
    the dim's process group and {name: local shard} of the parameters replicated along it.
    """
    from torch.distributed.tensor import DTensor, Replicate

    out: dict[tuple, tuple[dist.ProcessGroup, dict[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        for dim, placement in enumerate(p.placements):
            if isinstance(placement, Replicate) and mesh.size(dim) > 1:
                key = (mesh.mesh_dim_names, tuple(mesh.mesh.shape), dim)
                out.setdefault(key, (mesh.get_group(dim), {}))[1][f"param:{name}"] = p.to_local()
    return list(out.values())


def replicated_state(model: torch.nn.Module, optimizers=None, qk_clip_max_logits: dict | None = None) -> dict[str, torch.Tensor]:
    """Everything that must be identical on every data-parallel rank.

    Routing state (QB biases) and every other buffer, every parameter that is a
    plain tensor (DTensor shards legitimately differ), the optimizers' step
    counts and learning rate, and the QK-Clip max logits of the last update.
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    out: dict[str, torch.Tensor] = {}
    for name, b in model.named_buffers():
        # NOTE: load counts and running max logits are per-rank window accumulators, reduced when reported.
        if not isinstance(b, DTensor) and not name.endswith(("load_counts", "max_logit")):
            out[f"buffer:{name}"] = b
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            out[f"param:{name}"] = p
    if optimizers is not None:
        out["optimizer:lr"] = torch.tensor(float(optimizers.lr), dtype=torch.float64)
        for key, opt in getattr(optimizers, "optimizers", {}).items():
            steps = [float(s["step"]) for s in opt.state.values() if "step" in s]
            if steps:
                out[f"optimizer:{key}.step"] = torch.tensor([min(steps), max(steps)], dtype=torch.float64)
    for layer, logits in (qk_clip_max_logits or {}).items():
        out[f"qk_clip:{layer}.max_logit"] = logits.detach().float()
    return out
