"""The gradient-scale probe: one micro-batch through the parallel model and through a plain single-process copy.

Every data-parallel rank trains on the same micro-batch (data-parallel rank
0's first of the update), its summed loss divided by (valid targets x ranks):
once the parallel reduction has summed the ranks' gradients, each parameter's
gradient is that batch's mean-loss gradient, exactly what an unsharded copy
of the model computes on the batch in one process. FSDP averaging instead of
summing (or a reduction over the wrong group, or a missing one) breaks the
equality by a factor such as 1/W; a gradient norm alone cannot, because the
clipped norm and any audit of it read the same mis-scaled gradient.

The probe leaves training untouched: it runs before the update's first
forward with no gradient held, restores every plain buffer it moved (expert
load counts, MLA max logits), drops the routers' pending balancing step and
the expert-parallel dispatch counts it added, and frees its gradients.
Cost: one forward and backward of one micro-batch through the parallel model,
one through the copy, and an all-gather of every parameter and gradient; the
copy holds one full float32 model on each device while it runs (fine up to
k3-mini, not for the full k3 card).
"""

from __future__ import annotations

import contextlib
from itertools import chain
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from titan_k3.models.k3.documents import OnHost
from titan_k3.parallel.distributed import comm_device, sum_replicated_grads


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shared_batch(batch, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, cu_seqlens) of data-parallel rank 0's `batch`, on every rank of `group` (host tensors)."""
    cu_seqlens = None if batch.cu_seqlens is None else batch.cu_seqlens.cpu()
    box = [(batch.input_ids.cpu(), batch.labels.cpu(), cu_seqlens)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group, device=comm_device(group))
    return box[0]


@contextlib.contextmanager
def _side_effects_restored(model: nn.Module, dispatchers: list):
    """Put back what a training forward accumulates outside the gradients."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not hasattr(b, "full_tensor")}
    counts = [(d.sent_W.clone(), d.received_W.clone(), d.routed_tokens.clone()) for d in dispatchers]
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
            for d, saved in zip(dispatchers, counts):
                for live, old in zip((d.sent_W, d.received_W, d.routed_tokens), saved):
                    live.copy_(old)
        for router in model.moe_routers().values():
            router._pending = None


def probe_gradients(model: nn.Module, batch, *, build_copy: Callable[[], nn.Module], group: dist.ProcessGroup,
                    device: torch.device, autocast: Callable[[], contextlib.AbstractContextManager],
                    dispatchers: list = ()) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(parallel gradients gathered whole, the single-process copy's gradients), float32, by parameter name.

    batch: this rank's first micro-batch (only data-parallel rank 0's is used).
    build_copy: builds the unsharded model on the meta device (the trainer's own builder).
    autocast: the training step's autocast context. Collective over `group`; no gradient may be held.
    """
    assert all(p.grad is None for p in model.parameters()), "the probe runs before the update's first backward"
    ids, labels, cu_seqlens = _shared_batch(batch, group)
    world = dist.get_world_size(group)

    # The reference first: its full parameters are gathered before any probe gradient exists.
    with torch.device("meta"):
        copy = build_copy()
    copy.to_empty(device=device)
    with torch.no_grad():
        source = dict(chain(model.named_parameters(), model.named_buffers()))
        for name, target in chain(copy.named_parameters(), copy.named_buffers()):
            target.copy_(_full(source[name]).to(target.dtype))
    for router in copy.moe_routers().values():
        router.update_enabled, router.dp_group = False, None
    copy.compute_dtype = model.compute_dtype
    copy.train()
    with autocast():
        out = copy(ids.to(device), labels.to(device), OnHost.wrap(cu_seqlens))
    (out.loss_sum / out.n_valid.clamp(min=1)).backward()
    reference = {name: p.grad.detach().float() for name, p in copy.named_parameters() if p.grad is not None}
    del copy, out

    with _side_effects_restored(model, list(dispatchers)):
        with autocast():
            out = model(ids.to(device), labels.to(device), OnHost.wrap(cu_seqlens))
        (out.loss_sum / (out.n_valid.clamp(min=1) * world)).backward()
        sum_replicated_grads(model, group)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            grads[name] = _full(p.grad).detach().float()
            p.grad = None
    missing = sorted(set(reference) - set(grads))
    assert not missing, f"the parallel model produced no gradient for {missing[:4]}"
    return grads, reference
