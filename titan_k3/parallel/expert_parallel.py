"""Expert parallelism: the LatentMoE's routed experts split over the "ep" ranks.

Legend: W ranks in the EP group, T local tokens, k experts per token,
S = T * k token-slots, E experts, E_loc = E / W experts per rank, L latent
width, R rows a rank receives.

Each rank routes its own tokens; the latent rows (width L, not D: the
LatentMoE projects down before the experts) travel to the experts' ranks in
one of two ways (`parallelism.expert_dispatch`):

all_gather (the default): every rank gathers the group's latent rows, routing
weights and expert ids ([W*T, ...], packed into one all-gather), runs its own experts
on the slots routed to them (other ranks' slots carry the id E_loc, which
sorts past this rank's last expert: the grouped kernels do no GEMM work for
them and their output rows are zero), and a reduce-scatter sums the W partial outputs
back to the rank that owns each token. Every size is fixed, so nothing waits
on the host and the MoE sublayer compiles as one graph; the autograd of the
collectives gives the backward (gather <-> reduce-scatter). It moves each
token once (not once per routed slot), and costs expert buffers sized for all
W*S slots: right for small EP inside a node.

all_to_all: the slots are sorted by expert and only the routed rows are sent
(one all-to-all there, one back), sized by a per-layer exchange of the
per-expert counts that the host waits for: one wait per layer and forward (an
activation-checkpoint recompute reuses its forward's splits, and a
device-side assert checks it routed alike). Buffers hold only the rows that
arrive: right for large EP.

Both keep routing weights' gradients exact, and both count what each rank
dispatched to and received from every other rank, on the device (no sync),
for the EP invariant check (`check_ep_token_counts`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from titan_k3.models.k3.moe import count_ids, in_routing_recompute

# NOTE: torch 2.13 renamed the autograd collectives (the old names warn); torch 2.11 has only the old ones.
_all_gather_autograd = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_reduce_scatter_autograd = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd

DISPATCHES = ("all_gather", "all_to_all")
_ID_BASE = 256  # expert ids ride the dispatch's all-gather as two floats below 256 (exact in bf16): E <= 65,536


def _local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


class ExpertParallel:
    """A drop-in `experts_fn` (same signature as kernels' moe_experts) that runs this rank's experts only.

    `w1 [E_loc, L, F]`, `w3 [E_loc, L, F]`, `w2 [E_loc, F, L]` are this rank's
    experts (DTensors sharded over "ep", or their local tensors); `experts_fn`
    is the local grouped-expert implementation chosen by the kernel report.
    """

    def __init__(self, experts_fn: Callable, group: dist.ProcessGroup, n_experts: int, top_k: int,
                 device: torch.device, dispatch: str = "all_gather"):
        if dispatch not in DISPATCHES:
            raise ValueError(f"expert dispatch {dispatch!r}: expected one of {DISPATCHES}")
        self.experts_fn = experts_fn
        self.group = group
        self.dispatch = dispatch
        self.waits_on_host = dispatch == "all_to_all"  # read by LatentMoE to order the shared expert
        self.ep = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.n_experts = n_experts
        self.top_k = top_k
        assert n_experts % self.ep == 0
        assert n_experts <= _ID_BASE ** 2, f"{n_experts} experts: the all_gather dispatch sends ids below {_ID_BASE ** 2}"
        self.n_local = n_experts // self.ep
        # (counts_E, recv_counts, send_split, recv_split) of the last all-to-all training forward, for its recompute.
        self._splits_for_recompute: tuple | None = None
        # Dispatch accounting since the last reset, read by the EP invariant check (device tensors: no sync).
        self.sent_W = torch.zeros(self.ep, dtype=torch.int64, device=device)
        self.received_W = torch.zeros(self.ep, dtype=torch.int64, device=device)
        self.routed_tokens = torch.zeros((), dtype=torch.int64, device=device)

    def reset_counts(self) -> None:
        """Zero the dispatch accounting (in place: compiled code holds these tensors)."""
        for counts in (self.sent_W, self.received_W, self.routed_tokens):
            counts.zero_()

    def __call__(self, z_TL, w1, w3, w2, experts_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = _local(w1), _local(w3), _local(w2)
        if self.dispatch == "all_gather":
            return self._gathered(z_TL, w1, w3, w2, experts_TK, weights_TK)
        return self._all_to_all(z_TL, w1, w3, w2, experts_TK, weights_TK)

    def _gathered(self, z_TL, w1, w3, w2, experts_TK, weights_TK) -> torch.Tensor:
        T, k = experts_TK.shape
        L = z_TL.shape[1]
        # NOTE: one all-gather carries the rows, their routing weights and their expert ids, not three: every
        # collective costs a launch and a latency on the MoE's critical path, in forward and (as a
        # reduce-scatter) in backward. An id travels as two small whole numbers (id // 256, id % 256), exact
        # in any float dtype, as values (not bit patterns, which a fused copy could flush as subnormals).
        ids_TK2 = torch.cat([experts_TK // _ID_BASE, experts_TK % _ID_BASE], dim=1).to(z_TL.dtype)
        packed_GC = _all_gather_autograd(torch.cat([z_TL, weights_TK.to(z_TL.dtype), ids_TK2], dim=1), 0, self.group)
        z_GL, p_GK = packed_GC[:, :L].contiguous(), packed_GC[:, L:L + k]  # G = W*T, rank-major
        hi_GK, lo_GK = packed_GC[:, L + k:].detach().long().split(k, dim=1)
        ids_GK = hi_GK * _ID_BASE + lo_GK
        local_GK = ids_GK - self.rank * self.n_local
        mine_GK = (local_GK >= 0) & (local_GK < self.n_local)
        # Other ranks' slots get the id E_loc (past the last local expert) and weight 0: they contribute nothing.
        local_GK = torch.where(mine_GK, local_GK, self.n_local)
        p_GK = torch.where(mine_GK, p_GK, torch.zeros_like(p_GK))
        y_GL = self.experts_fn(z_GL, w1, w3, w2, local_GK, p_GK)
        if not in_routing_recompute():  # an activation-checkpoint recompute dispatches again: count once
            self.sent_W += count_ids(experts_TK // self.n_local, self.ep)
            self.received_W += mine_GK.view(self.ep, T * k).sum(1)
            self.routed_tokens += T
        return _reduce_scatter_autograd(y_GL, "sum", 0, self.group)

    # NOTE: the split sizes are data-dependent host integers; dynamo would break
    # the graph here anyway, so this dispatch is kept out of compiled regions explicitly.
    @torch.compiler.disable
    def _all_to_all(self, z_TL, w1, w3, w2, experts_TK, weights_TK) -> torch.Tensor:
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
            self.sent_W += counts_E.view(self.ep, self.n_local).sum(1)
            self.received_W += recv_counts.view(self.ep, self.n_local).sum(1)
            self.routed_tokens += T

        x_send = z_TL[order_S // k]
        x_recv = funcol.all_to_all_single_autograd(x_send, recv_split, send_split, self.group)
        # Rows arrive grouped by source rank, then by local expert: label each with its local expert.
        local_ids = torch.arange(self.n_local, device=z_TL.device).repeat(self.ep)
        ids_R1 = torch.repeat_interleave(local_ids, recv_counts, output_size=sum(recv_split))[:, None]  # no wait
        ones_R1 = torch.ones(ids_R1.shape, dtype=z_TL.dtype, device=z_TL.device)
        y_recv = self.experts_fn(x_recv, w1, w3, w2, ids_R1, ones_R1)
        y_send = funcol.all_to_all_single_autograd(y_recv, send_split, recv_split, self.group)

        inverse_S = torch.empty_like(order_S)
        inverse_S[order_S] = torch.arange(order_S.numel(), device=order_S.device)
        y_SL = y_send[inverse_S].view(T, k, -1)
        acc = torch.float64 if z_TL.dtype == torch.float64 else torch.float32
        return (y_SL.to(acc) * weights_TK.to(acc)[..., None]).sum(1).to(z_TL.dtype)
