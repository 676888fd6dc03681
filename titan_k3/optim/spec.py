"""What the optimizer builder needs to know about one parameter.

The model never imports this module: the trainer passes `build_optimizers` a
`spec_of(name, param) -> ParamSpec` callable that translates whatever the
model says about its parameters into this plain record.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    """How one parameter is optimised.

    use_muon:     matrices go to Per-Head Muon; embeddings, the output head,
                  norms, A_log, dt_bias, convolutions, pseudo-queries and the
                  router go to AdamW.
    num_heads:    Muon only: split dim 0 of a 2-D weight [out, in] into this
                  many equal row blocks, each orthogonalised on its own.
    per_expert:   Muon only: a 3-D weight [E, a, b] is E matrices.
    weight_decay: False for norms, A_log, dt_bias and pseudo-queries.
    replicated:   kept whole on every data-parallel rank (FSDP leaves it out; its
                  gradient is summed over the ranks): the routers, whose float32
                  weights must not pass through FSDP's bf16 all-gather. AdamW keeps
                  these in groups of their own, whatever the world size.
    """

    use_muon: bool
    num_heads: int = 1
    per_expert: bool = False
    weight_decay: bool = True
    replicated: bool = False


def check_spec(name: str, shape: torch.Size | tuple[int, ...], spec: ParamSpec) -> None:
    """Raise ValueError (one line naming the parameter) if `spec` cannot apply to `shape`."""
    if not isinstance(spec, ParamSpec):
        raise ValueError(f"spec_of({name!r}) returned {type(spec).__name__}; expected a ParamSpec")
    if not isinstance(spec.num_heads, int) or spec.num_heads < 1:
        raise ValueError(f"{name}: num_heads={spec.num_heads!r}; must be an int >= 1")
    if not spec.use_muon:
        if spec.num_heads != 1 or spec.per_expert:
            raise ValueError(
                f"{name}: num_heads={spec.num_heads}, per_expert={spec.per_expert} "
                "only apply to Muon parameters (use_muon=True)"
            )
        return
    if spec.per_expert:
        if len(shape) != 3:
            raise ValueError(f"{name}: per_expert needs a 3-D [E, a, b] weight; got shape {tuple(shape)}")
        if spec.num_heads != 1:
            raise ValueError(f"{name}: num_heads={spec.num_heads} cannot be combined with per_expert")
        return
    if len(shape) != 2:
        raise ValueError(
            f"{name}: Muon needs a 2-D weight (or 3-D with per_expert=True); got shape {tuple(shape)}"
        )
    if shape[0] % spec.num_heads != 0:
        raise ValueError(
            f"{name}: num_heads={spec.num_heads} does not divide dim 0 of shape {tuple(shape)}"
        )
