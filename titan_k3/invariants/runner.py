"""Run the invariant checks every `invariants.interval` updates from inside the trainer's step.

Two calls per step, both no-ops off the interval: `before_clip(...)` (after
backward, before clipping: data, loss normaliser, replicas, and the gathered
gradient's norm for the audit) and `after_clip(grad_norm)` (norm agreement,
audit, then the report). Each check is timed; the cost line says how much of
a step the whole set took, so "well under 1%" is something one reads in the
log rather than assumes.

A violation is written to events.jsonl as `invariant_violation` (with the
check's name and metric), counted in the Prometheus counter, printed loudly,
and with `invariants.abort` raises InvariantViolationError.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

from titan_k3.invariants import checks as C


class InvariantViolationError(RuntimeError):
    """invariants.abort = true and a check failed; the message names the check."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class InvariantRunner:
    """cfg: the `invariants` config section (enable, interval, abort).

    group: the data-parallel process group (None: one process; cross-rank checks are skipped).
    on_violation: called with each check name (the Prometheus counter).
    audit_every: the gathered-gradient audit (one all-gather per sharded gradient, the one
    expensive check) runs at the first check and then every `audit_every` checks.
    """

    def __init__(self, cfg, events, *, group: dist.ProcessGroup | None, rank: int, device: torch.device,
                 seq_len: int, on_violation: Callable[[str], None] | None = None, audit_every: int = 10):
        self.cfg, self.events, self.group, self.rank, self.device = cfg, events, group, rank, device
        self.seq_len = seq_len
        self.on_violation = on_violation
        self.total_violations = 0
        self._pending: dict | None = None
        self.audit_every, self._checks_done = audit_every, 0
        self._last_call = 0.0
        self.step_seconds = 0.0
        """Wall time between the last two steps (the cost line's yardstick)."""
        self.last_costs: dict[str, float] = {}

    def due(self, step: int) -> bool:
        return bool(self.cfg.enable) and step % self.cfg.interval == 0

    @property
    def pending(self) -> bool:
        """Whether `before_clip` ran checks this update that `after_clip` must finish (with the clipped norm)."""
        return self._pending is not None

    def _timed(self, name: str, fn, *args, **kwargs) -> list[C.Violation]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync(self.device)
        self.last_costs[name] = self.last_costs.get(name, 0.0) + time.perf_counter() - t0
        return out

    def before_clip(self, step: int, *, batches, model: torch.nn.Module, optimizers, normaliser: torch.Tensor,
                    local_valid: torch.Tensor, loader=None, qk_clip_max_logits: dict | None = None) -> None:
        """Called after backward, before clipping, with the update's microbatches and the loss divisor used."""
        now = time.perf_counter()
        self.step_seconds, self._last_call = now - self._last_call if self._last_call else 0.0, now
        if not self.due(step):
            return
        self.last_costs = {}
        found: list[C.Violation] = []
        fingerprints = torch.cat([b.fingerprints.flatten() for b in batches])
        found += self._timed("data.disjoint_sequences", C.check_disjoint_sequences, fingerprints, self.group)
        weights = getattr(loader, "weights", None)
        if weights:
            world = 1 if self.group is None else dist.get_world_size(self.group)
            found += self._timed("data.source_mix", C.check_source_mix, loader.source_tokens_total, weights, self.group,
                                 slack_tokens=4 * self.seq_len * world)
        found += self._timed("gradient_scale.loss_normaliser", C.check_loss_normaliser,
                             float(normaliser), int(local_valid), self.group)
        found += self._timed("replicas.checksums", C.check_replicas,
                             replicated_state(model, optimizers, qk_clip_max_logits), self.group)
        for dispatcher in expert_dispatchers(model):
            found += self._timed("gradient_scale.ep_token_counts", C.check_ep_token_counts, dispatcher.sent_W,
                                 dispatcher.received_W, int(dispatcher.routed_tokens), dispatcher.top_k, dispatcher.group)
            dispatcher.reset_counts()
        gathered = None
        if self._checks_done % self.audit_every == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            gathered = self._timed("gradient_scale.grad_norm_audit", C.gathered_grad_norm, grads)
        self._checks_done += 1
        self._pending = {"step": step, "found": found, "gathered": gathered}

    def after_clip(self, grad_norm: float) -> list[C.Violation]:
        """Called right after clipping with the norm the update was clipped with; reports and maybe aborts."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        found = pending["found"]
        found += self._timed("gradient_scale.grad_norm_agreement", C.check_grad_norm_agreement, grad_norm, self.group)
        if pending["gathered"] is not None:
            found += C.check_grad_norm_audit(grad_norm, pending["gathered"])
        self.report(pending["step"], found)
        return found

    def report(self, step: int, found: list[C.Violation]) -> None:
        """Events, counter and loud lines for `found` (any check's violations), the cost line, and the abort."""
        if self.rank == 0 and self.last_costs:
            total = sum(self.last_costs.values())
            parts = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in self.last_costs.items())
            share = (f"{100 * total / self.step_seconds:.2f}% of a {1e3 * self.step_seconds:.0f} ms step, "
                     f"{100 * total / self.step_seconds / self.cfg.interval:.3f}% amortised; ") if self.step_seconds else ""
            print(f"invariants at step {step}: {len(self.last_costs)} checks in {1e3 * total:.2f} ms ({share}{parts}); "
                  f"{len(found)} violation(s)", flush=True)
        for v in found:
            self.total_violations += 1
            if self.on_violation is not None:
                self.on_violation(v.check)
            if self.rank == 0:
                self.events.emit("invariant_violation", f"INVARIANT VIOLATED [{v.check}] {v.message}", step=step,
                                 check=v.check, metric=v.metric, **v.details)
        if found and self.cfg.abort:
            raise InvariantViolationError(
                f"invariant {found[0].check} violated at step {step} (invariants.abort = true): {found[0].message}")


def expert_dispatchers(model: torch.nn.Module) -> list:
    """The expert-parallel dispatchers of `model`'s MoE layers (empty without EP)."""
    from titan_k3.parallel.expert_parallel import ExpertParallel

    return [m.experts_fn for m in model.modules() if isinstance(getattr(m, "experts_fn", None), ExpertParallel)]


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
