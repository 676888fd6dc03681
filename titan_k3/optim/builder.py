"""Build the two optimizers of a run and hold them as one (docs/k3.md §6).

Per-Head Muon takes the matrices, AdamW everything else; both share one
learning rate (Muon's per-block 0.2 * sqrt(max(r, c)) scale makes that work)
and one weight decay. `Optimizers` steps, zeroes, schedules and checkpoints
them together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from titan_k3.optim.muon import PerHeadMuon
from titan_k3.optim.spec import ParamSpec, check_spec

SpecFn = Callable[[str, torch.nn.Parameter], ParamSpec]


class Optimizers:
    """Per-Head Muon + AdamW behind one interface.

    `optimizers` maps "muon" / "adamw" to an optimizer (only the non-empty ones);
    `names` maps the same keys to the parameter names in the order the
    optimizer enumerates its parameters, so the state dict is keyed by name.
    Every optimizer state is allocated at construction, so `state_dict()` is
    complete before the first step (a checkpoint loader that fills tensors in
    place, like torch.distributed.checkpoint, needs that).
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], names: dict[str, list[str]],
                 side_stream: torch.cuda.Stream | None = None) -> None:
        assert optimizers.keys() == names.keys()
        self.optimizers = optimizers
        self.names = names
        self.side_stream = side_stream
        """A CUDA stream for AdamW's step and Muon's update passes, beside Muon's Newton-Schulz (`step`); None: one."""
        for key, opt in optimizers.items():
            assert len(names[key]) == sum(len(g["params"]) for g in opt.param_groups)
            if isinstance(opt, PerHeadMuon):
                opt.init_state()
            else:
                _init_adamw_state(opt)

    @property
    def muon(self) -> PerHeadMuon | None:
        return self.optimizers.get("muon")

    @property
    def adamw(self) -> torch.optim.AdamW | None:
        return self.optimizers.get("adamw")

    def step(self, skip_if: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
        """One update of every optimizer, with two optional inputs that stay on the device (0-dim tensors).

        skip_if (bool, True = skip): a skipped update leaves every parameter and every optimizer state
        bit-identical, without the host reading the flag. grad_scale (float): every gradient is used as
        gradient * grad_scale (a clip coefficient), applied as each optimizer reads it, not by a pass of its own.
        Per-Head Muon takes both in its fused passes; fused AdamW takes them as found_inf and grad_scale
        (which divides, so it gets the reciprocal).

        With a side stream, AdamW's step and Muon's update passes run there while Muon's momentum passes and
        Newton-Schulz products run on the current stream; the step waits for the side stream before returning.
        The two optimizers touch disjoint parameters and states, so the updates are bit-identical either way.
        """
        flags = {}
        for key, opt in self.optimizers.items():
            if isinstance(opt, PerHeadMuon):
                flags[key] = {"skip_if": skip_if, "grad_scale": grad_scale, "apply_stream": self.side_stream}
            else:
                assert skip_if is None and grad_scale is None or opt.defaults.get("fused"), \
                    "device-side skip and scaling need fused AdamW (found_inf, grad_scale)"
                flags[key] = {"found_inf": None if skip_if is None else skip_if.float(),
                              "grad_scale": None if grad_scale is None else grad_scale.float().reciprocal()}
        side = self.side_stream
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(side.device))  # the gradients and every flag above
        try:
            # NOTE: AdamW first: on the side stream it then runs beside Muon's first (largest) Newton-Schulz group.
            for key in sorted(self.optimizers, key=lambda k: isinstance(self.optimizers[k], PerHeadMuon)):
                opt = self.optimizers[key]
                for name, value in flags[key].items():
                    setattr(opt, name, value)
                on_side = side is not None and not isinstance(opt, PerHeadMuon)
                try:
                    with torch.cuda.stream(side) if on_side else contextlib.nullcontext():
                        opt.step()
                finally:
                    for name in flags[key]:
                        setattr(opt, name, None)
        finally:
            if side is not None:
                # NOTE: joined while `flags` still holds the tensors the side stream reads.
                torch.cuda.current_stream(side.device).wait_stream(side)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def lr(self) -> float:
        """The learning rate of the next step (the same in every group)."""
        opt = next(iter(self.optimizers.values()))
        return opt.param_groups[0]["lr"]

    def set_lr(self, lr: float) -> None:
        if not lr >= 0:
            raise ValueError(f"set_lr: lr={lr}; must be a finite number >= 0")
        for opt in self.optimizers.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """{"muon": ..., "adamw": ...}, each {"state": {name: {...}}, "param_groups": [{"params": [names], ...}]}.

        The tensors are the optimizers' own (not copies), so an in-place loader
        fills them directly.
        """
        out = {}
        for key, opt in self.optimizers.items():
            names = self.names[key]
            sd = opt.state_dict()
            out[key] = {
                "state": {names[i]: s for i, s in sd["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
            }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.keys() != self.optimizers.keys():
            raise ValueError(
                f"optimizer state dict has {sorted(state_dict)}; this run has {sorted(self.optimizers)} "
                "(was the checkpoint written with another optimizer.use_muon?)"
            )
        for key, opt in self.optimizers.items():
            names = self.names[key]
            index = {name: i for i, name in enumerate(names)}
            sd = state_dict[key]
            saved = [n for g in sd["param_groups"] for n in g["params"]]
            if saved != names:
                missing = sorted(set(names) - set(saved))[:3]
                extra = sorted(set(saved) - set(names))[:3]
                raise ValueError(
                    f"{key} state dict does not match this model's parameters "
                    f"(missing e.g. {missing}, unexpected e.g. {extra}, or another grouping)"
                )
            opt.load_state_dict({
                "state": {index[n]: s for n, s in sd["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]],
            })

    def param_groups_summary(self) -> dict[str, dict[str, int]]:
        """Per optimizer: tensors and elements, all and without weight decay."""
        summary = {}
        for key, opt in self.optimizers.items():
            row = {"tensors": 0, "numel": 0, "no_decay_tensors": 0, "no_decay_numel": 0}
            for group in opt.param_groups:
                n, numel = len(group["params"]), sum(p.numel() for p in group["params"])
                row["tensors"] += n
                row["numel"] += numel
                if group["weight_decay"] == 0:
                    row["no_decay_tensors"] += n
                    row["no_decay_numel"] += numel
            summary[key] = row
        return summary

    def summary_line(self) -> str:
        """`param_groups_summary` in words, e.g. 'muon 57 tensors, 215,424 parameters; adamw 46 tensors,
        20,976,966 parameters (1,606 of them in 32 tensors without weight decay)'."""
        parts = []
        for key, row in self.param_groups_summary().items():
            text = f"{key} {row['tensors']} tensors, {row['numel']:,} parameters"
            if row["no_decay_tensors"]:
                text += f" ({row['no_decay_numel']:,} of them in {row['no_decay_tensors']} tensors without weight decay)"
            parts.append(text)
        return "; ".join(parts)


def build_optimizers(
    named_params: Iterable[tuple[str, torch.nn.Parameter]],
    spec_of: SpecFn,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = 5,
    use_muon: bool = True,
    ns_dtype: torch.dtype | None = None,
    ns_cuda_graphs: bool = False,
    momentum_dtype: torch.dtype | None = None,
    ns_chunk: int = 0,
    side_stream: bool = False,
) -> Optimizers:
    """Split the trainable parameters between Per-Head Muon and AdamW.

    `spec_of(name, param)` says how each parameter is optimised; parameters
    with requires_grad=False are left out. With `use_muon=False` every
    parameter goes to AdamW (keeping its spec's weight_decay). `side_stream`:
    AdamW's step and Muon's update passes on a CUDA stream of their own
    (`Optimizers.step`); the parameters must be on a CUDA device.
    """
    if not lr >= 0:
        raise ValueError(f"build_optimizers: lr={lr}; must be >= 0")
    if not weight_decay >= 0:
        raise ValueError(f"build_optimizers: weight_decay={weight_decay}; must be >= 0")

    # Muon groups keyed by (num_heads, per_expert, weight_decay); AdamW by (weight_decay, replicated).
    # NOTE: replicated parameters get AdamW groups of their own at every world size: under FSDP they are
    # plain tensors among DTensors, which one fused AdamW call cannot mix, and a checkpoint's grouping must
    # not depend on the world size that wrote it.
    muon_groups: dict[tuple[int, bool, bool], list[tuple[str, torch.nn.Parameter]]] = {}
    adamw_groups: dict[tuple[bool, bool], list[tuple[str, torch.nn.Parameter]]] = {
        (decay, replicated): [] for replicated in (False, True) for decay in (True, False)}
    seen: dict[int, str] = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        if id(p) in seen:
            raise ValueError(f"build_optimizers: parameter {name!r} is the same tensor as {seen[id(p)]!r}")
        seen[id(p)] = name
        spec = spec_of(name, p)
        check_spec(name, p.shape, spec)
        if use_muon and spec.use_muon:
            muon_groups.setdefault((spec.num_heads, spec.per_expert, spec.weight_decay), []).append((name, p))
        else:
            adamw_groups[(spec.weight_decay, spec.replicated)].append((name, p))
    if not seen:
        raise ValueError("build_optimizers: named_params holds no trainable parameter")

    optimizers: dict[str, torch.optim.Optimizer] = {}
    names: dict[str, list[str]] = {}
    if muon_groups:
        groups = [
            {"params": [p for _, p in members], "num_heads": heads, "per_expert": per_expert,
             "weight_decay": weight_decay if decay else 0.0}
            for (heads, per_expert, decay), members in muon_groups.items()
        ]
        optimizers["muon"] = PerHeadMuon(
            groups, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, ns_dtype=ns_dtype, ns_cuda_graphs=ns_cuda_graphs, momentum_dtype=momentum_dtype,
            ns_chunk=ns_chunk,
        )
        names["muon"] = [n for members in muon_groups.values() for n, _ in members]
    adamw_members = [(decay, m) for (decay, _), m in adamw_groups.items() if m]
    if adamw_members:
        groups = [{"params": [p for _, p in m], "weight_decay": weight_decay if decay else 0.0}
                  for decay, m in adamw_members]
        # NOTE: fused on every device (torch has CPU and CUDA kernels): one launch per group, and the
        # found_inf input that lets the trainer skip an update without reading a flag on the host.
        optimizers["adamw"] = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=True)
        names["adamw"] = [n for _, m in adamw_members for n, _ in m]
    stream = None
    if side_stream:
        device = next(p.device for p in (p for o in optimizers.values() for g in o.param_groups for p in g["params"]))
        if device.type != "cuda":
            raise ValueError(f"build_optimizers: side_stream needs parameters on a CUDA device; they are on {device}")
        stream = torch.cuda.Stream(device)
    return Optimizers(optimizers, names, stream)


@torch.no_grad()
def _init_adamw_state(opt: torch.optim.Optimizer) -> None:
    """Allocate AdamW's state exactly as its first step would, without changing any parameter.

    NOTE: AdamW allocates state inside step(), and the layout (step counter
    dtype and device, fused or not) depends on the torch version, so this runs
    one step with zero gradients and lr 0 (p * (1 - 0) and p - 0 * 0 / eps are
    exact no-ops) and then sets the step counters back to 0, which is the
    state a real first step starts from.
    """
    if opt.state:
        return
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad for p in params]
    lrs = [g["lr"] for g in opt.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in opt.param_groups:
        g["lr"] = 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, grads):
        p.grad = grad
    for state in opt.state.values():
        state["step"].zero_()
