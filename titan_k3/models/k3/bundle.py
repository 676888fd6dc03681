"""The K3 family as the trainer sees it: its ModelSpec and its step hooks.

Glue, not model code: the one module of the family that reaches the optimizer
side (QK-Clip rescales MLA weights after each step), so the layers themselves
stay free of it (docs/architecture.md §3).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kernels.device import host_to_device
from titan_k3.models.k3.args import FLAVORS, K3Args, count_params, flops_per_token, get_flavor
from titan_k3.models.k3.documents import Documents, OnHost
from titan_k3.models.k3.expert_shadows import ExpertShadows
from titan_k3.models.k3.impl import Impl, resolve_impl
from titan_k3.models.k3.model import K3Model
from titan_k3.models.k3.moe import apply_deferred_updates
from titan_k3.models.model_spec import ModelSpec
from titan_k3.optim.qk_clip import qk_clip_


def build_k3(args: K3Args, impl: Impl, model_cfg) -> K3Model:
    """K3Model on the current default device; `model_cfg` is the [model] section (its Quantile Balancing step)."""
    return K3Model(args, impl, model_cfg.qb_eta)


def resolve_k3_kernels(kernels_cfg, device: torch.device, args: K3Args, compute_dtype: torch.dtype) -> Impl:
    return resolve_impl(kernels_cfg, device, args.max_mix_sources,
                        router_experts=args.n_experts if args.n_dense_layers < args.n_layers else None,
                        qk_width=args.qk_nope_dim + args.qk_rope_dim if args.mla_layers else None,
                        attention_width=max(args.qk_nope_dim + args.qk_rope_dim, args.v_head_dim)
                        if args.mla_layers else None,
                        kda_width=args.kda_head_dim if len(args.mla_layers) < args.n_layers else None,
                        compute_dtype=compute_dtype)


def k3_batch_inputs(batch, device: torch.device) -> tuple:
    """(input_ids, labels) on `device`, document boundaries left on the host (`OnHost`: FSDP2 passes them as they are)."""
    return host_to_device(batch.input_ids, device), host_to_device(batch.labels, device), OnHost.wrap(batch.cu_seqlens)


def k3_graph_inputs(batch, device: torch.device, max_documents: int, into: tuple | None = None) -> tuple:
    """(input_ids, labels, Documents padded to max_documents) in fixed shapes; see ModelSpec.graph_inputs."""
    B, T = batch.input_ids.shape
    # One empty document at least pads the boundaries: our KDA kernels point the chunk table's padding at it.
    docs = Documents.build(B, T, batch.cu_seqlens, device, capacity=max_documents + 1)
    if into is None:
        return host_to_device(batch.input_ids, device), host_to_device(batch.labels, device), docs.owned()
    ids, labels, static_docs = into
    for dst, src in ((ids, batch.input_ids), (labels, batch.labels)):
        dst.copy_(src.pin_memory() if device.type == "cuda" else src, non_blocking=True)  # no host stall (host_to_device)
    static_docs.copy_(docs)
    return into


class K3StepHooks:
    """Quantile Balancing after each micro-batch's backward, QK-Clip after each optimizer step (docs/k3.md §5, §6.3).

    Built once the model is parallelized and its weights initialised; it sets the
    routers up for training: the bias move of each training forward is deferred to
    `after_backward`, where one all-reduce over `dp_group` serves every router.
    """

    def __init__(self, model: K3Model, cfg, device: torch.device, dp_group: dist.ProcessGroup | None):
        self.model, self.dp_group = model, dp_group
        self.tau = cfg.optimizer.qk_clip_tau
        self.routers = list(model.moe_routers().values())
        for router in self.routers:
            router.update_enabled = cfg.model.qb_update
            router.dp_group = dp_group
            router.defer_update = True
        if device.type == "cuda" and cfg.training.compute_dtype == "bfloat16":
            model.compute_dtype = torch.bfloat16  # the embedding and the fused head + loss run outside autocast
        self.qk_clip_max_logits: dict[int, torch.Tensor] = {}
        """MLA layer -> its per-head max logit of the last update (float32 [H], max over the data-parallel ranks)."""
        self.expert_shadows = ExpertShadows(model)
        """The experts' weight shadows (kernels.expert_weight_shadows; empty without)."""

    def bind_optimizers(self, optimizers) -> None:
        """Per-Head Muon's update pass writes the experts' shadows; refused if it does not update every master."""
        if self.expert_shadows:
            muon = optimizers.optimizers.get("muon")
            self.expert_shadows.check_owned(muon)
            muon.shadows = self.expert_shadows.by_master()

    def before_forward(self) -> None:
        self.expert_shadows.refresh_stale()  # masters written since (initialisation, a checkpoint load)

    def after_backward(self) -> None:
        apply_deferred_updates(self.routers, self.dp_group)  # before the next micro-batch routes

    @torch.no_grad()
    def after_step(self, skip: torch.Tensor) -> None:
        """QK-Clip; a skipped update (`skip`, on the device) clips nothing."""
        layers = self.model.mla_layers()
        if not layers:
            return
        # NOTE: every MLA layer's per-head maxima in one all-reduce, not one collective per layer.
        maxima = torch.cat([layer.pop_max_logit() for layer in layers.values()])
        if self.dp_group is not None:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=self.dp_group)
        for (i, layer), max_logit in zip(layers.items(), maxima.split([layer.n_heads for layer in layers.values()])):
            self.qk_clip_max_logits[i] = max_logit
            if self.tau > 0:
                # NOTE: a max of 0 clips no head (gamma = 1 unless the max exceeds tau > 0).
                qk_clip_(layer.wq_b.weight, layer.wkv_b.weight, torch.where(skip, 0.0, max_logit), n_heads=layer.n_heads,
                         nope_dim=layer.nope, rope_dim=layer.rope, v_dim=layer.v_dim, tau=self.tau)


def k3_step_hooks(model: nn.Module, cfg, device: torch.device, dp_group) -> K3StepHooks:
    return K3StepHooks(model, cfg, device, dp_group)


K3_MODEL_SPEC = ModelSpec(
    name="k3",
    flavors=FLAVORS,
    card_flavor="k3",
    args=get_flavor,
    resolve_kernels=resolve_k3_kernels,
    build=build_k3,
    count_params=count_params,
    flops_per_token=flops_per_token,
    routed_experts=lambda args: args.n_experts,
    batch_inputs=k3_batch_inputs,
    step_hooks=k3_step_hooks,
    graph_inputs=k3_graph_inputs,
)
