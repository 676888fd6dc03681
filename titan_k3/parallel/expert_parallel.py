"""Expert parallelism: the LatentMoE's routed experts split over the "ep" ranks.

Legend: T local tokens, k experts per token, S = T * k token-slots, E experts,
E_loc = E / ep experts per rank, L latent width, R rows a rank receives.

Each rank routes its own tokens. The latent rows (width L, not D: the
LatentMoE projects down before the experts) are sorted by expert and sent
to the rank that owns the expert with one all-to-all; the experts run there
on everything they received; a second all-to-all brings the outputs home,
where the routing weights combine them. The per-expert counts are exchanged
once per layer and forward (one small all-to-all), which also sizes both
transfers. Routing weights never leave their rank, so their gradient is local.

Host waits: the split sizes must reach the host before the all-to-all, one
wait per layer and forward. An activation-checkpoint recompute routes exactly
as its forward did (`routing_recompute`), so it reuses that forward's splits
and does not wait again; a device-side assert checks the counts agree.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from titan_k3.models.k3.moe import count_ids, in_routing_recompute


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallel:
    """A drop-in `experts_fn` (same signature as kernels' moe_experts) that runs this rank's experts only.

    `w1 [E_loc, L, F]`, `w3 [E_loc, L, F]`, `w2 [E_loc, F, L]` are this rank's
    experts (DTensors sharded over "ep", or their local tensors); `experts_fn`
    is the local grouped-expert implementation chosen by the kernel report.
    """

    def __init__(self, experts_fn: Callable, group: dist.ProcessGroup, n_experts: int):
        self.experts_fn = experts_fn
        self.group = group
        self.ep = dist.get_world_size(group)
        self.n_experts = n_experts
        assert n_experts % self.ep == 0
        self.n_local = n_experts // self.ep
        # (counts_E, recv_counts, send_split, recv_split) of the last training forward, for its recompute.
        self._splits_for_recompute: tuple | None = None
        self.reset_counts()

    def reset_counts(self) -> None:
        """Dispatch accounting since the last reset, read by the EP invariant check."""
        self.sent_W = torch.zeros(self.ep, dtype=torch.int64)
        self.received_W = torch.zeros(self.ep, dtype=torch.int64)
        self.routed_tokens = 0
        self.top_k = 0

    # NOTE: the split sizes are data-dependent host integers; dynamo would break
    # the graph here anyway, so the dispatch is kept out of compiled regions explicitly.
    @torch.compiler.disable
    def __call__(self, z_TL, w1, w3, w2, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        T, k = experts_TK.shape
        flat_S = experts_TK.reshape(-1)
        order_S = torch.argsort(flat_S, stable=True)
        counts_E = count_ids(flat_S, self.n_experts)
        recompute = in_routing_recompute()
        if recompute and self._splits_for_recompute is not None:
            forward_counts, recv_counts, send_split, recv_split = self._splits_for_recompute
            torch._assert_async((counts_E == forward_counts).all(), "EP recompute routed differently from its forward")
        else:
            recv_counts = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_counts, counts_E, group=self.group)
            send_split = counts_E.view(self.ep, self.n_local).sum(1).tolist()  # the one host wait
            recv_split = recv_counts.view(self.ep, self.n_local).sum(1).tolist()

        if not recompute:  # an activation-checkpoint recompute dispatches again: count once
            if torch.is_grad_enabled():
                self._splits_for_recompute = (counts_E, recv_counts, send_split, recv_split)
            self.sent_W += torch.tensor(send_split)
            self.received_W += torch.tensor(recv_split)
            self.routed_tokens += T
            self.top_k = k

        x_send = z_TL[order_S // k]
        x_recv = funcol.all_to_all_single_autograd(x_send, recv_split, send_split, self.group)
        # Rows arrive grouped by source rank, then by local expert: label each with its local expert.
        local_ids = torch.arange(self.n_local, device=z_TL.device).repeat(self.ep)
        ids_R1 = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(recv_split))[:, None]  # no wait
        ones_R1 = torch.ones(ids_R1.shape, dtype=z_TL.dtype, device=z_TL.device)
        y_recv = self.experts_fn(x_recv, _local(w1), _local(w3), _local(w2), ids_R1, ones_R1)
        y_send = funcol.all_to_all_single_autograd(y_recv, send_split, recv_split, self.group)

        inverse_S = torch.empty_like(order_S)
        inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
        y_SL = y_send[inverse_S].view(T, k, -1)
        return (y_SL.float() * weights_TK.float()[..., None]).sum(1).to(z_TL.dtype)
