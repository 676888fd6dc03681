"""The eager peer: our k3-mini model run eagerly on public kernels, none of our recipe.

fla's chunk_kda (safe gate, in-kernel gate / L2 norm), cuDNN SDPA for MLA
(plain causal: no document masks), `torch._grouped_mm` experts with a
sync-free permutation, bf16 parameters, fused AdamW, bf16 logits +
F.cross_entropy; no Muon, no Quantile Balancing update, no clipping, no
QK-Clip. Every throughput result carries its ratio to this peer measured in
the same run (benchmarks/train_throughput.py imports `PeerTrainer`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.grouped_gemm.torch_grouped_mm import moe_experts_torch_grouped_mm
from titan_k3.models.k3.args import get_flavor
from titan_k3.models.k3.impl import Impl, KernelChoice, fla_chunk_kda
from titan_k3.models.k3.model import K3Model


def naive_bf16_cross_entropy(h, weight, targets, ignore_index=-100):
    logits = h.to(torch.bfloat16) @ weight.to(torch.bfloat16).t()
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return loss.float(), (targets != ignore_index).sum()


def peer_impl() -> Impl:
    from torch.nn.attention import SDPBackend

    return Impl(
        kda=fla_chunk_kda, experts=moe_experts_torch_grouped_mm, loss=naive_bf16_cross_entropy,
        sdpa_backends=[SDPBackend.CUDNN_ATTENTION],
        choices=[KernelChoice("kda", "fla", "fla", False), KernelChoice("experts", "grouped_mm", "grouped_mm", False),
                 KernelChoice("loss", "naive", "bf16 logits + F.cross_entropy", False),
                 KernelChoice("attention", "cudnn", "cudnn", False)],
    )


class PeerTrainer:
    """One eager training step of the peer on the batches our loader yields (documents ignored)."""

    def __init__(self, vocab_size: int = 163840, lr: float = 3e-3, seed: int = 0):
        torch.manual_seed(seed)
        model = K3Model(get_flavor("k3-mini", vocab_size), peer_impl()).cuda()
        model.init_weights(seed)
        for router in model.moe_routers().values():
            router.update_enabled = False
        for mla in model.mla_layers().values():
            mla.track_max_logit = False
        self.model = model.to(torch.bfloat16).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def train_step(self, batch) -> float:
        out = self.model(batch.input_ids.cuda(), batch.labels.cuda(), None)
        loss = out.loss_sum / out.n_valid.clamp(min=1)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())
