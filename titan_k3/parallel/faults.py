"""The [debug] fault injections that live in the parallel code path, and the start-up check of all of them.

Each reproduces a silent distributed bug in a real run, so that a test (or a
person) can see the invariant that must catch it fire by name:
  debug.inject_same_data        two ranks read the same data            -> data.disjoint_sequences
  debug.inject_replica_drift    one rank's replicated weights move      -> replicas.checksums
  debug.inject_grad_scale       fsdp_average: FSDP2 averages gradients  -> gradient_scale.probe_reference
                                local_normaliser: loss / local count    -> gradient_scale.loss_normaliser
The same-data and normaliser injections sit where the trainer builds the
loader and divides the loss; fsdp_average is `apply_fsdp`'s divide factor.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_k3.config import ConfigError
from titan_k3.config.errors import toml_value


def active_injections(debug_cfg) -> dict[str, object]:
    """{key: value} of every [debug] injection that is on."""
    on = {
        "debug.inject_same_data": debug_cfg.inject_same_data,
        "debug.inject_replica_drift": debug_cfg.inject_replica_drift,
        "debug.inject_grad_scale": debug_cfg.inject_grad_scale if debug_cfg.inject_grad_scale != "none" else None,
    }
    return {key: value for key, value in on.items() if value}


def check_injections(debug_cfg, dp_world: int) -> None:
    """Every injection is a cross-rank bug: refuse one in a run with a single data-parallel rank (one line)."""
    on = active_injections(debug_cfg)
    if on and dp_world < 2:
        key, value = next(iter(on.items()))
        raise ConfigError(f"config key '{key}' = {toml_value(value)}: a fault injection needs 2 or more data-parallel ranks "
                          f"(this run has {dp_world}); launch with torchrun --nproc_per_node 2 or more")


@torch.no_grad()
def inject_replica_drift(model: nn.Module, amount: float) -> list[str]:
    """Add `amount` to the first element of every tensor this rank holds a replica of; returns their names.

    Replicas: plain parameters (the routers, whole on every rank) and DTensor
    shards with a Replicate placement (HSDP). Called on one rank only.
    """
    from torch.distributed.tensor import DTensor, Replicate

    moved = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            if not any(isinstance(pl, Replicate) and p.device_mesh.size(i) > 1 for i, pl in enumerate(p.placements)):
                continue
            local = p.to_local()
        else:
            local = p.data
        if local.numel():
            local[(0,) * local.dim()] += amount
            moved.append(name)
    return moved
